"""attention's task loops (numba, compiled on first import, cached on disk): _attn_tasks.py says what they do.

Every function here is a module-level one: numba's disk cache keys a function by its code and its closure's
contents, and a closure holding another compiled function (a dispatcher, pickled with a per-process id) never hits
the cache, so the tasks would compile again in every process (13 s).
"""

import numba
import numpy as np
from numba import carray, cfunc, types

from opport.backends.cpu import _fused

jit = numba.njit(cache=True, nogil=True, fastmath=False, error_model="numpy")
softmax, grad_scores, lanes_n = _fused._attn_softmax, _fused._attn_grad_scores, _fused.LANES
scratch, at = _fused._scratch, _fused._at


@jit
def zeros(n, dtype):
    a = scratch(n, dtype)
    a[:] = 0
    return a


@jit
def add_to(dst, src):
    """dst += src (2-D) as plain loops: numba's `dst[a:b] += src` on 2-D views runs a tenth of the backward slower."""
    for i in range(src.shape[0]):
        for c in range(src.shape[1]):
            dst[i, c] += src[i, c]


@jit
def scaled_to(dst, src, s):
    """dst = src * s for one row, in place (numba's `dst[:] = src * s` allocates the product first)."""
    for c in range(src.size):
        dst[c] = src[c] * s


@jit
def visible(vb, nr, i0, j0, w, off, causal):
    """Per row r of the block, the keys of [j0, j0 + w) it sees are [0, vb[r]); whether some row misses one."""
    partial = False
    for r in range(nr):
        b = min(max(i0 + r + off + 1 - j0, 0), w) if causal else w
        vb[r] = b
        partial |= b < w
    return partial


@jit
def finite(a):  # a 2-D block
    bad = 0
    for i in range(a.shape[0]):
        for x in a[i]:
            bad += not np.isfinite(x)
    return bad == 0


@jit
def key_end(i0, nr, sk, off, causal):
    return max(min(sk, i0 + nr + off), 0) if causal else sk


@jit
def forward_task(t, q, k, v, out, lse, g, bq, bk, causal, scale):
    hq, sq, d = q.shape
    sk, dv = k.shape[1], v.shape[2]
    nqb = (sq + bq - 1) // bq
    h, ib = t // nqb, t % nqb
    i0 = ib * bq
    nr = min(bq, sq - i0)
    rows, off = g * nr, sk - sq
    qs = scratch(rows * d, np.float32).reshape((rows, d))
    for j in range(g):
        qs[j * nr:(j + 1) * nr] = q[h * g + j, i0:i0 + nr]
    m = scratch(rows, np.float32)
    m[:] = -np.inf
    m_new, psum, den = scratch(rows, np.float32), scratch(rows, np.float32), scratch(rows, np.float32)
    acc, pv = scratch(rows * dv, np.float32).reshape((rows, dv)), scratch(rows * dv, np.float32).reshape((rows, dv))
    s_all = scratch(rows * bk, np.float32)
    va, vb, lanes = zeros(nr, np.int64), scratch(nr, np.int64), scratch(lanes_n, np.float32)
    kend = key_end(i0, nr, sk, off, causal)
    if kend == 0:  # no key for any row: the NumPy kernel's rule (output 0, lse -inf) takes the call
        return 1
    for j0 in range(0, kend, bk):
        j1 = min(j0 + bk, kend)
        kb, vblk = k[h, j0:j1], v[h, j0:j1]
        if visible(vb, nr, i0, j0, j1 - j0, off, causal) and not finite(vblk):
            return 1
        s = s_all[:rows * (j1 - j0)].reshape((rows, j1 - j0))
        np.dot(qs, kb.T, s)
        if softmax(s, scale, va, vb, nr, m, m_new, psum, lanes):
            return 1
        np.dot(s, vblk, pv)
        if j0 == 0:
            den[:] = psum
            acc[:] = pv
        else:
            for r in range(rows):
                ref = m_new[r] if m_new[r] > -np.inf else np.float32(0)
                alpha = np.exp(m[r] - ref)
                den[r] = den[r] * alpha + psum[r]
                for c in range(dv):
                    acc[r, c] = acc[r, c] * alpha + pv[r, c]
        m[:] = m_new
    for r in range(rows):
        if den[r] == 0:  # no key seen, or only -inf scores: the NumPy kernel's rule (output 0) takes the call
            return 1
    for r in range(rows):
        hr, i = h * g + r // nr, i0 + r % nr
        o = out[hr, i]
        for c in range(dv):
            o[c] = acc[r, c] / den[r]
        lse[hr, i] = (m[r] if m[r] > -np.inf else np.float32(0)) + np.log(den[r])
    return 0


@jit
def backward_task(h, q, k, v, out, lse, grad, dq, dk, dv, g, bq, bk, causal, scale):
    hq, sq, d = q.shape
    sk, dvn = k.shape[1], v.shape[2]
    off = sk - sq
    kh, v64 = k[h], v[h].astype(np.float64)
    if not finite(kh):
        return 1
    dk_acc, dv_acc = zeros(sk * d, np.float32).reshape((sk, d)), zeros(sk * dvn, np.float32).reshape((sk, dvn))
    rmax = g * bq
    qs_all, dos_all = scratch(rmax * d, np.float32), scratch(rmax * dvn, np.float32)
    lb_all, d_all = scratch(rmax, np.float32), scratch(rmax, np.float64)
    dq_all, dqt_all = scratch(rmax * d, np.float32), scratch(rmax * d, np.float32)
    p_all, ds_all = scratch(rmax * bk, np.float32), scratch(rmax * bk, np.float32)
    dp_all = scratch(rmax * bk, np.float64)
    kd, kdv = scratch(bk * d, np.float32), scratch(bk * dvn, np.float32)
    va, vb = zeros(bq, np.int64), scratch(bq, np.int64)
    for i0 in range(0, sq, bq):
        nr = min(bq, sq - i0)
        rows = g * nr
        qs, dos = qs_all[:rows * d].reshape((rows, d)), dos_all[:rows * dvn].reshape((rows, dvn))
        lb, big_d = lb_all[:rows], d_all[:rows]
        dq_blk, dq_part = dq_all[:rows * d].reshape((rows, d)), dqt_all[:rows * d].reshape((rows, d))
        for r in range(rows):
            hr, i = h * g + r // nr, i0 + r % nr
            qs[r], dos[r], lb[r] = q[hr, i], grad[hr, i], lse[hr, i]
            if lb[r] == -np.inf:  # a row that saw no key: the NumPy kernel's rule takes the call
                return 1
            t = 0.0
            for c in range(dvn):
                t += np.float64(grad[hr, i, c]) * np.float64(out[hr, i, c])
            big_d[r] = t
        if not (finite(qs) and finite(dos)):
            return 1
        do64 = dos.astype(np.float64)
        dq_blk[:] = 0
        kend = key_end(i0, nr, sk, off, causal)
        for j0 in range(0, kend, bk):
            j1 = min(j0 + bk, kend)
            w = j1 - j0
            kb = kh[j0:j1]
            visible(vb, nr, i0, j0, w, off, causal)
            p, ds = p_all[:rows * w].reshape((rows, w)), ds_all[:rows * w].reshape((rows, w))
            dp = dp_all[:rows * w].reshape((rows, w))
            np.dot(qs, kb.T, p)
            np.dot(do64, v64[j0:j1].T, dp)
            if grad_scores(p, scale, va[:nr], vb[:nr], nr, lb, dp, big_d, ds):
                return 1
            dvb, dkb = kdv[:w * dvn].reshape((w, dvn)), kd[:w * d].reshape((w, d))
            np.dot(p.T, dos, dvb)
            add_to(dv_acc[j0:j1], dvb)
            np.dot(ds.T, qs, dkb)
            add_to(dk_acc[j0:j1], dkb)
            np.dot(ds, kb, dq_part)
            add_to(dq_blk, dq_part)
        for r in range(rows):
            scaled_to(dq[h * g + r // nr, i0 + r % nr], dq_blk[r], scale)
    for j in range(sk):
        scaled_to(dk[h, j], dk_acc[j], scale)
    dv[h] = dv_acc
    return 0


@jit
def forward_all(n, q, k, v, out, lse, g, bq, bk, causal, scale):
    for t in range(n):
        if forward_task(t, q, k, v, out, lse, g, bq, bk, causal, scale):
            return 1
    return 0


@jit
def backward_all(n, q, k, v, out, lse, grad, dq, dk, dv, g, bq, bk, causal, scale):
    for t in range(n):
        if backward_task(t, q, k, v, out, lse, grad, dq, dk, dv, g, bq, bk, causal, scale):
            return 1
    return 0


# ints: the addresses of q, k, v, out, lse, grad, dq, dk, dv (0 where unused), then Hkv (all batch entries'), g, Sq,
# Sk, D, Dv, bq, bk, causal (_attn_tasks._run); floats: [scale]
NINT = 18
sig = types.int64(types.int64, types.CPointer(types.int64), types.CPointer(types.float64))


@jit
def f32s(iv, i, shape):
    return carray(at(iv[i], np.float32), shape)


@jit
def inputs(iv):
    """q, k, v, out, lse over the addresses in ints."""
    hkv, g, sq, sk, d, dv = iv[9], iv[10], iv[11], iv[12], iv[13], iv[14]
    return (f32s(iv, 0, (hkv * g, sq, d)), f32s(iv, 1, (hkv, sk, d)), f32s(iv, 2, (hkv, sk, dv)),
            f32s(iv, 3, (hkv * g, sq, dv)), f32s(iv, 4, (hkv * g, sq)))


@cfunc(sig, cache=True, nogil=True)
def forward_entry(t, ints, floats):
    iv = carray(ints, NINT)
    q, k, v, out, lse = inputs(iv)
    return forward_task(t, q, k, v, out, lse, iv[10], iv[15], iv[16], iv[17] != 0, np.float32(carray(floats, 1)[0]))


@cfunc(sig, cache=True, nogil=True)
def backward_entry(t, ints, floats):
    iv = carray(ints, NINT)
    hkv, g, sq, sk, d, dv = iv[9], iv[10], iv[11], iv[12], iv[13], iv[14]
    q, k, v, out, lse = inputs(iv)
    grad, dq = f32s(iv, 5, (hkv * g, sq, dv)), f32s(iv, 6, (hkv * g, sq, d))
    dk, dvv = f32s(iv, 7, (hkv, sk, d)), f32s(iv, 8, (hkv, sk, dv))
    return backward_task(t, q, k, v, out, lse, grad, dq, dk, dvv, g, iv[15], iv[16], iv[17] != 0,
                         np.float32(carray(floats, 1)[0]))


ENTRIES = {"forward_all": forward_all, "backward_all": backward_all,
           "forward_entry": forward_entry.address, "backward_entry": backward_entry.address}
