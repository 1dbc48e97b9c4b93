"""NumPy twins of the CUDA kernels: same arguments, same buffers, same rounding points.

Each function takes the HostBackend and then exactly the arguments of the kernel of the
same name in `kernels_cu/`. Arithmetic is fp32 and every bf16 store rounds to nearest
even, as `__float2bfloat16_rn` does, so host and CUDA agree to fp32 summation-order noise.
"""

from __future__ import annotations

import numpy as np

from .config import CHUNK, L2_NORM_EPS, SEG_FIELDS
from .dtypes import BF16, F32

f32 = np.float32  # fp32 scalars, so NumPy keeps fp32 arithmetic


def _segments(gpu, segs, nseg, t) -> list[tuple[int, ...]]:
    """The segment table's rows (segments.cuh), or a plain prefill's one segment of t tokens."""
    if not segs:
        return [(0, -(-int(t) // CHUNK), 0, int(t), 0, 1, 0, 0)]
    return [tuple(int(x) for x in r) for r in gpu.view(segs, (int(nseg), SEG_FIELDS), np.int32)]


def _checkpoints(gpu, segs, sg) -> list[tuple[int, int]]:
    """(tokens, slot) of a segment's checkpoints: after each `every` whole chunks of its rows."""
    every, ckpt, rows = sg[6], sg[7], sg[3]
    n = rows // (every * CHUNK) if every else 0
    slots = gpu.view(segs + 4 * ckpt, n, np.int32) if n else ()
    return [((j + 1) * every * CHUNK, int(x)) for j, x in enumerate(slots)]



def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (f32(1) / (f32(1) + np.exp(-x))).astype(F32)


def _silu(x: np.ndarray) -> np.ndarray:
    return (x * _sigmoid(x)).astype(F32)


def _rsqrt_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis, fp32."""
    ss = (x * x).sum(-1, keepdims=True, dtype=F32)
    return (x * (f32(1) / np.sqrt(ss + f32(eps)))).astype(F32)


# -- gemv ------------------------------------------------------------------------------------
def dense_gemv_bf16(gpu, w, x, y, n, k, m, ldx, ldy, ks=1):
    # ks: how the CUDA blocks share K among warps; one host pass needs none
    W = gpu.view(w, (n, k), BF16).astype(F32)
    X, Y = gpu.rows(x, m, ldx, k, BF16), gpu.rows(y, m, ldy, n, BF16)
    for r in range(int(m)):
        xr = np.array(X[r], dtype=F32)  # a fresh contiguous row: the same bits for any m
        Y[r] = (W @ xr).astype(BF16)


def dense_gemv_wg(gpu, wmap, xmap, y, n, k, m, ldy, ks, part, count):
    # the tensor maps describe the matrices the CUDA copies read (backend.TensorMap); part and
    # count carry the CUDA blocks' split of K, which one host pass needs not
    dense_gemv_bf16(gpu, wmap.ptr, xmap.ptr, y, n, k, m, xmap.ld, ldy)


def front_end_wg(gpu, wmap, xmap, fbmap, gbmap, famap, gamap, gate_in, qkv_parts, qkv_proj,
                 a_log, dt_bias, g_raw, out_gate, gate, beta, sync, N, K, M, P, ldg, H, D, R,
                 lower_bound, bounded, ks, ks_early, ks_gate, early_blocks, proj_blocks):
    # the tensor maps describe the matrices the CUDA copies read (backend.TensorMap)
    front_end_gemv(gpu, wmap.ptr, xmap.ptr, gate_in, qkv_parts, qkv_proj, fbmap.ptr, gbmap.ptr,
                   a_log, dt_bias, g_raw, out_gate, gate, beta, sync, N, K, M, P, ldg, H, D, R,
                   lower_bound, bounded, ks, ks_early, ks_gate, early_blocks, proj_blocks)


def front_end_gemv(gpu, w, x, gate_in, qkv_parts, qkv_proj, f_b, g_b, a_log, dt_bias, g_raw,
                   out_gate, gate, beta, sync, N, K, M, P, ldg, H, D, R, lower_bound, bounded, ks,
                   ks_early, ks_gate, early_blocks, proj_blocks):
    # sync and the shares and block counts: how the CUDA blocks share the work; one host pass
    # needs none. qkv_parts holds rows 0..M-1 of each of its three [P, qkv] parts.
    qkv = H * D
    dense_gemv_bf16(gpu, w, x, qkv_proj, 3 * qkv, K, M, K, 3 * qkv)
    _split_qkv(gpu, qkv_proj, qkv_parts, M, qkv, P)
    f_a = gate_in  # then g_a, then b
    dense_gemv_bf16(gpu, w + 3 * qkv * K * 2, x, f_a, N - 3 * qkv, K, M, K, ldg)
    dense_gemv_bf16(gpu, f_b, f_a, g_raw, qkv, R, M, ldg, qkv)
    dense_gemv_bf16(gpu, g_b, f_a + R * 2, out_gate, qkv, R, M, ldg, qkv)
    g = _gate_rows(gpu, g_raw, f_a + 2 * R * 2, ldg, a_log, dt_bias, M, H, D, lower_bound,
                   bounded)
    gpu.view(gate, (M, H, D), F32)[...], gpu.view(beta, (M, H), F32)[...] = g


# -- qkv_parts (prefill_stage_copies and front_end_gemv pieces) -------------------------------
def _split_qkv(gpu, qkv_proj, qkv_parts, t, qkv, parts_rows=None):
    """qkv_proj [t, 3 qkv] into rows 0..t-1 of each [parts_rows (t), qkv] part of qkv_parts."""
    parts = gpu.view(qkv_parts, (3, parts_rows or t, qkv), BF16)
    parts[:, :t] = gpu.view(qkv_proj, (t, 3, qkv), BF16).transpose(1, 0, 2)


def prefill_stage_copies(gpu, qkv_proj, conv_out, qkv_parts, q, k, v, segs, nseg, T, t_pad, qkv,
                         pad_fill):
    """qkv_proj by part into qkv_parts; conv_out's packed rows widened into each segment's
    padded rows, pad_fill past them."""
    _split_qkv(gpu, qkv_proj, qkv_parts, T, qkv)
    segments = _segments(gpu, segs, nseg, T)
    X = gpu.view(conv_out, (T, 3 * qkv), BF16).astype(F32)
    for i, p in enumerate((q, k, v)):
        dst = gpu.view(p, (t_pad, qkv), F32)
        for chunk0, chunks, row0, rows, *_ in segments:
            d = dst[chunk0 * CHUNK:(chunk0 + chunks) * CHUNK]
            d[:rows] = X[row0:row0 + rows, i * qkv:(i + 1) * qkv]
            d[rows:] = pad_fill


# -- gate ------------------------------------------------------------------------------------
def kda_gate_beta(gpu, g_raw, b_raw, ldb, a_log, dt_bias, gate, beta, segs, nseg, t, t_pad, H,
                  D, lower_bound, bounded, pad_fill):
    g, b = _gate_rows(gpu, g_raw, b_raw, ldb, a_log, dt_bias, t, H, D, lower_bound, bounded)
    G, B = gpu.view(gate, (t_pad, H, D), F32), gpu.view(beta, (t_pad, H), F32)
    G[...], B[...] = pad_fill, pad_fill  # padded rows: past each segment's tokens
    for chunk0, _, row0, rows, *_ in _segments(gpu, segs, nseg, t):
        p0 = chunk0 * CHUNK
        G[p0:p0 + rows], B[p0:p0 + rows] = g[row0:row0 + rows], b[row0:row0 + rows]


def _gate_rows(gpu, g_raw, b_raw, ldb, a_log, dt_bias, t, H, D, lower_bound, bounded):
    """The forget gate [t, H, D] and beta [t, H] of t packed rows, fp32."""
    x = gpu.view(g_raw, (t, H * D), BF16).astype(F32) + gpu.view(dt_bias, H * D, F32)
    x = x.reshape(t, H, D)
    a = np.exp(gpu.view(a_log, H, F32))[None, :, None]
    if bounded:
        g = f32(lower_bound) * _sigmoid((a * x).astype(F32))
    else:
        with np.errstate(over="ignore"):
            sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(F32)
        g = -a * sp
    return g, _sigmoid(gpu.rows(b_raw, t, ldb, H, BF16).astype(F32))


# -- conv ------------------------------------------------------------------------------------
def _conv_taps(w: np.ndarray, xs: np.ndarray, t: int) -> np.ndarray:
    """sum_j w[j] * xs[j + s] for s < t, taps in order (the last multiplies the current row)."""
    acc = np.zeros((t, w.shape[1]), F32)
    for j in range(w.shape[0]):
        acc = (acc + w[j] * xs[j:j + t]).astype(F32)
    return acc


def _conv_decode(gpu, x_row, conv_state, conv_w, out_row, conv_dim, qkv, W, D):
    S = gpu.view(conv_state, (W - 1, conv_dim), BF16)
    x = gpu.view(x_row, conv_dim, BF16)
    xs = np.concatenate([S, x[None]]).astype(F32)
    # the SiLU rounded to bf16 before q's and k's L2 norm, as prefill's conv_out holds it
    y = _silu(_conv_taps(gpu.view(conv_w, (W, conv_dim), F32), xs, 1)[0]).astype(BF16)
    y = y.astype(F32)
    y[:2 * qkv] = _rsqrt_norm(y[:2 * qkv].reshape(-1, D), L2_NORM_EPS).reshape(-1)
    gpu.view(out_row, conv_dim, BF16)[...] = y.astype(BF16)
    S[...] = np.concatenate([S[1:], x[None]])


def _conv_state(gpu, conv_state, sg, conv_dim, W) -> np.ndarray:
    """A segment's conv state [W-1, conv_dim] bf16, a view of its slot (zeros without initial
    state, a copy)."""
    S = gpu.view(conv_state + sg[4] * (W - 1) * conv_dim * 2, (W - 1, conv_dim), BF16)
    return S if sg[5] else np.zeros_like(S)


def prefill_conv_qkv(gpu, qkv_proj, conv_state, conv_w, conv_out, segs, nseg, T, T_pad, H, D, W):
    cd = 3 * H * D
    segments = _segments(gpu, segs, nseg, T)
    X, w = gpu.view(qkv_proj, (T, cd), BF16), gpu.view(conv_w, (W, cd), F32)
    for sg in segments:
        row0, rows = sg[2], sg[3]
        xs = np.concatenate([_conv_state(gpu, conv_state, sg, cd, W), X[row0:row0 + rows]])
        y = _silu(_conv_taps(w, xs.astype(F32), rows))
        gpu.view(conv_out, (T, cd), BF16)[row0:row0 + rows] = y.astype(BF16)
    _l2_norm_bf16(gpu, conv_out, T, cd, 2 * H, D)


def conv_roll_state(gpu, x, conv_state, segs, nseg, T, conv_dim, W):
    X = gpu.view(x, (T, conv_dim), BF16)
    for sg in _segments(gpu, segs, nseg, T):
        row0, rows = sg[2], sg[3]
        for end, slot in _checkpoints(gpu, segs, sg):
            if slot >= 0:
                gpu.view(conv_state + slot * (W - 1) * conv_dim * 2, (W - 1, conv_dim),
                         BF16)[...] = X[row0 + end - (W - 1):row0 + end]
        S = _conv_state(gpu, conv_state, sg, conv_dim, W)
        new = np.concatenate([S, X[row0:row0 + rows]])[-(W - 1):]
        gpu.view(conv_state + sg[4] * (W - 1) * conv_dim * 2, (W - 1, conv_dim), BF16)[...] = new


def _l2_norm_bf16(gpu, x, t, ld, nvec, D):
    X = gpu.rows(x, t, ld, nvec * D, BF16)
    X[...] = _rsqrt_norm(X.astype(F32).reshape(t, nvec, D), L2_NORM_EPS).reshape(t, nvec * D).astype(BF16)


# -- decode rows (conv + recurrent step + gated norm, token by token) -------------------------
def _state_bytes(H, D, W):
    """One sequence's recurrent [H, D, D] fp32 and conv [W-1, 3 H D] bf16 state, in bytes."""
    return H * D * D * F32.itemsize, (W - 1) * 3 * H * D * BF16.itemsize


def _kda_decode_rows(D):
    def run(gpu, x, conv_state, conv_w, conv_out, gate, beta, state, core, out_gate, o_norm_w,
            o_norm_out, snap_rec, snap_conv, sync, nrows, nsnap, H, W, scale, eps):
        # sync: the CUDA blocks' per-head counter; one host pass needs none
        rec, cst = _state_bytes(H, D, W)
        _decode_sequence(gpu, D, x, conv_state, conv_w, conv_out, gate, beta, state, core,
                         out_gate, o_norm_w, o_norm_out,
                         [(snap_rec + i * rec, snap_conv + i * cst) for i in range(nsnap)], 0,
                         nrows, H, W, scale, eps)
    return run


def _checked_slot(gpu, s, nslots, fault, table, entry) -> int:
    """recurrent.cu's checked_slot: s where it is -1 or in [0, nslots), else -1, the first such
    entry recorded in fault {seen, table, entry, value}."""
    s = int(s)
    if -1 <= s < nslots:
        return s
    words = gpu.view(fault, 4, np.int32)
    if not words[0]:
        words[:] = (1, table, entry, s)
    return -1


def _kda_decode_batch(D):
    def run(gpu, x, conv_pool, conv_w, conv_out, gate, beta, rec_pool, core, out_gate, o_norm_w,
            o_norm_out, slots, snap_slots, nslots, fault, sync, nseq, nrows, nsnap, H, W, scale,
            eps):
        rec, cst = _state_bytes(H, D, W)
        table = gpu.view(slots, nseq, np.int32)
        snaps = gpu.view(snap_slots, (nseq, nrows - 1), np.int32) if nsnap else None
        for b in range(nseq):
            slot = _checked_slot(gpu, table[b], nslots, fault, 0, b)
            if slot < 0:  # a padding row
                continue
            snap = [_checked_slot(gpu, i, nslots, fault, 1, b * (nrows - 1) + r)
                    for r, i in enumerate(snaps[b] if nsnap else ())]
            to = [(rec_pool + i * rec, conv_pool + i * cst) if i >= 0 else None for i in snap]
            _decode_sequence(gpu, D, x, conv_pool + slot * cst, conv_w, conv_out, gate, beta,
                             rec_pool + slot * rec, core, out_gate, o_norm_w, o_norm_out, to,
                             b * nrows, nrows, H, W, scale, eps)
    return run


def _kda_decode_rows_slot(D):
    def run(gpu, x, conv_pool, conv_w, conv_out, gate, beta, rec_pool, core, out_gate, o_norm_w,
            o_norm_out, slots, nslots, fault, sync, H, W, scale, eps):
        slot = _checked_slot(gpu, gpu.view(slots, 1, np.int32)[0], nslots, fault, 0, 0)
        if slot >= 0:
            rec, cst = _state_bytes(H, D, W)
            _decode_sequence(gpu, D, x, conv_pool + slot * cst, conv_w, conv_out, gate, beta,
                             rec_pool + slot * rec, core, out_gate, o_norm_w, o_norm_out, [], 0,
                             1, H, W, scale, eps)
    return run


def _decode_sequence(gpu, D, x, conv_state, conv_w, conv_out, gate, beta, state, core, out_gate,
                     o_norm_w, o_norm_out, snaps, row0, nrows, H, W, scale, eps):
    """Rows row0.. of one sequence in order; the states after row r go to snaps[r] (a pair of
    addresses, or None: skipped)."""
    qkv = H * D
    for r in range(row0, row0 + nrows):
        xr, cr = x + r * 3 * qkv * 2, conv_out + r * 3 * qkv * 2
        _conv_decode(gpu, xr, conv_state, conv_w, cr, 3 * qkv, qkv, W, D)
        row = gpu.view(cr, 3 * qkv, BF16).astype(F32)
        q, k, v = (row[i * qkv:(i + 1) * qkv].reshape(H, D) for i in range(3))
        S = gpu.view(state, (H, D, D), F32)  # [h, v, k]
        S *= np.exp(gpu.view(gate + r * qkv * 4, (H, D), F32))[:, None, :]
        resid = v - np.einsum("hvk,hk->hv", S, k)
        S += gpu.view(beta + r * H * 4, H, F32)[:, None, None] * resid[:, :, None] * k[:, None, :]
        core_r = core + r * qkv * 4
        gpu.view(core_r, (H, D), F32)[...] = np.einsum("hvk,hk->hv", S, q * f32(scale))
        gated_rmsnorm(gpu, core_r, out_gate + r * qkv * 2, o_norm_w, o_norm_out + r * qkv * 2,
                      1, H, D, eps)
        if r - row0 < len(snaps) and snaps[r - row0] is not None:
            rec_at, conv_at = snaps[r - row0]
            gpu.view(rec_at, (H, D, D), F32)[...] = S
            gpu.view(conv_at, (W - 1, 3 * qkv), BF16)[...] = \
                gpu.view(conv_state, (W - 1, 3 * qkv), BF16)


# -- chunk (WY) ------------------------------------------------------------------------------
# The two chunk kernels hand each other their operands through the workspace's chunk_* buffers,
# whose CUDA layouts are private to chunk.cu (its walk's shared-memory images). The twins keep
# the same quantities there as plain fp32 blocks [chunk, head, rows, cols]: the host mirrors
# the chunked algebra, not the device's operand images, which the GPU tests pin.
def _token_rows(x, row0, n, H, D):
    """A chunk's q, k, v [H, C, D] fp32 from conv_out x [T, 3, H, D] bf16: packed rows row0..
    row0 + n - 1, zeros past them (rows past a segment are never read)."""
    out = np.zeros((3, H, CHUNK, D), F32)
    out[:, :, :n] = x[row0:row0 + n].astype(F32).transpose(1, 2, 0, 3)
    return out


def _chunk_blocks(gpu, ptr, t_pad, H, *shape):
    """A chunk_* buffer as fp32 blocks [t_pad / C, H, *shape]."""
    return gpu.view(ptr, (t_pad // CHUNK, H, *shape), F32)


def _intra_chunks(gpu, D, conv_out, g_raw, b_raw, ldb, a_log, dt_bias, lower_bound, bounded,
                  qg, kd, gl, w, u, aqk, segs, nseg, t, t_pad, H, scale, c_lo, c_hi):
    """kda_chunk_intra's chunks c_lo <= ci < c_hi."""
    causal = np.tril(np.ones((CHUNK, CHUNK), bool))
    x = gpu.view(conv_out, (t, 3, H, D), BF16)
    g_all, b_all = _gate_rows(gpu, g_raw, b_raw, ldb, a_log, dt_bias, t, H, D, lower_bound,
                              bounded)  # [t, H, D], [t, H]: kda_gate_beta's values
    for ci, sg, lt0 in ((sg[0] + i, sg, i * CHUNK) for sg in _segments(gpu, segs, nseg, t)
                        for i in range(sg[1]) if c_lo <= sg[0] + i < c_hi):
        n = min(CHUNK, sg[3] - lt0)  # the chunk's rows that are tokens
        qc, kc, vc = _token_rows(x, sg[2] + lt0, n, H, D)
        rows = slice(sg[2] + lt0, sg[2] + lt0 + n)
        gc, bc = np.zeros((H, CHUNK, D), F32), np.zeros((H, CHUNK), F32)
        gc[:, :n], bc[:, :n] = g_all[rows].transpose(1, 0, 2), b_all[rows].T
        qc = qc * f32(scale)
        G = np.cumsum(gc, axis=1, dtype=F32)  # [H, C, D]
        g_last = G[:, -1:, :]
        _chunk_blocks(gpu, gl, t_pad, H, D)[ci] = np.exp(g_last[:, 0])
        _chunk_blocks(gpu, qg, t_pad, H, CHUNK, D)[ci] = qc * np.exp(G)
        _chunk_blocks(gpu, kd, t_pad, H, CHUNK, D)[ci] = kc * np.exp(g_last - G)
        diff = G[:, :, None, :] - G[:, None, :, :]  # G_t - G_s
        decay = np.exp(np.where(causal[None, :, :, None], diff, -np.inf)).astype(F32)
        A = np.einsum("htd,hsd,htsd->hts", kc, kc, decay).astype(F32)
        A *= np.tril(np.ones((CHUNK, CHUNK), F32), -1)
        _chunk_blocks(gpu, aqk, t_pad, H, CHUNK, CHUNK)[ci] = np.einsum(
            "htd,hsd,htsd->hts", qc, kc, decay)
        rhs = bc[:, :, None] * np.concatenate([vc, kc * np.exp(G)], axis=2)  # [H, C, 2D]
        X = np.empty_like(rhs)
        for i in range(CHUNK):  # forward substitution through I + diag(b) A
            X[:, i] = rhs[:, i] - bc[:, i, None] * np.einsum("hs,hsd->hd", A[:, i, :i],
                                                             X[:, :i])
        _chunk_blocks(gpu, u, t_pad, H, CHUNK, D)[ci] = X[:, :, :D]
        _chunk_blocks(gpu, w, t_pad, H, CHUNK, D)[ci] = X[:, :, D:]


def _kda_chunk_intra(D):
    def run(gpu, conv_out, g_raw, b_raw, ldb, a_log, dt_bias, lower_bound, bounded, qg, kd, gl,
            w, u, aqk, segs, nseg, t, t_pad, H, scale, c_end):
        _intra_chunks(gpu, D, conv_out, g_raw, b_raw, ldb, a_log, dt_bias, lower_bound, bounded,
                      qg, kd, gl, w, u, aqk, segs, nseg, t, t_pad, H, scale, 0, c_end)
    return run


def _kda_chunk_core(D):
    walk = _kda_chunk_inter(D)

    def run(gpu, conv_out, g_raw, b_raw, ldb, a_log, dt_bias, lower_bound, bounded, qg, kd, gl,
            w, u, aqk, state, core, ready, c_first, segs, nseg, t, t_pad, H, scale):
        _intra_chunks(gpu, D, conv_out, g_raw, b_raw, ldb, a_log, dt_bias, lower_bound, bounded,
                      qg, kd, gl, w, u, aqk, segs, nseg, t, t_pad, H, scale, c_first,
                      t_pad // CHUNK)
        walk(gpu, qg, kd, gl, w, u, aqk, state, core, segs, nseg, t, H)
    return run


def _kda_chunk_inter(D):
    def run(gpu, qg, kd, gl, w, u, aqk, state, core, segs, nseg, t, H):
        segments = _segments(gpu, segs, nseg, t)
        t_pad = (segments[-1][0] + segments[-1][1]) * CHUNK
        out = gpu.view(core, (t, H, D), F32)
        slot_bytes = H * D * D * 4
        for sg in segments:
            chunk0, chunks, row0, rows, slot, init = sg[:6]
            ckpts = dict(_checkpoints(gpu, segs, sg))
            S = gpu.view(state + slot * slot_bytes, (H, D, D), F32)  # [h, v, k]
            St = S.transpose(0, 2, 1).copy() if init else np.zeros((H, D, D), F32)  # [h, k, v]
            for i in range(chunks):
                ci = chunk0 + i
                Qg, Wk, Kd, U = (_chunk_blocks(gpu, p, t_pad, H, CHUNK, D)[ci]
                                 for p in (qg, w, kd, u))
                Wm = U - Wk @ St  # [H, C, Dv]
                o = Qg @ St + _chunk_blocks(gpu, aqk, t_pad, H, CHUNK, CHUNK)[ci] @ Wm
                n = min(CHUNK, rows - i * CHUNK)  # the chunk's rows of the segment's tokens
                out[row0 + i * CHUNK:row0 + i * CHUNK + n] = o.transpose(1, 0, 2)[:n]
                g_last = _chunk_blocks(gpu, gl, t_pad, H, D)[ci]
                St = (g_last[:, :, None] * St + Kd.transpose(0, 2, 1) @ Wm).astype(F32)
                slot_ck = ckpts.get((i + 1) * CHUNK, -1)
                if slot_ck >= 0:
                    gpu.view(state + slot_ck * slot_bytes, (H, D, D), F32)[...] = \
                        St.transpose(0, 2, 1)
            S[...] = St.transpose(0, 2, 1)
    return run


# -- norm ------------------------------------------------------------------------------------
def gated_rmsnorm(gpu, core, out_gate, w, out, t, H, D, eps):
    c = gpu.view(core, (t, H, D), F32)
    ms = (c * c).mean(-1, keepdims=True, dtype=F32)
    n = (c * (f32(1) / np.sqrt(ms + f32(eps))) * gpu.view(w, D, F32)).astype(F32)
    g = _sigmoid(gpu.view(out_gate, (t, H * D), BF16).astype(F32))
    gpu.view(out, (t, H * D), BF16)[...] = (n.reshape(t, H * D) * g).astype(BF16)


# -- reduce ----------------------------------------------------------------------------------
def tp_accumulate(gpu, x, acc, n, first):
    a = gpu.view(acc, int(n), F32)
    xs = gpu.view(x, int(n), BF16).astype(F32)
    a[...] = xs if first else a + xs


def tp_round(gpu, acc, y, n):
    gpu.view(y, int(n), BF16)[...] = gpu.view(acc, int(n), F32).astype(BF16)


HOST_KERNELS: dict[str, dict] = {
    "gemv": {"dense_gemv_bf16": dense_gemv_bf16, "front_end_gemv": front_end_gemv,
             "dense_gemv_bf16_batch": dense_gemv_bf16, "front_end_gemv_batch": front_end_gemv,
             "dense_gemv_bf16_x2": dense_gemv_bf16, "front_end_gemv_x2": front_end_gemv},
    "gemv_wg": {"dense_gemv_wg": dense_gemv_wg, "front_end_wg": front_end_wg},
    "gate": {"kda_gate_beta": kda_gate_beta},
    "conv": {"prefill_conv_qkv": prefill_conv_qkv, "prefill_conv_qkv_w4": prefill_conv_qkv,
             "prefill_stage_copies": prefill_stage_copies,
             "conv_roll_state": conv_roll_state},
    "recurrent": {**{f"kda_decode_rows_d{d}": _kda_decode_rows(d) for d in (64, 128)},
                  **{f"kda_decode_batch_d{d}": _kda_decode_batch(d) for d in (64, 128)},
                  **{f"kda_decode_rows_slot_d{d}": _kda_decode_rows_slot(d) for d in (64, 128)}},
    "chunk": {**{f"kda_chunk_intra_d{d}": _kda_chunk_intra(d) for d in (64, 128)},
              **{f"kda_chunk_inter_d{d}": _kda_chunk_inter(d) for d in (64, 128)},
              **{f"kda_chunk_core_d{d}": _kda_chunk_core(d) for d in (64, 128)}},
    "chunk_portable": {f"kda_chunk_inter_portable{rows}_d{d}": _kda_chunk_inter(d)
                       for d in (64, 128) for rows in ("", "_r32")},
    "norm": {"gated_rmsnorm": gated_rmsnorm},
    "reduce": {"tp_accumulate": tp_accumulate, "tp_round": tp_round},
}
