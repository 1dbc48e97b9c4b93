"""The float64 oracle: one KDA block written straight from the math in docs/design.md.

Independent of the kernels: no packing, a per-token recurrence for the core
(`core_recurrent`), plus a chunked WY form (`core_chunked`) that must agree with it. By
default it rounds nothing (`EXACT`); `KDARUN` rounds to bf16 where kdarun's buffers are bf16
and nowhere else (`Rounding`). Each stage is a function of its inputs, so tests can feed a
stage the previous stage's actual output. Shapes use `T` tokens, `H` heads, `D` head dim; the
recurrent state is stored `[H, D_v, D_k]` like the runtime's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import CHUNK, L2_NORM_EPS, Glm5NextKdaConfig
from .dtypes import BF16

F64 = np.float64


@dataclass(frozen=True)
class Rounding:
    """Where the reference rounds a value to bf16 (to nearest even) and goes on in float64.

    `buffers`: every value kdarun holds in a bf16 buffer before the next step reads it: the
    projections (q|k|v, gate_in's f_a, g_a and b, g_raw, out_gate), the conv's SiLU output,
    o_norm_out and final_out (of one rank: a tensor parallel group also rounds each rank's
    partial final_out, which this does not model). `qk`: q and k after their L2 norm, which
    kdarun's conv_out holds in bf16 too. `beta`: beta, which kdarun keeps in fp32
    (transformers rounds it).
    """
    buffers: bool = False
    qk: bool = False
    beta: bool = False

    def round(self, x: np.ndarray, at: bool) -> np.ndarray:
        return np.asarray(x).astype(BF16).astype(F64) if at else x


EXACT = Rounding()  # the math itself
# kdarun's rounding points: what is left between a run and this reference is the kernels'
# arithmetic in fp32 (and the bf16 roundings it lands on the other side of), not the bf16
# inputs a step is handed. A few tokens whose heads' q . k nearly cancel magnify those inputs'
# roundings past any fixed tolerance against EXACT; against KDARUN they do not.
KDARUN = Rounding(buffers=True, qk=True)
KDARUN_LABEL = "float64, rounded to bf16 where kdarun's buffers are bf16"


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(F64)


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def projections(tensors: dict, h: np.ndarray,
                rounding: Rounding = EXACT) -> dict[str, np.ndarray]:
    """h [T, hidden] -> q, k, v [T, qkv]; g_raw, out_gate [T, qkv]; b_raw [T, H]."""
    h = _f64(h)

    def lin(name: str, x: np.ndarray) -> np.ndarray:
        return rounding.round(x @ _f64(tensors[name]).T, rounding.buffers)

    return {
        "q": lin("q_proj.weight", h), "k": lin("k_proj.weight", h), "v": lin("v_proj.weight", h),
        "g_raw": lin("f_b_proj.weight", lin("f_a_proj.weight", h)),
        "out_gate": lin("g_b_proj.weight", lin("g_a_proj.weight", h)),
        "b_raw": lin("b_proj.weight", h),
    }


def conv(cfg: Glm5NextKdaConfig, tensors: dict, qkv_proj: np.ndarray,
         conv_state: np.ndarray, rounding: Rounding = EXACT) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv + SiLU + per-head L2 of q and k.

    qkv_proj [T, conv_dim], conv_state [W-1, conv_dim] (the previous rows, oldest first)
    -> conv_out [T, conv_dim], new conv_state [W-1, conv_dim].
    """
    W, T = cfg.conv_kernel, qkv_proj.shape[0]
    w = np.concatenate([_f64(tensors[f"{p}_conv1d.weight"]).reshape(cfg.qkv, W) for p in "qkv"])
    x = np.concatenate([_f64(conv_state), _f64(qkv_proj)])  # [W-1+T, conv_dim]
    y = np.zeros((T, cfg.conv_dim))
    for j in range(W):  # tap j multiplies x_{t-W+1+j}; the last tap is the current token
        y += w[:, j] * x[j:j + T]
    y = rounding.round(silu(y), rounding.buffers)
    qk = y[:, :2 * cfg.qkv].reshape(T, 2 * cfg.num_heads, cfg.head_dim)
    qk = qk / np.sqrt((qk * qk).sum(-1, keepdims=True) + L2_NORM_EPS)
    y[:, :2 * cfg.qkv] = rounding.round(qk.reshape(T, 2 * cfg.qkv), rounding.qk)
    return y, x[T:]


def gate(cfg: Glm5NextKdaConfig, tensors: dict, g_raw: np.ndarray) -> np.ndarray:
    """g_raw [T, qkv] -> log-decay [T, H, D], always <= 0."""
    T, H, D = g_raw.shape[0], cfg.num_heads, cfg.head_dim
    x = (_f64(g_raw) + _f64(tensors["dt_bias"])).reshape(T, H, D)
    a = np.exp(_f64(tensors["A_log"]).reshape(H))[None, :, None]
    if cfg.gate_lower_bound is None:
        return -a * softplus(x)
    return cfg.gate_lower_bound * sigmoid(a * x)


def beta(b_raw: np.ndarray) -> np.ndarray:
    return sigmoid(_f64(b_raw))


def core_recurrent(cfg: Glm5NextKdaConfig, q, k, v, g, b, state):
    """Per-token delta rule. q, k, v [T, H, D]; g [T, H, D]; b [T, H]; state [H, Dv, Dk]
    -> core [T, H, D], state [H, Dv, Dk]."""
    q, k, v, g, b = (_f64(a) for a in (q, k, v, g, b))
    S = _f64(state).transpose(0, 2, 1).copy()  # [H, Dk, Dv]
    out = np.zeros_like(v)
    for t in range(q.shape[0]):
        S *= np.exp(g[t])[:, :, None]
        resid = v[t] - np.einsum("hk,hkv->hv", k[t], S)
        S += b[t][:, None, None] * k[t][:, :, None] * resid[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t] * cfg.scale, S)
    return out, S.transpose(0, 2, 1).copy()


def core_chunked(cfg: Glm5NextKdaConfig, q, k, v, g, b, state, chunk: int = CHUNK):
    """The same function as `core_recurrent`, computed chunk by chunk in WY form:
    within a chunk, W = (I + diag(b) A)^-1 diag(b) (V - (K*Gamma) S0) with
    A[t,s] = sum_d k_t k_s exp(G_t - G_s) (s < t), then O = (Q*Gamma) S0 + M W and
    S = diag(Gamma_C) S0 + (K * exp(G_C - G))^T W."""
    q, k, v, g, b = (_f64(a) for a in (q, k, v, g, b))
    q = q * cfg.scale
    T, H, D = q.shape
    S = _f64(state).transpose(0, 2, 1).copy()  # [H, Dk, Dv]
    out = np.zeros_like(v)
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(c0 + chunk, T))
        qc, kc, vc = (a[sl].transpose(1, 0, 2) for a in (q, k, v))  # [H, L, D]
        G = np.cumsum(g[sl], axis=0).transpose(1, 0, 2)  # [H, L, D]
        bc = b[sl].T  # [H, L]
        L = qc.shape[1]
        diff = G[:, :, None, :] - G[:, None, :, :]  # [H, t, s, D]: G_t - G_s
        causal = np.tril(np.ones((L, L), bool))
        decay = np.exp(np.where(causal[None, :, :, None], diff, -np.inf))
        A = np.einsum("htd,hsd,htsd->hts", kc, kc, decay) * np.tril(np.ones((L, L)), -1)
        M = np.einsum("htd,hsd,htsd->hts", qc, kc, decay)
        lhs = np.eye(L) + bc[:, :, None] * A
        rhs = bc[:, :, None] * (vc - np.einsum("hld,hdv->hlv", kc * np.exp(G), S))
        Wm = np.linalg.solve(lhs, rhs)  # [H, L, Dv]
        out[sl] = (np.einsum("hld,hdv->hlv", qc * np.exp(G), S) + M @ Wm).transpose(1, 0, 2)
        kd = kc * np.exp(G[:, -1:, :] - G)
        S = np.exp(G[:, -1, :])[:, :, None] * S + np.einsum("hld,hlv->hdv", kd, Wm)
    return out, S.transpose(0, 2, 1).copy()


def gated_rmsnorm(cfg: Glm5NextKdaConfig, tensors: dict, core: np.ndarray,
                  out_gate: np.ndarray) -> np.ndarray:
    """core [T, H, D], out_gate [T, qkv] -> o_norm_out [T, qkv]."""
    c = _f64(core)
    T = c.shape[0]
    n = c / np.sqrt((c * c).mean(-1, keepdims=True) + cfg.rms_norm_eps)
    n = n * _f64(tensors["o_norm.weight"])
    return (n.reshape(T, cfg.qkv) * sigmoid(_f64(out_gate)))


def o_proj(tensors: dict, x: np.ndarray) -> np.ndarray:
    return _f64(x) @ _f64(tensors["o_proj.weight"]).T


@dataclass
class ReferenceRun:
    """Every stage of one reference run (float64), keyed like the workspace fields,
    plus the carried states after the run."""
    stages: dict[str, np.ndarray]
    recurrent_state: np.ndarray  # [H, Dv, Dk]
    conv_state: np.ndarray  # [W-1, conv_dim]


def layer(cfg: Glm5NextKdaConfig, tensors: dict, hidden: np.ndarray,
          recurrent_state: np.ndarray, conv_state: np.ndarray,
          chunked: bool = False, rounding: Rounding = EXACT) -> ReferenceRun:
    """The whole block over hidden [T, hidden] from the given carried states, rounded to bf16
    where `rounding` says."""
    T, H, D = hidden.shape[0], cfg.num_heads, cfg.head_dim
    p = projections(tensors, hidden, rounding)
    qkv_proj = np.concatenate([p["q"], p["k"], p["v"]], axis=1)
    conv_out, new_conv = conv(cfg, tensors, qkv_proj, conv_state, rounding)
    g = gate(cfg, tensors, p["g_raw"])
    bt = rounding.round(beta(p["b_raw"]), rounding.beta)
    q, k, v = (conv_out[:, i * cfg.qkv:(i + 1) * cfg.qkv].reshape(T, H, D) for i in range(3))
    core_fn = core_chunked if chunked else core_recurrent
    core, S = core_fn(cfg, q, k, v, g, bt, recurrent_state)
    onorm = rounding.round(gated_rmsnorm(cfg, tensors, core, p["out_gate"]), rounding.buffers)
    stages = {
        "qkv_parts": np.stack([p["q"], p["k"], p["v"]]), "qkv_proj": qkv_proj,
        "conv_out": conv_out, "g_raw": p["g_raw"], "out_gate": p["out_gate"],
        "gate": g, "beta": bt, "core": core, "o_norm_out": onorm,
        "final_out": rounding.round(o_proj(tensors, onorm), rounding.buffers),
    }
    return ReferenceRun(stages, S, new_conv)
