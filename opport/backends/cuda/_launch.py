"""Launch helpers shared by the Triton kernels: strided layouts, tile sizes, index math.

Layouts. A row-wise kernel (norms, softmax, cross-entropy) reduces over one axis and maps over the
others; an elementwise kernel maps over everything. Both see a tensor as `lead x cols` where `lead`
is at most three leading dims (after merging dims that are contiguous with each other in every
tensor of the launch) and `cols` is the last dim, each with its own stride. So transposed, sliced,
stride-0 expanded and offset views are read in place. Only a layout that still has more than three
leading dims after merging (five-plus-d tensors with irregular strides) is copied to contiguous
first: `Layout.of` returns None and the launcher calls `.contiguous()`; that copy is the only one.

Offsets. Every element offset is computed in int64 (`lead_index`, `at`), so tensors past 2^31
elements index correctly; pointers stay 64-bit, only the per-tile index vectors widen.

Tile sizes. On a GPU, a program holds whole rows up to `ROW_MAX` elements in registers (one read,
one write) and packs several short rows per program so that each moves at least ~4K elements.
In the interpreter (one program at a time, each op a NumPy call with fixed overhead) fewer,
larger programs are faster, so tiles go up to `INTERP_TILE` elements.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

from opport.backends.cuda import setup

INTERPRET = setup() == "interpreter"  # before any @triton.jit below: Triton reads the mode at definition

import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402


def _fix_interpreter_index():
    """Let loops run to a kernel argument in the interpreter under NumPy >= 2.4 (triton-lang/triton#9171).

    The interpreter holds scalar arguments as 1-element arrays and converts them with `int(array)`,
    which NumPy 2.4 refuses, so `for k in range(0, n, BLOCK)` fails. This applies the upstream fix
    (take the single element) to the interpreter's tensor patching, only when the bug is present.
    """
    from triton.runtime import interpreter

    try:
        int(np.ones(1, np.int32))
        return
    except TypeError:
        pass
    original = interpreter._patch_lang_tensor
    if getattr(original, "_opport_fixed", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch._opport_fixed = True
    interpreter._patch_lang_tensor = patch


def _list_builtins_once():
    """The interpreter patches every builtin of triton.language (and of its tensor and math namespaces) on each
    launch, finding them by `inspect.getmembers`, which lists and sorts every member each time: a third of a small
    kernel's time in CI. The builtins never change (each launch's patches are undone when it ends), so they are
    listed once per namespace and patched from that list: the same patches, without the listing."""
    import inspect

    from triton.runtime import interpreter

    if getattr(interpreter._patch_builtin, "_opport_listed", False):
        return
    listed = {}  # id(namespace) -> (namespace, its builtins as (name, original member))

    def patch_builtin(pkg, builder, scope):
        if id(pkg) not in listed:
            listed[id(pkg)] = (pkg, [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)])
        for name, member in listed[id(pkg)][1]:
            interpreter._patch_attr(pkg, name, member, builder, scope)

    patch_builtin._opport_listed = True
    interpreter._patch_builtin = patch_builtin


def _patch_lang_once_per_launch():
    """The interpreter patches triton.language again on every call of a @triton.jit helper inside a kernel:
    ~45 attributes per namespace per helper call, 40% of an attention backward's time in the interpreter.
    A launch patches its modules and restores them when it ends; a helper's patches are never restored (the
    interpreter drops their scope), so a module a helper patched stays patched. A helper whose modules are all
    patched already (by the running launch, or for good by an earlier helper) is called without patching again;
    any other goes the interpreter's own way."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    if getattr(original, "_opport_once", False):
        return
    active: set = set()  # ids of the language modules the running launch patched
    kept: set = set()  # ids of those a helper patched outside what its launch had (the interpreter keeps them)

    class LaunchScope(interpreter._LangPatchScope):
        def restore(self):
            super().restore()
            active.clear()

    langs_of: dict = {}  # a function -> ids of the language modules its globals hold (looked up once)

    def patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if active and langs <= active | kept:
            return interpreter._LangPatchScope()  # a helper inside a launch: nothing left to patch
        scope = original(fn)
        if not active:  # a launch (helpers run only inside one)
            scope.__class__ = LaunchScope
            active.update(langs)
        else:
            kept.update(langs - active)
        return scope

    patch_lang._opport_once = True
    interpreter._patch_lang = patch_lang


def _np_dtype_table_once():
    """The interpreter maps a Triton dtype to the NumPy dtype it stores by building a 19-entry dict of np.dtype on
    every call (~25 us, half a million calls in one sampling conformance run: a tenth of its time). The same
    mapping, the table built once."""
    from triton.runtime import interpreter

    original = interpreter._get_np_dtype
    if getattr(original, "_opport_table", False):
        return
    table = {t: original(t) for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
                                      tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5,
                                      tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        return pointer if isinstance(tt_dtype, tl.pointer_type) else table[tt_dtype]

    get_np_dtype._opport_table = True
    interpreter._get_np_dtype = get_np_dtype


def _lazy_tuple_type_names():
    """Every tensor the interpreter makes holds its shape as a tl.tuple, whose tuple_type spells out its name
    string at construction (a str of each element's type); the name is only read when a type is printed. Same
    types, the name spelled out when read: a tenth of an attention kernel's time in the interpreter."""
    cls = tl.core.tuple_type
    if getattr(cls, "_opport_lazy", False):
        return

    def __init__(self, types, fields=None):
        self.types = types
        self.fields = fields or [""] * len(types)

    cls.__init__ = __init__
    cls.name = property(lambda self: "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + "]")
    cls._opport_lazy = True


def _lighter_types():
    """Every op the interpreter runs builds its result's Triton types anew: a block_type (shape unwrapped and checked
    element by element, its name formatted), a tensor whose shape is a fresh tl.tuple of constexprs, and on the way
    millions of `_unwrap_if_constexpr` and `dtype ==` calls: ~40% of an attention conformance run in the
    interpreter. The same objects and answers, with less work: a shape of plain ints is checked once per shape, a
    block_type's name is spelled out when read, a tensor takes its shape and numel from its type (built once per
    shape: shapes are never mutated), the two helpers answer their common cases first, and operands of one shape skip
    the broadcast's element-by-element comparison."""
    core = tl.core
    if getattr(core.block_type, "_opport_light", False):
        return
    constexpr, unwrap, tl_tuple = core.constexpr, core._unwrap_if_constexpr, core.tuple
    leaves = {int, float, bool, str, type(None), core.tensor, core.dtype, core.pointer_type, core.block_type}
    shapes: dict = {}  # a shape of ints -> (its tl.tuple, numel), checked once; shapes are never mutated

    def unwrap_if_constexpr(o):
        kind = type(o)
        if kind is constexpr:
            return o.value
        return o if kind in leaves else unwrap(o)

    def block_init(self, element_ty, shape):
        self.element_ty = element_ty
        dims = shape.values if type(shape) is tl_tuple else shape
        key = tuple(dims) if type(dims) is list and all(type(d) is int for d in dims) else None
        known = shapes.get(key) if key is not None else None
        if known is None:  # constexprs or a new shape: Triton's own unwrapping and checks
            assert isinstance(shape, (list, tl_tuple))
            ints = tl_tuple(core._unwrap_shape(shape))
            if not ints:
                raise TypeError("0d block_type is forbidden")
            numel = triton._utils.validate_block_shape(ints)
            known = (ints, numel, (tl_tuple([constexpr(d) for d in ints]), constexpr(numel)))
            if key is not None:
                shapes[key] = known
        self.shape, self.numel, self._opport_shaped = known

    scalar = (tl_tuple([]), constexpr(1))  # a scalar tensor's shape and numel

    def tensor_init(self, handle, type):
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.shape, self.numel = type._opport_shaped if type.is_block() else scalar

    def dtype_eq(self, other):
        if other is self:
            return True
        if type(other) is constexpr:
            other = other.value
        return isinstance(other, core.dtype) and self.name == other.name

    from triton.language.semantic import TritonSemantic

    broadcast = TritonSemantic.broadcast_impl_value

    def broadcast_impl_value(self, lhs, rhs):
        a, b = lhs.type, rhs.type  # one type, or blocks of one shape (shared per shape above): nothing to broadcast
        if a is b or (a.is_block() and b.is_block() and a.shape is b.shape):
            return lhs, rhs
        return broadcast(self, lhs, rhs)

    TritonSemantic.broadcast_impl_value = broadcast_impl_value
    core._unwrap_if_constexpr = unwrap_if_constexpr
    core.block_type.__init__ = block_init
    core.block_type.name = property(lambda self: f"<{self.shape}, {self.element_ty}>")
    core.tensor.__init__ = tensor_init
    core.dtype.__eq__ = dtype_eq
    core.block_type._opport_light = True


def _no_dead_overflow_checks():
    """Triton widens every int add, sub and mul to int64, redoes it and compares against the type's range (one
    add becomes six ops), all for a device_assert that without debug is nothing: the compiler deletes that work as
    dead code, the interpreter ran it (~20% of a varlen_attention run). Skipped where the assert would be dropped."""
    from triton.language.semantic import TritonSemantic

    checks = TritonSemantic.binary_op_sanitize_overflow_impl
    if getattr(checks, "_opport", False):
        return

    def binary_op_sanitize_overflow_impl(self, lhs, rhs, binary_op):
        if self.builder.options.debug:
            return checks(self, lhs, rhs, binary_op)

    binary_op_sanitize_overflow_impl._opport = True
    TritonSemantic.binary_op_sanitize_overflow_impl = binary_op_sanitize_overflow_impl


if INTERPRET:
    _fix_interpreter_index()
    _lighter_types()
    _no_dead_overflow_checks()
    _lazy_tuple_type_names()
    _list_builtins_once()
    _patch_lang_once_per_launch()
    _np_dtype_table_once()

INTERPRETED = tl.constexpr(INTERPRET)  # what jit code may read: the interpreter needs the bf16 work-arounds below

ROW_MAX = 16384  # whole-row registers: 16K fp32 over 16 warps = 32 values per thread per live array
GPU_TILE = 4096  # elements per program that keep a memory-bound kernel's loads in flight
INTERP_TILE = 1 << 16  # interpreter: ~64K elements per NumPy op amortises its per-op overhead
MAX_LEAD = 3


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


H200_SMS = 132  # the GPU kernels are designed for; what a device-less run (interpreter, tools/cuda_aot.py) assumes


def sm_count(device) -> int:
    """Streaming multiprocessors of a torch device; H200_SMS where there is none to ask (CPU, meta tensors)."""
    if device.type != "cuda":
        return H200_SMS
    import torch

    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def warps_for(elements: int) -> int:
    """num_warps for a memory-bound tile: ~8-16 values per thread in flight."""
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def torch_to_tl(dtype):
    import torch

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
            torch.float64: tl.float64}[dtype]


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """`n_rows` rows (leading dims `sizes` = (n0, n1, n2)) of `n_cols` columns; per-tensor strides."""

    n_rows: int
    n_cols: int
    sizes: tuple  # (n0, n1, n2); a row index r is (r // (n1*n2), r // n2 % n1, r % n2)
    strides: tuple  # per tensor: (s0, s1, s2, s_col)

    @staticmethod
    def of(shape: tuple, *strides: tuple, merge_cols: bool = False) -> Layout | None:
        """Merge dims that are contiguous in every tensor; None if more than MAX_LEAD leading dims remain.

        `merge_cols` also merges the last dim into the leading ones (elementwise ops, where no
        axis is special), so a contiguous tensor becomes one long row.
        """
        dims = [(n, [s[i] for s in strides]) for i, n in enumerate(shape)]
        if not dims:
            dims = [(1, [0 for _ in strides])]
        cols = None if merge_cols else dims.pop()
        lead = []
        for n, ss in dims:
            if n == 1:
                continue
            if lead and all(p == s * n for p, s in zip(lead[-1][1], ss)):
                lead[-1] = (lead[-1][0] * n, ss)
            else:
                lead.append((n, ss))
        if cols is None:
            cols = lead.pop() if lead else (1, [0 for _ in strides])
        if len(lead) > MAX_LEAD:
            return None
        lead = [(1, [0 for _ in strides])] * (MAX_LEAD - len(lead)) + lead
        sizes = tuple(n for n, _ in lead)
        per_tensor = tuple(tuple(ss[t] for _, ss in lead) + (cols[1][t],) for t in range(len(strides)))
        return Layout(math.prod(sizes), cols[0], sizes, per_tensor)

    def args(self, t: int) -> tuple:
        return self.strides[t]


def rows_layout(inputs: list, out, merge_cols: bool = False) -> tuple[Layout, list]:
    """Layout for `inputs` + `out` (out last). Inputs with irregular >3-d leading strides are copied."""
    shape = tuple(out.shape)
    lay = Layout.of(shape, *(t.stride() for t in inputs), out.stride(), merge_cols=merge_cols)
    if lay is None:
        inputs = [t.contiguous() for t in inputs]  # the documented copy (module docstring)
        lay = Layout.of(shape, *(t.stride() for t in inputs), out.stride(), merge_cols=merge_cols)
        assert lay is not None, "outputs are allocated contiguous (or one axis moved), so they always merge"
    return lay, inputs


@dataclass(frozen=True)
class RowConfig:
    block_m: int  # rows per program
    block_n: int  # columns per chunk
    single: bool  # the whole row fits one chunk (one read of the input)
    num_warps: int

    @property
    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "SINGLE": self.single}


def tile_elements() -> int:
    """Elements one program of a memory-bound kernel should cover (see the module docstring)."""
    return INTERP_TILE if INTERPRET else GPU_TILE


def row_config(n_rows: int, n_cols: int) -> RowConfig:
    """Tile for a row-wise kernel: whole rows when they fit, else chunks of ROW_MAX columns."""
    tile = tile_elements()
    cap = INTERP_TILE if INTERPRET else ROW_MAX
    block_n = min(next_pow2(n_cols), cap)
    block_m = max(1, min(next_pow2(n_rows), tile // block_n))
    return RowConfig(block_m, block_n, block_n >= n_cols, warps_for(block_m * block_n))


def elementwise_config(lay: Layout) -> RowConfig:
    """Tile for an elementwise kernel: 2-D (rows x cols) so a short last dim still fills a program."""
    tile = INTERP_TILE if INTERPRET else 2048  # 2K elements over 4 warps: 16 B loads in flight per thread
    block_n = min(next_pow2(lay.n_cols), tile)
    block_m = max(1, min(next_pow2(lay.n_rows), tile // block_n))
    return RowConfig(block_m, block_n, True, warps_for(block_m * block_n))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def elementwise(kernel, inputs: list, out, *scalars, **meta):
    """Launch an elementwise `kernel(*inputs, out, n_rows, n_cols, n1, n2, <4 strides per tensor>, *scalars)`."""
    if out.numel() == 0:
        return out
    lay, inputs = rows_layout(inputs, out, merge_cols=True)
    cfg = elementwise_config(lay)
    grid = (cdiv(lay.n_rows, cfg.block_m) * cdiv(lay.n_cols, cfg.block_n),)
    strides = [s for t in range(len(inputs) + 1) for s in lay.args(t)]
    kernel[grid](*inputs, out, lay.n_rows, lay.n_cols, lay.sizes[1], lay.sizes[2], *strides, *scalars,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, **meta)
    return out


# --------------------------------------------------------------------------- index math in kernels


@triton.jit
def lead_index(rows, n1, n2):
    """Leading-dim indices (int64) of flattened row indices `rows` over leading dims (n0, n1, n2)."""
    r = rows.to(tl.int64)
    return r // (n1 * n2), (r // n2) % n1, r % n2


@triton.jit
def at(i0, i1, i2, cols, s0, s1, s2, sc):
    """Element offsets (int64) of leading indices i0..i2 and columns `cols` for one tensor's strides."""
    return i0 * s0 + i1 * s1 + i2 * s2 + cols.to(tl.int64) * sc


@triton.jit
def elementwise_tile(n_rows, n_cols, n1, n2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile of an elementwise launch: (i0, i1, i2) [BLOCK_M, 1], cols [1, BLOCK_N], mask."""
    pid = tl.program_id(0).to(tl.int64)
    tiles_n = tl.cdiv(n_cols, BLOCK_N)
    rows = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    i0, i1, i2 = lead_index(rows, n1, n2)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return i0[:, None], i1[:, None], i2[:, None], cols[None, :], mask


# --------------------------------------------------------------------------- dtype conversions
# The interpreter (Triton 3.6) stores bfloat16 as raw uint16 bits: its float32 <-> bfloat16 casts truncate
# instead of rounding and mangle subnormals, and its tl.dot multiplies bfloat16 bit patterns as integers.
# These helpers do the conversions by bits there (exact, round-to-nearest-even) and use the hardware
# conversions in compiled mode.


@triton.jit
def f32(x):
    """x widened to float32, exactly."""
    if INTERPRETED and x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def narrow(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype`, nearest-even (NaN stays NaN)."""
    if INTERPRETED and dtype == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = tl.where(x != x, 0x7FC00000, b + (0x7FFF + ((b >> 16) & 1)))
        return (b >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def dot_operand(x):
    """A tl.dot operand: the 16-bit tile itself on a GPU (tensor cores), float32 in the interpreter."""
    if INTERPRETED and x.dtype == tl.bfloat16:
        return f32(x)
    else:
        return x


# --------------------------------------------------------------------------- math shared by kernels


@triton.jit
def exp_f32(x, PRECISE: tl.constexpr):
    """float32 exp. tl.exp is the fast ex2.approx path (15 ULP at |x| ~ 16, 64 overall, docs/numerics.md 3.4):
    fine under a 16-bit output, an activation's abs/ULP bound or a logsumexp, too coarse for an
    elementwise float32 rtol of 1.3e-6 (softmax), where PRECISE takes libdevice's expf (~2 ULP)."""
    if PRECISE and not INTERPRETED:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log_f32(x):
    """float32 natural log to ~1 ULP (libdevice) on a GPU; tl.log is the approximate lg2 path."""
    if INTERPRETED:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton.jit
def pow2_scale(m):
    """Per-row power of two <= m (its exponent bits) for m >= 2, else 1 (also for inf and NaN).

    Dividing a row by it is exact, and keeps float32 sums of squares from overflowing (|x| > 1.8e19).
    """
    p = (m.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where((p < 2.0) | (p == float("inf")), 1.0, p)


@triton.jit
def sigmoid_f32(x):
    """float32 sigmoid that exponentiates only -|x| (no overflow, no 0 * inf)."""
    e = tl.exp(-tl.abs(x))  # fast exp: its error stays inside the activations' ULP-or-abs bound
    return tl.where(x >= 0, 1.0, e) / (1.0 + e)


@triton.jit
def silu_f32(x):
    """x * sigmoid(x) with the limit silu(-inf) = -0.0 (the product alone gives -inf * 0 = NaN)."""
    return tl.where(x == float("-inf"), neg_zero_like(x), x * sigmoid_f32(x))


@triton.jit
def neg_zero_like(x):
    """-0.0 in x's shape. A -0.0 literal loses its sign in Triton 3.6's interpreter; 0 * -1 keeps it."""
    return tl.zeros_like(x) * -1.0


# --------------------------------------------------------------------------- backward helpers (cudaA)
# Row-wise backward kernels that sum a weight or bias gradient over rows do it without atomics: a fixed grid of
# programs, each looping over row tiles pid, pid + P, ... and keeping its own partial sums, written to row pid
# of a [P, n_cols] buffer that `sum_partials` adds up in a fixed order. Same inputs, same device: same bits.

PARTIALS_PER_SM = 2  # programs per SM for a row-wise backward with partial sums: two keep each SM's loads in flight


def bwd_row_config(n_rows: int, n_cols: int, wide: bool = False, spread: int = 2) -> RowConfig:
    """Tile for a row-wise backward: the forward's (`row_config`) with the warps of a tile `spread` times as large,
    since a backward keeps more row-long arrays live (grad, x, xhat, the weight, partial sums, float64
    temporaries): 8K-column bf16 rmsnorm rows took 253 registers at the forward's 8 warps. `wide` (float64
    arithmetic throughout, two registers a value): half the elements per tile, chunked rows past half of ROW_MAX,
    in quarter-ROW_MAX chunks (8K-column float64 chunks spilled)."""
    cfg = row_config(n_rows, n_cols)
    if wide and cfg.block_m * cfg.block_n > 1024:
        if cfg.block_m > 1:
            cfg = RowConfig(cfg.block_m // 2, cfg.block_n, cfg.single, cfg.num_warps)
        else:
            cap = (INTERP_TILE if INTERPRET else ROW_MAX) // 4
            cfg = RowConfig(1, min(cfg.block_n // 2, cap), False, cfg.num_warps)
    return RowConfig(cfg.block_m, cfg.block_n, cfg.single, warps_for(cfg.block_m * cfg.block_n * spread))


def partial_programs(n_tiles: int, device) -> int:
    """Programs of a row-wise backward that keeps per-program partial sums (and rows of the [P, n_cols] buffer)."""
    return max(1, min(n_tiles, PARTIALS_PER_SM * sm_count(device)))


@triton.jit
def _sum_partials_kernel(p_ptr, out_ptr, n_parts, n_cols, o_s, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[c] = sum over p of partial[p, c], in the partials' dtype, always in the same order, rounded once.

    Dimensions: partial [n_parts, n_cols] contiguous; out [n_cols] with stride o_s.
    """
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    acc = tl.zeros((BLOCK_P, BLOCK_N), p_ptr.dtype.element_ty)
    for start in range(0, n_parts, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < n_parts)[:, None] & col_ok[None, :]
        acc += tl.load(p_ptr + parts.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, 0)
    tl.store(out_ptr + cols.to(tl.int64) * o_s, narrow(total.to(tl.float32), out_ptr.dtype.element_ty), mask=col_ok)


def sum_partials(partial, out):
    """Reduce a [P, n_cols] buffer of per-program partial sums into `out` [n_cols] (its dtype), deterministically."""
    n_parts, n_cols = partial.shape
    if n_cols == 0:
        return out
    block_n = min(next_pow2(n_cols), 256 if not INTERPRET else INTERP_TILE)
    block_p = max(1, min(next_pow2(n_parts), tile_elements() // block_n))
    _sum_partials_kernel[(cdiv(n_cols, block_n),)](partial, out, n_parts, n_cols, out.stride(0),
                                                    BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)
    return out


@triton.jit
def is_finite(x):
    return (x == x) & (tl.abs(x) != float("inf"))


DEEP = tl.constexpr(64.0)  # below -DEEP, exp(x) heads for float32 subnormals (few significant bits, flushed on GPUs)
EXP_NEG_DEEP = tl.constexpr(1.603810890548638e-28)  # exp(-DEEP)
SHIFTED_MIN = tl.constexpr(-150.0)  # exp(x + DEEP) is a float32 normal down to here (x + DEEP >= -86)
EXP64_ZERO_BELOW = tl.constexpr(-745.1331787109375)  # the most negative float32 whose float64 exp is not 0


@triton.jit
def exp_wide(a, PRECISE: tl.constexpr):
    """exp(a) for float32 a <= 0 as float64, from one float32 exp: float32's relative accuracy down to a = -150 (past
    where float32's own exp underflows, -103, or is flushed on a GPU, -87), and exactly 0 where float64's exp is.

    a >= -DEEP: exp(a). a in [-150, -DEEP): exp(a + DEEP) exp(-DEEP); the argument a + DEEP is exact there (same
    binade or Sterbenz). Below: exp(a / 9)^9, accurate to ~9 float32 roundings of a / 9 (5e-5 relative): enough
    for the values it gives, at most ~1e-65 of whatever they multiply, and for the sign of inf times them.
    """
    arg = tl.where(a < SHIFTED_MIN, a * (1.0 / 9.0), tl.where(a < -DEEP, a + DEEP, a))
    e = exp_f32(arg, PRECISE).to(tl.float64)
    e3 = e * e * e
    e = tl.where(a < SHIFTED_MIN, e3 * e3 * e3, tl.where(a < -DEEP, e * EXP_NEG_DEEP, e))
    return tl.where(a < EXP64_ZERO_BELOW, 0.0, e)


@triton.jit
def silu_grad_wide(x, PRECISE: tl.constexpr):
    """silu'(x) = sigmoid(x) (1 + x sigmoid(-x)) as float64, written q (num + x e q) with e = exp(-|x|),
    q = 1 / (1 + e), num = 1 (x >= 0) or e: no overflow, no 1 - sigmoid(x) cancellation for x >> 0, and the limits
    silu'(-inf) = 0, silu'(+inf) = 1 (x e is taken as 0 where e is 0, not inf * 0). NaN propagates.

    float32 x: e from `exp_wide` and q in float32 (float32 accuracy, no float64 exp or division per element), but
    nonzero down to float64's underflow at -745 like the reference's, so inf * silu'(x) keeps its sign there.
    float64 x: float64 throughout, the reference's own arithmetic (libdevice's exp on a GPU).
    """
    if x.dtype == tl.float64:
        e = tl.exp(-tl.abs(x)) if INTERPRETED else libdevice.exp(-tl.abs(x))
        q = 1.0 / (1.0 + e)
        xw = x
    else:
        e = exp_wide(-tl.abs(x), PRECISE)
        q = (1.0 / (1.0 + e.to(tl.float32))).to(tl.float64)
        xw = x.to(tl.float64)
    xe = tl.where(e == 0.0, 0.0, xw * e)
    return q * (tl.where(xw >= 0, 1.0, e) + xe * q)
