"""One-pass fused loops (numba) for the cpu backend's memory-bound kernels: docs/cpu.md, "Fused loops".

NumPy evaluates a formula one pass per operation, with a temporary per pass; the loops here read each row
(or block of elements) once into cache and do all of an op's arithmetic there. They are an accelerator of
the NumPy kernels, not a second implementation of the edge cases: every loop handles the common values
(finite, in range) and reports the rows or elements it did not handle, which the op file then computes with
its NumPy kernel (overflowing sums, NaN, inf, exp arguments outside the normal range). Rows never straddle
calls and every element depends on its own row only, so results are bitwise the same for any thread count.

Threads: the loops are compiled with `nogil=True` and called from inside `parallel_rows`' shares, so they
run on opport's pool within its budget (`OPPORT_NUM_THREADS`); numba's own threading layer is never used.

Precision follows the NumPy kernels: float32 arithmetic for float32 (and upcast 16-bit) blocks, statistics
accumulated in float32 (8 or 16 interleaved partial sums per row, then added in a fixed order); the norms' backward
and swiglu's dgate compute in float64 as the NumPy kernels do. Each loop is compiled for
float32 blocks only (16-bit data is converted outside, by `upcast` and `store`; float64 inputs keep the
NumPy kernels), once, and cached on disk (`cache=True`).

`OPPORT_NUMBA=0` turns the fused loops off (the NumPy kernels run); so does numba being absent.
"""

from __future__ import annotations

import os

import numpy as np

try:  # numba is a dependency, but the NumPy kernels must keep working without it
    import numba
    from llvmlite import ir as _ir
    from numba.extending import intrinsic as _intrinsic
    from numba.extending import overload as _overload
except ImportError:  # pragma: no cover - exercised only where numba is not installed
    numba = None


_F64 = np.dtype(np.float64)


def enabled(dtype=None) -> bool:  # (np.dtype(None) is float64: None is checked first)
    """Whether the op files take the fused loops for inputs of `dtype`: numba importable, OPPORT_NUMBA not "0",
    and a float32 compute dtype (float32, float16, bfloat16 inputs). float64 inputs keep the NumPy kernels:
    compiling every loop a second time for them would double the JIT cost for a dtype nobody trains in."""
    if numba is None or (dtype is not None and dtype == _F64):
        return False
    raw = _ENV.get(_ENV_KEY) if _ENV is not None else os.environ.get("OPPORT_NUMBA")
    if raw is None:
        return True
    if isinstance(raw, bytes):
        raw = os.environ.decodevalue(raw)
    return raw.strip() != "0"


# read on every kernel call: os.environ's own dict costs 0.03 us, os.environ.get of an unset variable ~0.5 us
# (as _common.num_threads does)
_ENV = getattr(os.environ, "_data", None) if hasattr(os.environ, "encodekey") and hasattr(os.environ, "decodevalue") else None
_ENV_KEY = os.environ.encodekey("OPPORT_NUMBA") if _ENV is not None else None

LANES = 64  # partial sums per row: independent lanes the compiler vectorises without reassociating
CHUNK = 2048  # elements per chunk of the activations' loops (8 KiB of float32: the check loop reads them from L1)

if numba is not None:
    _jit = numba.njit(cache=True, nogil=True, fastmath=False, error_model="numpy")
    _inline = numba.njit(inline="always", fastmath=False, error_model="numpy")

    @_intrinsic
    def _int_as_float(typingctx, i):
        """The float32 whose bits are the int32 `i` (vectorisable, unlike a view)."""

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], _ir.FloatType())

        return numba.float32(numba.int32), codegen

    @_intrinsic
    def _float_as_int(typingctx, f):
        """The int32 whose bits are the float32 `f`."""

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], _ir.IntType(32))

        return numba.int32(numba.float32), codegen

    @_intrinsic
    def _fma(typingctx, a, b, c):
        """a * b + c rounded once (llvm.fma, whatever the target: a libm call where there is no FMA instruction): an
        explicit fused multiply-add, vectorised like any arithmetic, never a contraction the compiler may or may not
        make (fastmath's 'contract' could fuse one element's product and not its neighbour's)."""
        if not (a == b == c and isinstance(a, numba.types.Float)):
            return None

        def codegen(context, builder, signature, args):
            return builder.fma(*args)

        return a(a, b, c), codegen

    @_intrinsic
    def _long_as_double(typingctx, i):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], _ir.DoubleType())

        return numba.float64(numba.int64), codegen

    @_intrinsic
    def _double_as_long(typingctx, f):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], _ir.IntType(64))

        return numba.int64(numba.float64), codegen

    @_intrinsic
    def _scratch(typingctx, n, dtype):
        """An uninitialised 1-D array of n elements from numba's allocator, called directly: np.empty, np.zeros and
        np.full look np.empty up by name when they compile, and the conformance suite stands a poisoning function in
        for it (so loops that allocate compile wherever they first run)."""
        from numba.core.imputils import impl_ret_new_ref
        from numba.np.arrayobj import _empty_nd_impl

        arr = numba.types.Array(dtype.dtype, 1, "C")

        def codegen(context, builder, signature, args):
            return impl_ret_new_ref(context, builder, arr, _empty_nd_impl(context, builder, arr, [args[0]])._getvalue())

        return arr(numba.types.intp, dtype), codegen

    @_intrinsic
    def _at(typingctx, addr, dtype):
        """The int64 address `addr` as a pointer to `dtype` (a C entry point's arguments, passed as integers)."""
        ptr = numba.types.CPointer(dtype.dtype)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(numba.types.int64, dtype), codegen

    @_inline
    def _poly_exp32(r):
        """exp(r) for |r| <= ln2/2: Cephes' expf polynomial in fused multiply-adds, its last step unfused (fusing it
        too measured 1.002 ulp at worst, against 0.97)."""
        p = np.float32(1.9875691500e-4)
        p = _fma(p, r, np.float32(1.3981999507e-3))
        p = _fma(p, r, np.float32(8.3334519073e-3))
        p = _fma(p, r, np.float32(4.1665795894e-2))
        p = _fma(p, r, np.float32(1.6666665459e-1))
        p = _fma(p, r, np.float32(5.0000001201e-1))
        return p * r * r + r + np.float32(1.0)

    @_inline
    def _round_log2(x, bias):
        """(k, kf) for exp(x): k = rint(x log2 e) as a float32, kf the same sum before the magic constant's
        removal, whose low significand bits hold k + bias (`_pow2` reads them). One FMA rounds to the integer (the
        sum lies in [2^23, 2^24), where float32's ulp is 1): floor(x log2e + 0.5) and the int conversion took three
        more instructions (the same k on 8M points of [-87, 87])."""
        kf = _fma(x, np.float32(1.4426950408889634), np.float32(12582912.0) + np.float32(bias))
        return kf - (np.float32(12582912.0) + np.float32(bias)), kf

    @_inline
    def _pow2(kf):
        """2^(k + bias - 127) from `_round_log2`'s kf: its low bits shifted into the exponent field (the magic
        constant's own bits leave the 32-bit word); a normal float while 1 <= k + bias <= 254."""
        return _int_as_float(_float_as_int(kf) << np.int32(23))

    @_inline
    def _exp32(x):
        """exp of a float32 in [-87, 87] (callers check: `_hi`), within 1 ulp: Cody-Waite reduction by
        ln 2 and Cephes' expf polynomial (Horner's steps as fused multiply-adds), 2^k from the exponent bits.
        Vectorises (libm's expf does not). Measured on 8M points of [-87, 87]: at most 0.977 ulp from exp (0.990
        with the reduction's second step rounded twice)."""
        k, kf = _round_log2(x, 127)
        r = _fma(k, np.float32(-0.693359375), x)  # exact: k ln2_hi has at most 17 significant bits
        r = _fma(k, np.float32(2.12194440e-4), r)
        return _poly_exp32(r) * _pow2(kf)

    @_inline
    def _exp32_sum(h, rest, bias):
        """exp(h + rest) 2^(bias - 127) of two float32s, h + rest in [-87, 87], without rounding h + rest: Cody-Waite's
        reduction takes h (h - k ln2_hi is exact for |h| >= 2, where its ulp is at least 2^-22), then rest, so a large
        h (gelu's -a*a/2, down to -85) costs no more than a small one (exp(float32(h + rest)) would err by |h| 2^-24
        relative). One polynomial where exp(h) exp(rest) takes two; `bias` (a constant: 126 halves the result for
        free) keeps k + bias >= 1."""
        k, kf = _round_log2(h + rest, bias)
        r = _fma(k, np.float32(-0.693359375), h)
        r = r + rest
        r = _fma(k, np.float32(2.12194440e-4), r)
        return _poly_exp32(r) * _pow2(kf)

    @_inline
    def _exp64(x):
        """exp of a float64 in [-700, 700] (`_hi`), within 1 ulp: reduction by ln 2 (Cody-Waite) and a
        degree-13 Taylor polynomial on |r| <= ln2/2 (truncation < 2e-17 relative), 2^k from the bits (k rounded by
        one FMA into [2^52, 2^53), as `_round_log2` does for float32)."""
        kf = _fma(x, 1.4426950408889634, 6755399441055744.0 + 1023.0)
        k = kf - (6755399441055744.0 + 1023.0)
        r = _fma(k, -0.6931471803691238, x)
        r = _fma(k, -1.9082149292705877e-10, r)
        p = 1.0 / 6227020800.0
        p = _fma(p, r, 1.0 / 479001600.0)
        p = _fma(p, r, 1.0 / 39916800.0)
        p = _fma(p, r, 1.0 / 3628800.0)
        p = _fma(p, r, 1.0 / 362880.0)
        p = _fma(p, r, 1.0 / 40320.0)
        p = _fma(p, r, 1.0 / 5040.0)
        p = _fma(p, r, 1.0 / 720.0)
        p = _fma(p, r, 1.0 / 120.0)
        p = _fma(p, r, 1.0 / 24.0)
        p = _fma(p, r, 1.0 / 6.0)
        p = _fma(p, r, 0.5)
        p = p * r * r + r + 1.0
        return p * _long_as_double(_double_as_long(kf) << np.int64(52))

    def _exp(x):
        """exp by dtype (float32: _exp32, float64: _exp64), chosen at compile time."""

    def _as(a, v):
        """v in the dtype of `a` (a float32/float64 array or scalar), chosen at compile time. Every constant in the
        loops goes through it: a Python int or float would promote float32 arithmetic to float64."""

    def _hi(a):
        """The exp range bound for the dtype of the array `a`: exp(+-hi) is finite and normal."""

    @_overload(_exp, inline="always")
    def _exp_impl(x):
        return (lambda x: _exp32(x)) if x == numba.float32 else (lambda x: _exp64(x))

    @_overload(_as, inline="always")
    def _as_impl(a, v):
        if getattr(a, "dtype", a) == numba.float32:  # an array's dtype, or a scalar's type
            return lambda a, v: np.float32(v)
        return lambda a, v: np.float64(v)

    def _deep(a):
        """_activations.DEEP for the dtype of `a`: below -DEEP, swiglu takes its careful formula."""

    @_overload(_deep, inline="always")
    def _deep_impl(a):
        if a.dtype == numba.float32:
            return lambda a: np.float32(64.0)
        return lambda a: np.float64(512.0)

    @_overload(_hi, inline="always")
    def _hi_impl(a):
        if a.dtype == numba.float32:
            return lambda a: np.float32(87.0)
        return lambda a: np.float64(700.0)




# --------------------------------------------------------------------------- row statistics

if numba is not None:

    @_inline
    def _lane_sum(v, x0, mean, square, acc):
        """sum(d) or sum(d * d) over d = (v - x0) - mean in acc's dtype (v converted first): LANES interleaved partial
        sums in `acc` (lane k takes the elements j = k mod LANES), then the lanes in order, then the tail. Each lane's
        update is a map over k, which LLVM's loop vectoriser turns into SIMD without reassociating anything (numba
        leaves the SLP vectoriser off, so partial sums in scalars stayed scalar code); 64 lanes keep several vector
        registers of independent additions in flight. x0 = mean = 0 gives sum(v) and sum(v * v) exactly."""
        n = v.size
        m = n - n % LANES
        acc[:] = 0
        if square:
            for j0 in range(0, m, LANES):
                for k in range(LANES):
                    d = (_as(acc, v[j0 + k]) - x0) - mean
                    acc[k] += d * d
        else:
            for j0 in range(0, m, LANES):
                for k in range(LANES):
                    acc[k] += (_as(acc, v[j0 + k]) - x0) - mean
        t = _as(acc, 0.0)
        for k in range(LANES):
            t += acc[k]
        for j in range(m, n):
            d = (_as(acc, v[j]) - x0) - mean
            t += d * d if square else d
        return t

    @_inline
    def _sum_squares(v, acc):
        """sum(v * v) in v's dtype (_lane_sum)."""
        z = _as(v, 0.0)
        return _lane_sum(v, z, z, True, acc)

    @_jit
    def _rms_fwd(x, w, has_w, eps, y, bad, acc):
        """y = x / sqrt(mean(x^2) + eps) (* w) per row, NumPy's rounding order; bad[i] = 1 (row left for the
        NumPy kernel) where the sum of squares is not finite."""
        rows, n = x.shape
        nbad = 0
        for i in range(rows):
            xi, yi = x[i], y[i]
            ms = _sum_squares(xi, acc) / _as(x, n)
            if not np.isfinite(ms):
                bad[i] = 1
                nbad += 1
                continue
            r = _as(x, 1.0) / np.sqrt(ms + eps)
            if has_w:
                for j in range(n):
                    yi[j] = (xi[j] * r) * w[j]
            else:
                for j in range(n):
                    yi[j] = xi[j] * r
        return nbad

    @_inline
    def _rms_row_bwd(xi, gi, w, has_w, eps, hi, has_h, di, dw, with_dw, acc, xh):
        """One row of rmsnorm's backward in float64 (_rms_bwd): di = (g w - xhat mean(g w xhat)) r (+ hi), and
        dw += g xhat where with_dw; returns r = 1 / rms, or -1 (nothing written) where the sum of squares is not
        finite."""
        n = xi.size
        acc[:] = 0
        m = n - n % LANES
        for j0 in range(0, m, LANES):
            for k in range(LANES):
                v = np.float64(xi[j0 + k])
                acc[k] += v * v
        ss = 0.0
        for k in range(LANES):
            ss += acc[k]
        for j in range(m, n):
            ss += np.float64(xi[j]) * np.float64(xi[j])
        ms = ss / n
        if not np.isfinite(ms):
            return -1.0
        r = 1 / np.sqrt(ms + eps)
        acc[:] = 0
        for j0 in range(0, m, LANES):
            for k in range(LANES):
                j = j0 + k
                xv = np.float64(xi[j]) * r
                xh[j] = xv
                gw = np.float64(gi[j]) * np.float64(w[j]) if has_w else np.float64(gi[j])
                acc[k] += gw * xv
        c = 0.0
        for k in range(LANES):
            c += acc[k]
        for j in range(m, n):
            xv = np.float64(xi[j]) * r
            xh[j] = xv
            gw = np.float64(gi[j]) * np.float64(w[j]) if has_w else np.float64(gi[j])
            c += gw * xv
        c /= n
        for j in range(n):
            gv = np.float64(gi[j])
            if has_w:
                if with_dw:
                    dw[j] += gv * xh[j]
                gv = gv * np.float64(w[j])
            d = (gv - xh[j] * c) * r
            if has_h:
                d += np.float64(hi[j])
            di[j] = d
        return r

    @_jit
    def _rms_bwd(x, g, w, has_w, eps, h, has_h, dx, dw, bad, acc, xh):
        """rmsnorm's backward per row in float64: dx = (g w - xhat mean(g w xhat)) r (+ h), dw += g xhat over
        the rows (in row order). bad[i] = 1 where the sum of squares is not finite (the NumPy kernel's rows)."""
        nbad = 0
        for i in range(x.shape[0]):
            r = _rms_row_bwd(x[i], g[i], w, has_w, eps, h[i] if has_h else h[0], has_h, dx[i], dw, True, acc, xh)
            if r < 0:
                bad[i] = 1
                nbad += 1
        return nbad

    @_jit
    def _rms_bwd_dx(x, g, w, eps, h, has_h, dx, rs, bad, acc, xh):
        """_rms_bwd's rows (with a weight) without dweight: dx, and each row's r (1 / rms) into rs for
        _rms_dw_cols, which then gives _rms_bwd's dweight bit for bit. Rows split over threads (no shared output)."""
        nbad = 0
        for i in range(x.shape[0]):
            r = _rms_row_bwd(x[i], g[i], w, True, eps, h[i] if has_h else h[0], has_h, dx[i], w, False, acc, xh)
            rs[i] = r
            if r < 0:
                bad[i] = 1
                nbad += 1
        return nbad

    @_jit
    def _rms_dw_cols(x, g, rs, dw):
        """dw += g xhat over the rows in row order, xhat = x r as _rms_row_bwd forms it: _rms_bwd's dweight for the
        columns given (a split over columns keeps each column's sum order). Rows left (r = -1) add nothing."""
        for i in range(x.shape[0]):
            r = rs[i]
            if r < 0:
                continue
            xi, gi = x[i], g[i]
            for j in range(dw.size):
                dw[j] += np.float64(gi[j]) * (np.float64(xi[j]) * r)

    @_jit
    def _ln_fwd(x, w, has_w, b, has_b, eps, y, bad, acc):
        """layernorm per row as the NumPy kernel: d = (x - x0) - mean(x - x0), y = d / sqrt(mean(d^2) + eps)
        (* w, + b). bad[i] = 1 where the statistics are not finite."""
        rows, n = x.shape
        nbad = 0
        for i in range(rows):
            xi, yi = x[i], y[i]
            x0 = xi[0]
            mean = _lane_sum(xi, x0, _as(x, 0.0), False, acc) / _as(x, n)
            s = _lane_sum(xi, x0, mean, True, acc)
            var = s / _as(x, n)
            if not (np.isfinite(var) and np.isfinite(mean)):
                bad[i] = 1
                nbad += 1
                continue
            r = _as(x, 1.0) / np.sqrt(var + eps)
            if has_w and has_b:  # one loop per case: a branch inside kept the loop from vectorising
                for j in range(n):
                    yi[j] = (((xi[j] - x0) - mean) * r) * w[j] + b[j]
            elif has_w:
                for j in range(n):
                    yi[j] = (((xi[j] - x0) - mean) * r) * w[j]
            elif has_b:
                for j in range(n):
                    yi[j] = ((xi[j] - x0) - mean) * r + b[j]
            else:
                for j in range(n):
                    yi[j] = ((xi[j] - x0) - mean) * r
        return nbad

    @_jit
    def _softmax_fwd(x, y, bad, acc):
        """exp(x) / sum(exp(x)) per row (the NumPy kernel's unshifted form); bad[i] = 1 where an exp would leave
        the normal range (then so may the row sum: the NumPy kernel decides) or the sum is not in [1, max]."""
        rows, n = x.shape
        hi = _hi(x)
        lo = -hi
        nbad = 0
        m = n - n % LANES
        for i in range(rows):
            xi, yi = x[i], y[i]
            out = 0
            for j in range(n):
                v = xi[j]
                out += not (v >= lo and v <= hi)
            if out:
                bad[i] = 1
                nbad += 1
                continue
            acc[:] = 0
            for j0 in range(0, m, LANES):
                for k in range(LANES):
                    e = _exp(xi[j0 + k])
                    yi[j0 + k] = e
                    acc[k] += e
            s = _as(acc, 0.0)
            for k in range(LANES):
                s += acc[k]
            for j in range(m, n):
                e = _exp(xi[j])
                yi[j] = e
                s += e
            if not (s >= 1 and np.isfinite(s)):
                bad[i] = 1
                nbad += 1
                continue
            for j in range(n):
                yi[j] = yi[j] / s
        return nbad

    @_jit
    def _softmax_bwd(g, yv, dst, bad, acc):
        """y (g - s), s = sum(g y) in float64 from exact products, applied to float32 rows as (g - s_hi) - s_lo
        (the NumPy kernel's arithmetic); bad[i] = 1 where the result is not finite."""
        rows, n = g.shape
        nbad = 0
        m = n - n % LANES
        for i in range(rows):
            gi, yi, di = g[i], yv[i], dst[i]
            acc[:] = 0
            for j0 in range(0, m, LANES):
                for k in range(LANES):
                    acc[k] += np.float64(gi[j0 + k]) * np.float64(yi[j0 + k])
            s = 0.0
            for k in range(LANES):
                s += acc[k]
            for j in range(m, n):
                s += np.float64(gi[j]) * np.float64(yi[j])
            s_hi = _as(g, s)
            s_lo = _as(g, s - np.float64(s_hi))
            fin = 0
            for j in range(n):
                d = ((gi[j] - s_hi) - s_lo) * yi[j]  # float64: s_lo == 0, (g - s) exactly
                di[j] = d
                fin += not np.isfinite(d)
            if fin:
                bad[i] = 1
                nbad += 1
        return nbad

    # ----------------------------------------------------------------------- activations (1-d blocks)

    # The activations' loops run a chunk of CHUNK elements at a time: first the formula over the chunk (a pure map,
    # which the loop vectoriser turns into SIMD), then a second loop over the same chunk, still in L1, that counts
    # the elements the formula does not handle (an integer sum, vectorised too) and, only when asked (`mark`, the
    # rare second call), marks them. Counting inside the formula's loop cost 1.5x its time.

    @_jit
    def _silu(x, y, mark, flags):
        """x / (1 + exp(-x)) where x >= -hi (exp(-x) stays normal and finite; x = +inf gives inf);
        returns the count of elements not handled (x below that, -inf, NaN), marked in `flags` when `mark`."""
        hi = _hi(x)
        lo = -hi
        n = x.size
        nbad = 0
        for c0 in range(0, n, CHUNK):
            c1 = min(c0 + CHUNK, n)
            x_c = x[c0:c1]
            y_c = y[c0:c1]
            flags_c = flags[c0:c1] if mark else flags
            for j in range(c1 - c0):
                v = x_c[j]
                a = min(-v, hi)
                a = max(a, -hi)  # exp(-hi) + 1 == 1: the same as exp underflowing to 0
                y_c[j] = v / (_as(x, 1.0) + _exp(a))
            nb = np.int32(0)
            for j in range(c1 - c0):
                nb += np.int32(not (x_c[j] >= lo))
            if nb:
                nbad += nb
                if mark:
                    for j in range(c1 - c0):
                        if not (x_c[j] >= lo):
                            flags_c[j] = 1
        return nbad

    @_inline
    def _sigmoid_terms(z, tt, hi):
        """sigmoid(z) + tt sigmoid(z) sigmoid(-z), as q (num + tt e q), e = exp(-|z|), q = 1 / (1 + e),
        num = max(e, z >= 0): the NumPy kernel's formula. |z| is clipped to the exp's range (e is 0 below)."""
        e = _exp(max(-abs(z), -hi))  # callers leave |z| > hi to the NumPy kernel
        num = max(e, _as(hi, 1.0) if z >= 0 else _as(hi, 0.0))
        q = _as(hi, 1.0) / (e + _as(hi, 1.0))
        return (num + (tt * e) * q) * q

    @_jit
    def _silu_grad(x, g, y, mark, flags):
        """y = g silu'(x) = g (sigmoid(x) + x sigmoid(x) sigmoid(-x)); count of elements not handled
        (non-finite x, g or result: the NumPy kernel has rules for those)."""
        hi = _hi(x)
        n = x.size
        nbad = 0
        for c0 in range(0, n, CHUNK):
            c1 = min(c0 + CHUNK, n)
            x_c = x[c0:c1]
            g_c = g[c0:c1]
            y_c = y[c0:c1]
            flags_c = flags[c0:c1] if mark else flags
            for j in range(c1 - c0):
                v = x_c[j]
                y_c[j] = _sigmoid_terms(v, v, hi) * g_c[j]
            nb = np.int32(0)
            for j in range(c1 - c0):
                nb += np.int32(not (np.isfinite(y_c[j]) and abs(x_c[j]) <= hi))
            if nb:
                nbad += nb
                if mark:
                    for j in range(c1 - c0):
                        if not (np.isfinite(y_c[j]) and abs(x_c[j]) <= hi):
                            flags_c[j] = 1
        return nbad

    @_jit
    def _gelu_tanh(x, y, mark, flags):
        """x / (1 + exp(-2u)), 2u = x (c1 + c3 x^2) as the NumPy kernel forms it; count of elements not handled
        (exp(-2u) leaving the range: x below about -10, -inf, NaN)."""
        c3, c1 = _as(x, 2 * _SQRT_2_OVER_PI * 0.044715), _as(x, 2 * _SQRT_2_OVER_PI)
        hi = _hi(x)
        n = x.size
        nbad = 0
        for c0 in range(0, n, CHUNK):
            c1_ = min(c0 + CHUNK, n)
            x_c = x[c0:c1_]
            y_c = y[c0:c1_]
            flags_c = flags[c0:c1_] if mark else flags
            for j in range(c1_ - c0):
                v = x_c[j]
                tu = ((v * v) * c3 + c1) * v
                a = max(min(-tu, hi), -hi)
                y_c[j] = v / (_as(x, 1.0) + _exp(a))
            nb = np.int32(0)
            for j in range(c1_ - c0):
                v = x_c[j]
                nb += np.int32(not (((v * v) * c3 + c1) * v >= -hi))
            if nb:
                nbad += nb
                if mark:
                    for j in range(c1_ - c0):
                        v = x_c[j]
                        if not (((v * v) * c3 + c1) * v >= -hi):
                            flags_c[j] = 1
        return nbad

    @_jit
    def _gelu_tanh_grad(x, g, y, mark, flags):
        """y = g d/dx x sigmoid(2u) = g (sigmoid(2u) + x 2u' sigmoid(2u) sigmoid(-2u)), x clipped to +-64 as the
        NumPy kernel does; count of elements not handled (non-finite x or result)."""
        c3, c1 = _as(x, 2 * _SQRT_2_OVER_PI * 0.044715), _as(x, 2 * _SQRT_2_OVER_PI)
        d3 = _as(x, 6 * _SQRT_2_OVER_PI * 0.044715)
        hi = _hi(x)
        lim = _as(x, 64.0)
        n = x.size
        nbad = 0
        for c0 in range(0, n, CHUNK):
            c1_ = min(c0 + CHUNK, n)
            x_c = x[c0:c1_]
            g_c = g[c0:c1_]
            y_c = y[c0:c1_]
            flags_c = flags[c0:c1_] if mark else flags
            for j in range(c1_ - c0):
                xc = min(max(x_c[j], -lim), lim)
                x2 = xc * xc
                tu = (x2 * c3 + c1) * xc
                tt = (x2 * d3 + c1) * xc
                y_c[j] = _sigmoid_terms(tu, tt, hi) * g_c[j]
            nb = np.int32(0)
            for j in range(c1_ - c0):
                xc = min(max(x_c[j], -lim), lim)
                nb += np.int32(not (np.isfinite(y_c[j]) and abs(((xc * xc) * c3 + c1) * xc) <= hi))
            if nb:
                nbad += nb
                if mark:
                    for j in range(c1_ - c0):
                        xc = min(max(x_c[j], -lim), lim)
                        if not (np.isfinite(y_c[j]) and abs(((xc * xc) * c3 + c1) * xc) <= hi):
                            flags_c[j] = 1
        return nbad

    @_jit
    def _swiglu(gate, up, y, mark, flags):
        """gate * (sigmoid(gate) * up), sigmoid = max(e, gate >= 0) / (1 + e) with e = exp(-|gate|) (the NumPy
        kernel's roundings); count of elements not handled (gate < -DEEP or NaN: the careful formula's)."""
        deep = -_deep(gate)
        lo = -_hi(gate)
        n = gate.size
        nbad = 0
        for c0 in range(0, n, CHUNK):
            c1 = min(c0 + CHUNK, n)
            gate_c = gate[c0:c1]
            up_c = up[c0:c1]
            y_c = y[c0:c1]
            flags_c = flags[c0:c1] if mark else flags
            for j in range(c1 - c0):
                v = gate_c[j]
                a = max(-abs(v), lo)
                e = _exp(a)
                s = max(e, _as(e, 1.0) if v >= 0 else _as(e, 0.0)) / (e + _as(e, 1.0))
                y_c[j] = v * (s * up_c[j])
            nb = np.int32(0)
            for j in range(c1 - c0):
                nb += np.int32(not (gate_c[j] >= deep))
            if nb:
                nbad += nb
                if mark:
                    for j in range(c1 - c0):
                        if not (gate_c[j] >= deep):
                            flags_c[j] = 1
        return nbad


_SQRT_2_OVER_PI = 0.7978845608028654
_INV_SQRT2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
# _activations._ERFC_P: the erfc fit's polynomial, highest order first (Horner)
_P9, _P8, _P7, _P6, _P5, _P4, _P3, _P2, _P1, _P0 = (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807,
                                                    -0.18628806, 0.09678418, 0.37409196, 1.00002368, -1.26551223)
_ERFC_STEPS = tuple(np.float32(c) for c in (_P8, _P7, _P6, _P5, _P4, _P3, _P2, _P1, _P0))
_ERF_ABS_MAX = 13.0  # beyond, exp(-a*a/2) leaves float32's normal range: the NumPy kernels take those elements

if numba is not None:

    @_inline
    def _erfc_fit(a, fused):
        """(t, P(t)) of _activations._erfc_fit32 for a float32 a in [0, 13]: erfc(a / sqrt 2) = t exp(-a*a/2 + P(t)).
        Where `fused` (a compile-time constant: the forward's choice), t = 1 / fma(a, 1/(2 sqrt 2), 1) and Horner's
        steps as fused multiply-adds; else the NumPy kernel's separate roundings (the backward: with fused steps its
        noise-floor case grad-edge-grid, a few elements times grads near the float32 maximum, measured 1.27x its
        allowance)."""
        if fused:
            t = np.float32(1) / _fma(a, np.float32(0.5 * _INV_SQRT2), np.float32(1))
        else:
            t = np.float32(1) / (np.float32(1) + np.float32(0.5) * (a * np.float32(_INV_SQRT2)))
        p = np.float32(_P9)
        for c in _ERFC_STEPS:
            p = _fma(p, t, c) if fused else p * t + c
        return t, p

    @_inline
    def _neg_half_square(a):
        """(h, lo), h + lo = -a*a/2 exactly: h = (-a/2) a rounded (-a/2 is exact), lo its rounding error by FMA."""
        u = a * np.float32(-0.5)
        h = u * a
        return h, _fma(u, a, -h)

    @_jit
    def _gelu_erf(x, y, mark, flags):
        """x Phi(x), Phi(-|x|) = q = t exp(-x*x/2 + P(t)) / 2 from the erfc fit (the NumPy kernel's float32 formula,
        its fit in fused steps and its two exps one, the 1/2 in the exponent's bias), then y = x - |x| q for x >= 0
        and 0 - |x| q below, one FMA each (x = -0 takes the first: -0 - 0 q = -0). Mean 0.63 ulp from the float64
        reference, max 6.2, on 3M points of [-13, 13] (the NumPy kernel's formula: 0.66, 6.7). Count of elements
        not handled (|x| > 13, NaN, inf), marked in `flags` when `mark`; they run with |x| held at 13 (NaN stays
        NaN), so no step leaves float32's range, and are written again by the caller."""
        n = x.size
        nbad = 0
        for c0 in range(0, n, CHUNK):
            c1 = min(c0 + CHUNK, n)
            x_c = x[c0:c1]
            y_c = y[c0:c1]
            flags_c = flags[c0:c1] if mark else flags
            for j in range(c1 - c0):
                v = x_c[j]
                a = min(abs(v), np.float32(_ERF_ABS_MAX))
                t, p = _erfc_fit(a, True)
                h, lo = _neg_half_square(a)
                q = t * _exp32_sum(h, lo + p, 126)
                y_c[j] = _fma(-a, q, v if v >= np.float32(0) else np.float32(0))
            nb = np.int32(0)
            for j in range(c1 - c0):
                nb += np.int32(not (abs(x_c[j]) <= np.float32(_ERF_ABS_MAX)))
            if nb:
                nbad += nb
                if mark:
                    for j in range(c1 - c0):
                        if not (abs(x_c[j]) <= np.float32(_ERF_ABS_MAX)):
                            flags_c[j] = 1
        return nbad

    @_jit
    def _gelu_erf_grad(x, g, y, mark, flags):
        """g (H + s (|x| phi(x) - Phi(-|x|))), s = sign(x), H = (s > 0): _activations.gelu_erf_grad's float32
        formula, with two exps where it takes three; count of elements not handled (|x| > 13, non-finite x or
        result)."""
        n = x.size
        nbad = 0
        for c0 in range(0, n, CHUNK):
            c1 = min(c0 + CHUNK, n)
            x_c = x[c0:c1]
            g_c = g[c0:c1]
            y_c = y[c0:c1]
            flags_c = flags[c0:c1] if mark else flags
            for j in range(c1 - c0):
                v = x_c[j]
                a = abs(v)
                if not (a <= np.float32(_ERF_ABS_MAX)):
                    a = np.float32(0)
                t, p = _erfc_fit(a, False)
                h, lo = _neg_half_square(a)
                # phi(a) a - Phi(-a) = exp(-a*a/2) (a / sqrt(2 pi) - exp(P) t / 2): the common factor's rounding
                # does not enter the difference, which cancels near gelu's minimum (x ~ -0.75)
                dens = (a * np.float32(_INV_SQRT_2PI) - _exp32(p) * t * np.float32(0.5)) * _exp32_sum(h, lo, 127)
                sg = np.float32(-1) if _float_as_int(v) < 0 else np.float32(1)  # copysign(1, x): -0.0 gives -1
                y_c[j] = (max(sg, np.float32(0)) + dens * sg) * g_c[j]
            nb = np.int32(0)
            for j in range(c1 - c0):
                nb += np.int32(not (abs(x_c[j]) <= np.float32(_ERF_ABS_MAX) and np.isfinite(y_c[j])))
            if nb:
                nbad += nb
                if mark:
                    for j in range(c1 - c0):
                        if not (abs(x_c[j]) <= np.float32(_ERF_ABS_MAX) and np.isfinite(y_c[j])):
                            flags_c[j] = 1
        return nbad


# --------------------------------------------------------------------------- the op files' entry points

def _lanes(dtype) -> np.ndarray:
    """Scratch for the LANES partial sums. Every buffer the loops use is made here, in Python, with np.zeros: the
    conformance suite patches np.empty (poisoned outputs), which numba's own allocations cannot call."""
    return np.zeros(LANES, dtype)


def _flags(rows: int) -> np.ndarray:
    return np.zeros(rows, np.uint8)


def _weight(w, dtype) -> tuple:
    """(w as a contiguous array of `dtype`, has_w) with a 1-element dummy for None (one signature either way)."""
    if w is None:
        return np.zeros(1, dtype), False
    return np.ascontiguousarray(w, dtype=dtype), True


def rms_forward(xf: np.ndarray, w, eps: float, y: np.ndarray):
    """rmsnorm of the rows `xf` into `y` (both float32 or float64, C-contiguous); returns the indices of the rows
    left for the NumPy kernel (None when none)."""
    wt, has_w = _weight(w, xf.dtype)
    bad = _flags(xf.shape[0])
    if _rms_fwd(xf, wt, has_w, xf.dtype.type(eps), y, bad, _lanes(xf.dtype)):
        return np.flatnonzero(bad)
    return None


def rms_backward(xf, gf, w, eps: float, hf, dx, dw):
    """rmsnorm's backward of the rows (float32/float64 xf, gf, hf; dx in the same dtype) in float64; adds the rows'
    g xhat into the float64 `dw` (when w is given). hf: grad of add_rmsnorm's sum, added to dx, or None.
    Returns the indices of the rows left for the NumPy kernel (not in dx, not in dw), or None."""
    wt, has_w = _weight(w, np.float64) if w is not None else (np.zeros(1, np.float64), False)
    h, has_h = (hf, True) if hf is not None else (np.zeros((1, 1), xf.dtype), False)
    bad = _flags(xf.shape[0])
    dwt = dw if dw is not None else np.zeros(1, np.float64)
    if _rms_bwd(xf, gf, wt, has_w, float(eps), h, has_h, dx, dwt, bad, _lanes(np.float64),
                np.zeros(xf.shape[1], np.float64)):
        return np.flatnonzero(bad)
    return None


def ln_forward(xf, w, b, eps: float, y):
    """layernorm of the rows `xf` into `y` (float32/float64); the indices of rows left to NumPy, or None."""
    wt, has_w = _weight(w, xf.dtype)
    bt, has_b = _weight(b, xf.dtype)
    bad = _flags(xf.shape[0])
    if _ln_fwd(xf, wt, has_w, bt, has_b, xf.dtype.type(eps), y, bad, _lanes(xf.dtype)):
        return np.flatnonzero(bad)
    return None


def softmax_forward(xf, y):
    bad = _flags(xf.shape[0])
    return np.flatnonzero(bad) if _softmax_fwd(xf, y, bad, _lanes(xf.dtype)) else None


def softmax_backward(gf, yf, dst):
    bad = _flags(gf.shape[0])
    return np.flatnonzero(bad) if _softmax_bwd(gf, yf, dst, bad, _lanes(np.float64)) else None


_NO_FLAGS = np.zeros(1, np.uint8)


_HERE = globals()  # the loops are looked up when a block function runs, not when it is made (the op files make
# theirs once, at import; tests swap a loop for a spy)


def activation(name: str, careful):
    """A block function `fn(y, *xs)` for `_activations.elementwise`: the fused loop `name`, then the NumPy block
    function `careful` on the elements the loop reports it did not handle (NaN, inf, exp arguments out of range).
    Both decide element by element, so no element's result depends on its block (or the thread count)."""

    def fn(y, *xs):
        loop = _HERE[name]
        if loop(*xs, y, False, _NO_FLAGS):  # the rare case: run again, marking the elements left
            flags = np.zeros(y.size, np.uint8)
            loop(*xs, y, True, flags)
            idx = np.flatnonzero(flags)
            y[idx] = careful(np.zeros(idx.size, y.dtype), *[a[idx] for a in xs])
        return y

    fn.__name__ = f"fused_{getattr(careful, '__name__', 'block')}"
    fn.fused_loop = lambda: _HERE[name]  # for _activations.elementwise's direct path (small float32 calls)
    return fn


def silu_block(careful):
    return activation("_silu", careful)


def silu_grad_block(careful):
    return activation("_silu_grad", careful)


def gelu_tanh_block(careful):
    return activation("_gelu_tanh", careful)


def gelu_tanh_grad_block(careful):
    return activation("_gelu_tanh_grad", careful)


def swiglu_block(careful):
    return activation("_swiglu", careful)


def gelu_erf_block(careful):
    return activation("_gelu_erf", careful)


def gelu_erf_grad_block(careful):
    return activation("_gelu_erf_grad", careful)


if numba is not None:

    @_jit
    def _swiglu_grad(gate, up, g, dg, du, mark, flags):
        """dup = swiglu(gate, grad) (the forward's float32 formula) and dgate = (silu'(gate) grad) up in float64,
        rounded once, silu'(x) = (1 + x e / (1 + e)) / (1 + e), e = exp(-x) (_activations._silu_grad64's order),
        as the NumPy kernel does for float32 inputs; count of elements not handled (gate < -64 or NaN, a result
        that is not finite), marked in `flags` when `mark`."""
        deep = -_deep(gate)
        lo = -_hi(gate)
        one = _as(gate, 1.0)
        n = gate.size
        nbad = 0
        for c0 in range(0, n, CHUNK):
            c1 = min(c0 + CHUNK, n)
            gate_c = gate[c0:c1]
            up_c = up[c0:c1]
            g_c = g[c0:c1]
            dg_c = dg[c0:c1]
            du_c = du[c0:c1]
            flags_c = flags[c0:c1] if mark else flags
            for j in range(c1 - c0):
                v = gate_c[j]
                e = _exp32(max(-abs(v), lo))
                sg = max(e, one if v >= 0 else _as(gate, 0.0)) / (e + one)
                du_c[j] = v * (sg * g_c[j])
                v64 = np.float64(v)
                e64 = _exp64(max(-v64, -700.0))
                d = (1.0 + v64 * e64 / (1.0 + e64)) / (1.0 + e64)
                dg_c[j] = (d * np.float64(g_c[j])) * np.float64(up_c[j])
            nb = np.int32(0)
            for j in range(c1 - c0):
                nb += np.int32(not (gate_c[j] >= deep and np.isfinite(du_c[j]) and np.isfinite(np.float32(dg_c[j]))))
            if nb:
                nbad += nb
                if mark:
                    for j in range(c1 - c0):
                        if not (gate_c[j] >= deep and np.isfinite(du_c[j]) and np.isfinite(np.float32(dg_c[j]))):
                            flags_c[j] = 1
        return nbad


_SWIGLU_DEEP = 64.0  # _activations.DEEP[float32], the loops' `_deep`


def swiglu_backward_block(careful):
    """The block function (dg, du, gate, up, grad) of swiglu's backward: the fused loop, then `careful` (the NumPy
    block function) on the elements it leaves."""

    def fn(dg, du, gate, up, g):
        if _swiglu_grad(gate, up, g, dg, du, False, _NO_FLAGS):
            flags = np.zeros(gate.size, np.uint8)
            _swiglu_grad(gate, up, g, dg, du, True, flags)
            idx = np.flatnonzero(flags)
            a, b = careful(np.zeros(idx.size, dg.dtype), np.zeros(idx.size, du.dtype), gate[idx], up[idx], g[idx])
            dg[idx] = a
            # dup is swiglu(gate, grad) bit for bit: the NumPy one only where the forward's loop leaves it too
            fwd_left = ~(gate[idx] >= -_SWIGLU_DEEP)
            du[idx[fwd_left]] = b[fwd_left]
        return dg, du

    fn.fused_loop = lambda: _HERE["_swiglu_grad"]  # for _activations.elementwise's direct path (small float32 calls)
    return fn


if numba is not None:

    @_jit
    def _ln_bwd(x, g, w, has_w, eps, dx, dw, db, bad, acc, acc2, xh):
        """layernorm's backward per row in float64: xhat = d r with d = (x - x0) - mean(x - x0), r = 1/sqrt(var + eps);
        dx = ((g w - mean(g w)) - xhat mean(g w xhat)) r, the NumPy kernel's order; dw += g xhat and db += g over
        the rows handled. bad[i] = 1 (row left to the NumPy kernel, not in dw/db) where the statistics or dx are
        not finite, or rows of 2 elements (the NumPy kernel's exact form). Every loop is a map or a LANES sum (one
        loop per has_w case: a branch inside kept loops from vectorising)."""
        rows, n = x.shape
        m = n - n % LANES
        nbad = 0
        for i in range(rows):
            xi, gi, di = x[i], g[i], dx[i]
            x0 = np.float64(xi[0])
            mean = _lane_sum(xi, x0, 0.0, False, acc) / n
            var = _lane_sum(xi, x0, mean, True, acc) / n
            if n == 2 or not (np.isfinite(var) and np.isfinite(mean)):
                bad[i] = 1
                nbad += 1
                continue
            r = 1.0 / np.sqrt(var + eps)
            for j in range(n):
                xh[j] = ((np.float64(xi[j]) - x0) - mean) * r
            acc[:] = 0
            acc2[:] = 0
            if has_w:
                for j0 in range(0, m, LANES):
                    for k in range(LANES):
                        gv = np.float64(gi[j0 + k])
                        acc[k] += gv * w[j0 + k]
                        acc2[k] += (gv * xh[j0 + k]) * w[j0 + k]
            else:
                for j0 in range(0, m, LANES):
                    for k in range(LANES):
                        gv = np.float64(gi[j0 + k])
                        acc[k] += gv
                        acc2[k] += gv * xh[j0 + k]
            sg = 0.0
            c = 0.0
            for k in range(LANES):
                sg += acc[k]
                c += acc2[k]
            for j in range(m, n):
                gv = np.float64(gi[j])
                sg += gv * w[j] if has_w else gv
                c += (gv * xh[j]) * w[j] if has_w else gv * xh[j]
            mg = sg / n
            c = c / n
            fin = 0
            if has_w:
                for j in range(n):
                    d = ((np.float64(gi[j]) * w[j] - mg) - xh[j] * c) * r
                    di[j] = d
                    fin += not np.isfinite(d)
            else:
                for j in range(n):
                    d = ((np.float64(gi[j]) - mg) - xh[j] * c) * r
                    di[j] = d
                    fin += not np.isfinite(d)
            if fin:
                bad[i] = 1
                nbad += 1
                continue
            for j in range(n):
                gv = np.float64(gi[j])
                dw[j] += gv * xh[j]
                db[j] += gv
        return nbad


def ln_backward(xf, gf, w, eps: float, dx, dw, db):
    """layernorm's backward of the rows (float32 xf, gf; dx float32) in float64; adds the rows' g xhat and g into
    the float64 `dw` and `db`. Returns the indices of the rows left for the NumPy kernel (not in dx, dw, db), or None."""
    wt, has_w = _weight(w, np.float64)
    bad = _flags(xf.shape[0])
    scratch = np.zeros(2 * LANES + xf.shape[1])  # one allocation (a decode row's call is microseconds): lanes, xhat
    if _ln_bwd(xf, gf, wt, has_w, float(eps), dx, dw, db, bad, scratch[:LANES], scratch[LANES:2 * LANES],
               scratch[2 * LANES:]):
        return np.flatnonzero(bad)
    return None


if numba is not None:

    @_inline
    def _rope_row(xr, yr, cr, sr, interleaved):
        """One row of D features: y = (x1 c - x2 s, x2 c + x1 s) per pair, the NumPy kernel's roundings."""
        half = cr.size
        if interleaved:
            for i in range(half):
                x1, x2 = xr[2 * i], xr[2 * i + 1]
                yr[2 * i] = x1 * cr[i] - x2 * sr[i]
                yr[2 * i + 1] = x2 * cr[i] + x1 * sr[i]
        else:
            for i in range(half):
                x1, x2 = xr[i], xr[i + half]
                yr[i] = x1 * cr[i] - x2 * sr[i]
                yr[i + half] = x2 * cr[i] + x1 * sr[i]

    @_jit
    def _rope(x, c, sn, interleaved, y):
        """_rope_row over x, y [B, H, S, D] (float32), tables [Bc, S, D/2] with Bc = 1 (shared) or B."""
        nb, nh, ns, d = x.shape
        for b in range(nb):
            cb, sb = c[b if c.shape[0] > 1 else 0], sn[b if c.shape[0] > 1 else 0]
            for h in range(nh):
                for t in range(ns):
                    _rope_row(x[b, h, t], y[b, h, t], cb[t], sb[t], interleaved)


def rope(xb: np.ndarray, c: np.ndarray, sn: np.ndarray, interleaved: bool, y: np.ndarray) -> None:
    """rope of the float32 block xb [b, h, S, D] into y, tables [S, D/2] or [b or 1, S, D/2] (float32, contiguous).
    Elementwise products and sums: no value needs the NumPy kernel (inf and NaN propagate as there)."""
    if c.ndim == 2:
        c, sn = c[None], sn[None]
    _rope(xb, c, sn, interleaved, y)


if numba is not None:

    @_inline
    def _exp32_low(x):
        """exp of a float32 x <= 87, down into the subnormals (x < -87.3): 2^k in two normal halves, so the
        product rounds into the subnormal range instead of needing an exponent below -126; 0 below -104."""
        x = max(x, np.float32(-104.0))
        k, kf = _round_log2(x, 0)
        r = _fma(k, np.float32(-0.693359375), x)
        r = _fma(k, np.float32(2.12194440e-4), r)
        p = _poly_exp32(r)
        ki = _float_as_int(kf) - _float_as_int(np.float32(12582912.0))  # k: kf and the constant share a binade
        k1 = ki >> np.int32(1)
        return (p * _int_as_float((k1 + np.int32(127)) << np.int32(23))) * _int_as_float(
            (ki - k1 + np.int32(127)) << np.int32(23))

    @_jit
    def _ce_stats(x, pivot, want_d, m_out, s_out, d_out, bad, acc, acc2):
        """Per row of float32 logits: m = max, s = sum exp(x - m), d = sum(x - pivot) (when want_d), each in float32
        over LANES partial sums. bad[i] = 1 (row left to the NumPy kernel) where m or s is not finite (inf, NaN,
        all -inf)."""
        rows, v = x.shape
        mm = v - v % LANES
        nbad = 0
        for i in range(rows):
            xi = x[i]
            acc[:] = -np.inf
            for j0 in range(0, mm, LANES):
                for k in range(LANES):
                    acc[k] = max(acc[k], xi[j0 + k])
            m = _as(x, -np.inf)
            for k in range(LANES):
                m = max(m, acc[k])
            for j in range(mm, v):
                m = max(m, xi[j])
            acc[:] = 0
            for j0 in range(0, mm, LANES):
                for k in range(LANES):
                    acc[k] += _exp32_low(xi[j0 + k] - m)
            s = _as(x, 0.0)
            for k in range(LANES):
                s += acc[k]
            for j in range(mm, v):
                s += _exp32_low(xi[j] - m)
            if not (np.isfinite(m) and np.isfinite(s)):  # NaN anywhere makes s NaN
                bad[i] = 1
                nbad += 1
                continue
            m_out[i], s_out[i] = m, s
            if want_d:
                pv = pivot[i]
                acc2[:] = 0
                for j0 in range(0, mm, LANES):
                    for k in range(LANES):
                        acc2[k] += xi[j0 + k] - pv
                d = _as(x, 0.0)
                for k in range(LANES):
                    d += acc2[k]
                for j in range(mm, v):
                    d += xi[j] - pv
                d_out[i] = d
        return nbad

    @_jit
    def _ce_grad(x, a, b, epsv, c, y, bad):
        """y = (exp((x - a) - b) - eps/V) c per row (the NumPy kernel's order; the target column is the caller's).
        bad[i] = 1 where an exp argument exceeds 87 or is NaN (the NumPy kernel decides those rows)."""
        rows, v = x.shape
        nbad = 0
        for i in range(rows):
            xi, yi = x[i], y[i]
            ai, bi, ci = a[i], b[i], c[i]
            out = 0
            for j in range(v):
                t = (xi[j] - ai) - bi
                out += not (t <= np.float32(87.0))
                yi[j] = (_exp32_low(min(t, np.float32(87.0))) - epsv) * ci
            if out:
                bad[i] = 1
                nbad += 1
        return nbad


def ce_stats(xf: np.ndarray, pivot: np.ndarray, want_d: bool, rows_on=None) -> tuple:
    """(m, s, d, rows left to NumPy or None) of cross_entropy's rows, float32 logits [rows, V]. `rows_on`
    (_cfuncs.row_tasks, optional) may run the rows as tasks on torch's pool instead of on this thread."""
    rows = xf.shape[0]
    m, s, d = np.zeros(rows, np.float32), np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    bad, pivot = _flags(rows), pivot.astype(np.float32)
    nbad = None if rows_on is None else rows_on("ce_stats_rows", (xf, pivot, m, s, d, bad), (int(want_d),))
    if nbad is None:
        nbad = _ce_stats(xf, pivot, want_d, m, s, d, bad, np.zeros(LANES, np.float32), np.zeros(LANES, np.float32))
    return m, s, d, (np.flatnonzero(bad) if nbad else None)


def ce_grad(xf, a, b, epsv, c, y, rows_on=None) -> np.ndarray | None:
    bad = _flags(xf.shape[0])
    a, b, c = (np.ascontiguousarray(z, np.float32) for z in (a, b, c))
    nbad = None if rows_on is None else rows_on("ce_grad_rows", (xf, a, b, c, y, bad), (), float(epsv))
    if nbad is None:
        nbad = _ce_grad(xf, a, b, np.float32(epsv), c, y, bad)
    return np.flatnonzero(bad) if nbad else None


# --------------------------------------------------------------------------- scattered row updates

if numba is not None:

    @_jit
    def _add_scaled_rows(dst, col, dt, x, hit):
        """dst[col[i]] += dt[i] * x[hit[i]] for i in order: np.add.at's order and roundings (the product rounded,
        then added), without its per-element dispatch."""
        for i in range(col.size):
            r, xr, d = dst[col[i]], x[hit[i]], dt[i]
            for j in range(r.size):
                r[j] += d * xr[j]


def add_scaled_rows(dst: np.ndarray, col: np.ndarray, dt: np.ndarray, x: np.ndarray, hit: np.ndarray) -> None:
    """`np.add.at(dst, col, dt[:, None] * x[hit])`, the same bits: the LM heads' target terms of dweight, rows of dst
    that several targets may share, added in row order. The loop for float32 (1.6 ms -> 18 us for 512 rows of 256 into
    2048 x 256, 2026-12-03); NumPy's ufunc.at otherwise. Also dhidden's (distinct rows: `dst[col] += ...` bits,
    98 -> 19 us for 512 x 256, 2026-12-05)."""
    if dst.dtype == x.dtype == dt.dtype == np.float32 and enabled(np.float32):
        _add_scaled_rows(dst, col, dt, x, hit)
    else:
        np.add.at(dst, col, dt[:, None] * x[hit])


# --------------------------------------------------------------------------- attention, one query row per head

DOT_LANES = 16  # partial sums of a q.k dot product (float32 lanes: the vector registers of one or a few SIMD ops)


def _slp(dispatcher):
    """`dispatcher` (numba.njit) compiled with LLVM's SLP vectoriser on: numba leaves it off (NUMBA_SLP_VECTORIZE=0),
    so 16 partial sums kept in scalars stay 16 scalar chains; with it, vector registers. The flag is numba's
    global setting, read when a function's LLVM passes are built: set for this compile only, under numba's compiler
    lock (any compile it overlaps would only vectorise more: SLP does not reorder floating-point arithmetic)."""
    from numba.core import config
    from numba.core.compiler_lock import global_compiler_lock

    compile_ = dispatcher.compile

    def compile(sig):
        with global_compiler_lock:
            old, config.SLP_VECTORIZE = config.SLP_VECTORIZE, 1
            try:
                return compile_(sig)
            finally:
                config.SLP_VECTORIZE = old

    dispatcher.compile = compile
    return dispatcher


if numba is not None:

    @_inline
    def _dot_lanes(a, b, m_d):
        """a.b over the first m_d (a multiple of DOT_LANES) elements: lane x = a[x] b[x] + a[x + 16] b[x + 16] + ... in
        order, the 16 lanes then added as a tree (x + 8, x + 4, x + 2, then lane 0 + lane 1). The lanes are scalars
        (l0 .. lf: lane 15), which the SLP vectoriser (`_slp`) keeps in vector registers; 0 where m_d is 0."""
        if m_d == 0:
            return np.float32(0)
        l0, l1, l2, l3 = a[0] * b[0], a[1] * b[1], a[2] * b[2], a[3] * b[3]
        l4, l5, l6, l7 = a[4] * b[4], a[5] * b[5], a[6] * b[6], a[7] * b[7]
        l8, l9, la, lb = a[8] * b[8], a[9] * b[9], a[10] * b[10], a[11] * b[11]
        lc, ld, le, lf = a[12] * b[12], a[13] * b[13], a[14] * b[14], a[15] * b[15]
        for i in range(DOT_LANES, m_d, DOT_LANES):
            l0, l1 = l0 + a[i + 0] * b[i + 0], l1 + a[i + 1] * b[i + 1]
            l2, l3 = l2 + a[i + 2] * b[i + 2], l3 + a[i + 3] * b[i + 3]
            l4, l5 = l4 + a[i + 4] * b[i + 4], l5 + a[i + 5] * b[i + 5]
            l6, l7 = l6 + a[i + 6] * b[i + 6], l7 + a[i + 7] * b[i + 7]
            l8, l9 = l8 + a[i + 8] * b[i + 8], l9 + a[i + 9] * b[i + 9]
            la, lb = la + a[i + 10] * b[i + 10], lb + a[i + 11] * b[i + 11]
            lc, ld = lc + a[i + 12] * b[i + 12], ld + a[i + 13] * b[i + 13]
            le, lf = le + a[i + 14] * b[i + 14], lf + a[i + 15] * b[i + 15]
        l0, l1, l2, l3 = l0 + l8, l1 + l9, l2 + la, l3 + lb
        l4, l5, l6, l7 = l4 + lc, l5 + ld, l6 + le, l7 + lf
        l0, l1, l2, l3 = l0 + l4, l1 + l5, l2 + l6, l3 + l7
        l0, l1 = l0 + l2, l1 + l3
        return l0 + l1

    @_slp
    @_jit
    def _attn_decode(q, k, v, scale, softcap, kstart, kend, out, lse, s):
        """One query row per head: out[b, i, 0] = softmax(scale q[b, i, 0].k_t, t in [kstart, kend)) . v for q
        [B, Hq, 1, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (float32, any strides; query head i reads KV head
        i // (Hq / Hkv)), softcap > 0 or 0 for none; lse[b, i, 0] = max + log(sum). Returns 1 where a head's scores or
        output are not all finite (the NumPy kernel then runs the whole call). Scratch: s [Hq / Hkv, Sk].

        Each q.k in DOT_LANES lanes, lane x = q[x] k[x] + q[x + 16] k[x + 16] + ... in order, the lanes then added as
        a tree (x + 8, x + 4, x + 2, then lane 0 + lane 1) and the last D mod 16 products in order: the lanes are 16
        scalars, which the SLP vectoriser (`_slp`) keeps in vector registers, so nothing is transposed and every
        key costs the same, whatever the keys around it. Then the scores' max, exp(s - max) by _exp32 (a loop of its
        own over the keys), their sum and the weighted sum of v rows in key order, divided once by the sum."""
        nb, hq, _, d = q.shape
        nh, dv = k.shape[1], v.shape[3]
        g = hq // nh
        m_d = d - d % DOT_LANES
        sc_t, cap = np.float32(scale), np.float32(softcap)
        for b in range(nb):
            for h in range(nh):
                kb, vb = k[b, h], v[b, h]
                for j in range(g):
                    qr, sj = q[b, h * g + j, 0], s[j]
                    for t in range(kstart, kend):
                        kr = kb[t]
                        acc = _dot_lanes(qr, kr, m_d)
                        for x in range(m_d, d):
                            acc += qr[x] * kr[x]
                        sj[t] = acc
                for j in range(g):
                    sj, o = s[j], out[b, h * g + j, 0]
                    m = np.float32(-np.inf)
                    for t in range(kstart, kend):
                        sc = sj[t] * sc_t
                        if cap > 0:
                            sc = np.float32(np.tanh(sc / cap)) * cap
                        if not np.isfinite(sc):
                            return 1
                        sj[t] = sc
                        m = max(m, sc)
                    for t in range(kstart, kend):
                        # _exp32's range ends at -87 (exp = 1.6e-38): a key further below the max weighs at most
                        # that instead of a subnormal or 0, against den >= 1 (the max's own term): invisible in float32
                        sj[t] = _exp32(max(sj[t] - m, np.float32(-87.0)))
                    den = np.float32(0)
                    for t in range(kstart, kend):
                        den += sj[t]
                    o[:] = 0
                    for t in range(kstart, kend):
                        p = sj[t]
                        for x in range(dv):
                            o[x] += p * vb[t, x]
                    for x in range(dv):
                        o[x] /= den
                        if not np.isfinite(o[x]):
                            return 1
                    lse[b, h * g + j, 0] = m + np.log(den)
        return 0


DECODE_MAX = 1 << 22  # multiply-adds (B Hq Sk (D + Dv)) up to which one query row per head runs the loop above


def attention_decode(q, k, v, scale, softcap, kstart: int, kend: int):
    """(out [B, Hq, 1, Dv], lse [B, Hq, 1]) of q [B, Hq, 1, D] (float32 q, k, v) over keys [kstart, kend) by
    `_attn_decode`, or None where the loop declines (a non-finite score or output). Which calls come here:
    cpu/attention.decode_call."""
    b, hq, _, d = q.shape
    dv = v.shape[3]
    out, lse = np.empty((b, hq, 1, dv), np.float32), np.empty((b, hq, 1), np.float32)  # all written, or None
    s = np.empty((hq // k.shape[1], k.shape[2]), np.float32)  # scratch from here: numba's own allocations would not
    # compile while the conformance suite's poisoning np.empty stands in for NumPy's
    if _attn_decode(q, k, v, float(scale), 0.0 if softcap is None else float(softcap), kstart, kend, out, lse, s):
        return None
    return out, lse


# --------------------------------------------------------------------------- attention's score blocks

if numba is not None:

    @_jit
    def _attn_softmax(s, scale, vis_a, vis_b, bq, m_old, m_new, psum, acc):
        """One key block of the online softmax, rows of s [rows, bk] (query row r sees keys [vis_a[r % bq],
        vis_b[r % bq]) of the block): s -> p = exp(s scale - m_ref) in place, 0 at hidden keys, with m_new = max(m_old,
        the row's scaled scores), m_ref = m_new (0 while it is -inf) and psum = the row's sum of p.
        The NumPy kernel's arithmetic in the same order (s scale, then - m_ref, in float32); exp is _exp32, its
        argument held at -87 (a key that far below the max weighs 1.6e-38 instead of a subnormal, against the max's
        own 1). Returns 1, having written nothing, where a visible scaled score is not finite or m_old is NaN or +inf
        (the NumPy kernel then takes the block; it weighs a -inf score 0). Three loops a row, each vectorised: the
        maxima in LANES lanes (which also count what the loop declines: no early exit), the exp map, the sum in
        LANES lanes (added in order, then the tail). Each row's visible keys are a slice: indexing s[i, j] with a
        j of unknown sign made numba wrap negative indices, which kept the loops scalar (3.5 ns an exp, 0.4 here)."""
        rows, bk = s.shape
        nbad = 0
        for i in range(rows):
            r = i % bq
            si = s[i, vis_a[r]:vis_b[r]]
            n = si.size
            m_fl = n - n % LANES
            acc[:] = -np.inf
            for j0 in range(0, m_fl, LANES):
                for k in range(LANES):
                    x = si[j0 + k] * scale
                    nbad += not np.isfinite(x)
                    acc[k] = max(acc[k], x)
            mx = m_old[i]
            nbad += not mx < np.inf
            for k in range(LANES):
                mx = max(mx, acc[k])
            for j in range(m_fl, n):
                x = si[j] * scale
                nbad += not np.isfinite(x)
                mx = max(mx, x)
            m_new[i] = mx
        if nbad:
            return 1
        lo = np.float32(-87.0)
        for i in range(rows):
            r = i % bq
            a, b = vis_a[r], max(vis_a[r], vis_b[r])
            s[i, :a] = 0
            s[i, b:] = 0
            si = s[i, a:b]
            ref = m_new[i] if m_new[i] > -np.inf else np.float32(0.0)
            for j in range(si.size):
                si[j] = _exp32(max(si[j] * scale - ref, lo))
            psum[i] = _lane_sum(si, np.float32(0.0), np.float32(0.0), False, acc)
        return 0

    @_jit
    def _attn_grad_scores(s, scale, vis_a, vis_b, bq, lse, dp, big_d, ds):
        """The backward's elementwise block: s [rows, bk] -> P = exp(s scale - lse) in place and ds = float32(dp - D) P
        (dp float64, D = big_d[row] float64), both 0 at hidden keys and in rows whose lse is +inf (the rows that see
        nothing). The NumPy kernel's arithmetic in the same order; exp as in _attn_softmax. Returns 1, having written
        nothing, where a visible score, s scale - lse (above 87) or dp - D is not finite: a counting pass first, then
        the map (both vectorised; visible keys as slices, as there)."""
        rows, bk = s.shape
        nbad = 0
        for i in range(rows):
            li = lse[i]
            if li == np.inf:
                continue
            r = i % bq
            si, dpi, d = s[i, vis_a[r]:vis_b[r]], dp[i, vis_a[r]:vis_b[r]], big_d[i]
            for j in range(si.size):
                x = si[j] * scale - li
                nbad += not (np.isfinite(x) and x <= 87.0 and np.isfinite(dpi[j] - d))
        if nbad:
            return 1
        lo = np.float32(-87.0)
        for i in range(rows):
            r = i % bq
            li = lse[i]
            a, b = (vis_a[r], max(vis_a[r], vis_b[r])) if li != np.inf else (0, 0)
            s[i, :a] = 0
            s[i, b:] = 0
            ds[i, :a] = 0
            ds[i, b:] = 0
            si, dpi, dsi, d = s[i, a:b], dp[i, a:b], ds[i, a:b], big_d[i]
            for j in range(si.size):
                p = _exp32(max(si[j] * scale - li, lo))
                si[j] = p
                dsi[j] = np.float32(dpi[j] - d) * p
        return 0


def _visible(nvis, bq: int, bk: int) -> tuple:
    """Per query row of the block, its visible keys [a, b) as int64 arrays (all bk keys where nvis is None)."""
    if nvis is None:
        return np.zeros(bq, np.int64), np.full(bq, bk, np.int64)
    return nvis[0].astype(np.int64), nvis[1].astype(np.int64)


def attention_softmax(s, scale, nvis, bq: int, m_old):
    """_attn_softmax on a score block s [n, R, bk] float32 (C-contiguous, R = g bq rows) and the running max
    m_old [n, R, 1]: (m_new, psum), both [n, R, 1], with s now P; None (s untouched) where the loop declines."""
    n, rows, bk = s.shape
    a, b = _visible(nvis, bq, bk)
    m_new, psum = np.empty((n, rows, 1), np.float32), np.empty((n, rows, 1), np.float32)  # all written, or dropped
    if _attn_softmax(s.reshape(n * rows, bk), s.dtype.type(scale), a, b, bq, m_old.reshape(-1), m_new.reshape(-1),
                     psum.reshape(-1), _lanes(np.float32)):
        return None
    return m_new, psum


def attention_grad_scores(s, scale, nvis, bq: int, lse, dp, big_d):
    """_attn_grad_scores on s [n, R, bk] float32, lse [n, R, 1] float32, dp [n, R, bk] and D [n, R, 1] float64:
    dS [n, R, bk] float32, with s now P; None (s untouched) where the loop declines."""
    n, rows, bk = s.shape
    a, b = _visible(nvis, bq, bk)
    ds = np.empty(s.shape, np.float32)  # all written, or dropped
    if _attn_grad_scores(s.reshape(n * rows, bk), s.dtype.type(scale), a, b, bq, np.ascontiguousarray(lse).reshape(-1),
                         dp.reshape(n * rows, bk), np.ascontiguousarray(big_d).reshape(-1), ds.reshape(n * rows, bk)):
        return None
    return ds
