"""The fused loops' C entry points, defined at module level (imported by _cfuncs.addresses on first use): numba's
disk cache keys a function by its code and its closure's contents, and a closure holding a compiled loop (pickled
with a per-process id) missed the cache in every process (2 s of compiling each time)."""

import numpy as np
from numba import carray, cfunc, types

from opport.backends.cpu import _fused

f32, f64, u8 = (types.CPointer(t) for t in (types.float32, types.float64, types.uint8))
i64 = types.int64
loops = _fused._HERE


def entry(sig):
    return cfunc(sig, cache=True, nogil=True)


silu_f, silu_b = loops["_silu"], loops["_silu_grad"]
swiglu_f, swiglu_b = loops["_swiglu"], loops["_swiglu_grad"]
ln_f, ln_b = loops["_ln_fwd"], loops["_ln_bwd"]
rms_f, rms_b = loops["_rms_fwd"], loops["_rms_bwd"]
lanes = _fused.LANES


@entry(i64(f32, f32, i64, u8))
def silu_forward(x, y, n, fl):
    return silu_f(carray(x, n), carray(y, n), False, carray(fl, 1))


@entry(i64(f32, f32, f32, i64, u8))
def silu_backward(x, g, dx, n, fl):
    return silu_b(carray(x, n), carray(g, n), carray(dx, n), False, carray(fl, 1))


@entry(i64(f32, f32, f32, i64, u8))
def swiglu_forward(gate, up, y, n, fl):
    return swiglu_f(carray(gate, n), carray(up, n), carray(y, n), False, carray(fl, 1))


@entry(i64(f32, f32, f32, f32, f32, i64, u8))
def swiglu_backward(gate, up, g, dgate, dup, n, fl):
    return swiglu_b(carray(gate, n), carray(up, n), carray(g, n), carray(dgate, n), carray(dup, n), False,
                    carray(fl, 1))


@entry(i64(f32, f32, f32, f32, i64, i64, types.float32, u8, f32))
def layernorm_forward(x, w, b, y, rows, n, eps, bad, acc):
    return ln_f(carray(x, (rows, n)), carray(w, n), True, carray(b, n), True, eps, carray(y, (rows, n)),
                carray(bad, rows), carray(acc, lanes))


@entry(i64(f32, f32, f64, f32, f64, f64, i64, i64, types.float64, u8, f64))
def layernorm_backward(x, g, w, dx, dw, db, rows, n, eps, bad, scratch):
    s = carray(scratch, 2 * lanes + n)  # the op file's one scratch allocation: two lane sums, then xhat
    return ln_b(carray(x, (rows, n)), carray(g, (rows, n)), carray(w, n), True, eps, carray(dx, (rows, n)),
                carray(dw, n), carray(db, n), carray(bad, rows), s[:lanes], s[lanes:2 * lanes], s[2 * lanes:])


@entry(i64(f32, f32, f32, i64, i64, types.float32, u8, f32))
def rmsnorm_forward(x, w, y, rows, n, eps, bad, acc):  # with a weight; add_rmsnorm's too, on the rounded sum
    return rms_f(carray(x, (rows, n)), carray(w, n), True, eps, carray(y, (rows, n)), carray(bad, rows),
                 carray(acc, lanes))


@entry(i64(f32, f32, f64, f32, f64, i64, i64, types.float64, u8, f64))
def rmsnorm_backward(x, g, w, dx, dw, rows, n, eps, bad, scratch):  # with a weight, offset 0, no h
    s = carray(scratch, lanes + n)  # the op file's scratch: the lane sums, then xhat
    xs = carray(x, (rows, n))
    return rms_b(xs, carray(g, (rows, n)), carray(w, n), True, eps, xs[:1, :1], False, carray(dx, (rows, n)),
                 carray(dw, n), carray(bad, rows), s[:lanes], s[lanes:])  # (x's first element: h, never read)


@entry(i64(f32, f32, f32, f64, f32, f64, i64, i64, types.float64, u8, f64))
def add_rmsnorm_backward(x, g, h, w, dx, dw, rows, n, eps, bad, scratch):  # x: the saved sum; h: its gradient
    s = carray(scratch, lanes + n)
    return rms_b(carray(x, (rows, n)), carray(g, (rows, n)), carray(w, n), True, eps, carray(h, (rows, n)), True,
                 carray(dx, (rows, n)), carray(dw, n), carray(bad, rows), s[:lanes], s[lanes:])

# row tasks (int64 task, int64* ints, double* floats), run by the native extension's run_tasks on torch's pool:
# ints = the arrays' addresses, then rows, V and the rows per task; task t takes rows [t per, (t + 1) per)
ce_s, ce_g, at, scratch = loops["_ce_stats"], loops["_ce_grad"], _fused._at, _fused._scratch
task = i64(i64, types.CPointer(i64), f64)


@entry(task)
def ce_stats_rows(t, ints, floats):
    iv = carray(ints, 10)
    rows, v, want_d, per = iv[6], iv[7], iv[8] != 0, iv[9]
    r0, r1 = t * per, min(rows, (t + 1) * per)
    x, pivot = carray(at(iv[0], np.float32), (rows, v)), carray(at(iv[1], np.float32), rows)
    m, s, d = carray(at(iv[2], np.float32), rows), carray(at(iv[3], np.float32), rows), carray(at(iv[4], np.float32), rows)
    bad = carray(at(iv[5], np.uint8), rows)
    return ce_s(x[r0:r1], pivot[r0:r1], want_d, m[r0:r1], s[r0:r1], d[r0:r1], bad[r0:r1],
                scratch(lanes, np.float32), scratch(lanes, np.float32))


@entry(task)
def ce_grad_rows(t, ints, floats):
    iv = carray(ints, 9)
    rows, v, per = iv[6], iv[7], iv[8]
    r0, r1 = t * per, min(rows, (t + 1) * per)
    x, y = carray(at(iv[0], np.float32), (rows, v)), carray(at(iv[4], np.float32), (rows, v))
    a, b, c = carray(at(iv[1], np.float32), rows), carray(at(iv[2], np.float32), rows), carray(at(iv[3], np.float32), rows)
    bad = carray(at(iv[5], np.uint8), rows)
    return ce_g(x[r0:r1], a[r0:r1], b[r0:r1], np.float32(carray(floats, 1)[0]), c[r0:r1], y[r0:r1], bad[r0:r1])


# rmsnorm's and add_rmsnorm's node backward split over torch's pool (torch_native.cpp, rms_backward): row tasks write
# dx and each row's 1 / rms, then column tasks sum dweight over all rows in row order, _rms_bwd's bits either way.
# ints = x, g, h (0: none), w (float64), dx, dw (float64), rs (float64), bad addresses, then rows, n, rows per task,
# columns per task; floats = [eps]
rms_dx, rms_dw = loops["_rms_bwd_dx"], loops["_rms_dw_cols"]


@entry(task)
def rms_backward_rows(t, ints, floats):
    iv = carray(ints, 12)
    rows, n, per = iv[8], iv[9], iv[10]
    r0, r1 = t * per, min(rows, (t + 1) * per)
    x, g = carray(at(iv[0], np.float32), (rows, n)), carray(at(iv[1], np.float32), (rows, n))
    h = carray(at(iv[2] if iv[2] else iv[1], np.float32), (rows, n))  # (g stands in where there is no h: never read)
    w, dx = carray(at(iv[3], np.float64), n), carray(at(iv[4], np.float32), (rows, n))
    rs, bad = carray(at(iv[6], np.float64), rows), carray(at(iv[7], np.uint8), rows)
    return rms_dx(x[r0:r1], g[r0:r1], w, carray(floats, 1)[0], h[r0:r1], iv[2] != 0, dx[r0:r1], rs[r0:r1],
                  bad[r0:r1], scratch(lanes, np.float64), scratch(n, np.float64))


@entry(task)
def rms_backward_cols(t, ints, floats):
    iv = carray(ints, 12)
    rows, n, per = iv[8], iv[9], iv[11]
    c0, c1 = t * per, min(n, (t + 1) * per)
    x, g = carray(at(iv[0], np.float32), (rows, n)), carray(at(iv[1], np.float32), (rows, n))
    rms_dw(x[:, c0:c1], g[:, c0:c1], carray(at(iv[6], np.float64), rows), carray(at(iv[5], np.float64), n)[c0:c1])
    return 0


# rope's node (torch_native.cpp, Rope) in row tasks over torch's pool: rows (b, h, s) of x [B, H, S, D] at any strides
# (the last one 1) into a contiguous y; the backward is the same rotation with the sine table negated (exact).
# ints = x, y, cos, sin addresses, B, H, S, D, x's strides in elements (batch, head, position), the tables' batch
# (1 or B), interleaved, rows per task
rope_row = loops["_rope_row"]


@entry(task)
def rope_rows(t, ints, floats):
    iv = carray(ints, 14)
    nh, ns, d, bc, per = iv[5], iv[6], iv[7], iv[11], iv[13]
    rows = iv[4] * nh * ns
    c, sn = carray(at(iv[2], np.float32), (bc * ns, d // 2)), carray(at(iv[3], np.float32), (bc * ns, d // 2))
    y = carray(at(iv[1], np.float32), (rows, d))
    for r in range(t * per, min(rows, (t + 1) * per)):
        b, h, p = r // (nh * ns), (r // ns) % nh, r % ns
        xr = carray(at(iv[0] + 4 * (b * iv[8] + h * iv[9] + p * iv[10]), np.float32), d)
        k = (b if bc > 1 else 0) * ns + p
        rope_row(xr, y[r], c[k], sn[k], iv[12] != 0)
    return 0


# attention's decode step (one query row per head) without the dispatcher (torch_native.cpp, attention_decode):
# _attn_decode on contiguous q [B, Hq, 1, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] into out [B, Hq, 1, Dv] and
# lse [B, Hq, 1], scratch s [Hq / Hkv, Sk]; keys [kstart, kend); softcap 0 for none. 1 where the loop declines.
attn_decode = loops["_attn_decode"]


@entry(i64(f32, f32, f32, f32, f32, f32, i64, i64, i64, i64, i64, i64, types.float64, types.float64, i64, i64))
def attention_decode(q, k, v, out, lse, s, nb, hq, hkv, sk, d, dv, scale, softcap, kstart, kend):
    return attn_decode(carray(q, (nb, hq, 1, d)), carray(k, (nb, hkv, sk, d)), carray(v, (nb, hkv, sk, dv)), scale,
                       softcap, kstart, kend, carray(out, (nb, hq, 1, dv)), carray(lse, (nb, hq, 1)),
                       carray(s, (hq // hkv, sk)))


ENTRIES = {f.__name__: f for f in (silu_forward, silu_backward, swiglu_forward, swiglu_backward,
                                 layernorm_forward, layernorm_backward, rmsnorm_forward, rmsnorm_backward,
                                 add_rmsnorm_backward,
                                 ce_stats_rows, ce_grad_rows, rms_backward_rows, rms_backward_cols, rope_rows,
                                 attention_decode)}
