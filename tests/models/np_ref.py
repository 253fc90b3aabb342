"""Float64 NumPy oracles for the model tests (written from the math, independent of the code).

Legend: B batch, S/T positions, D emb_dim, N heads, K kv heads (or experts per token in MoE
functions), H head_dim, E experts, F intermediate.
"""

import numpy as np


def f64(x):
    return np.asarray(x, dtype=np.float64)


def rms_norm(x, scale, eps):
    x = f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f64(scale)


def rope(x_BSNH, positions_BS, theta):
    x = f64(x_BSNH)
    h = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, h, 2, dtype=np.float64) / h)
    ang = f64(positions_BS)[..., None] * inv_freq  # [B, S, H/2]
    cos, sin = np.cos(ang)[:, :, None, :], np.sin(ang)[:, :, None, :]
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    # Rotate each (x1[i], x2[i]) pair by angle ang[i]: the rotate-half layout.
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def softmax(z, axis=-1):
    z = f64(z)
    e = np.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def attention(x_BSD, wq, wk, wv, wo, q_scale, k_scale, eps, theta, positions_BS):
    """Qwen3 GQA attention with q/k norm (scales may be None), RoPE, causal softmax."""
    x = f64(x_BSD)
    q = np.einsum("bsd,dnh->bsnh", x, f64(wq))
    k = np.einsum("bsd,dkh->bskh", x, f64(wk))
    v = np.einsum("bsd,dkh->bskh", x, f64(wv))
    if q_scale is not None:
        q, k = rms_norm(q, q_scale, eps), rms_norm(k, k_scale, eps)
    q, k = rope(q, positions_BS, theta), rope(k, positions_BS, theta)
    b, s, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros_like(q)
    for head in range(n):
        kv = head // group  # query head n reads kv head n // (N / K)
        scores = np.einsum("bsh,bth->bst", q[:, :, head], k[:, :, kv]) / np.sqrt(h)
        scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
        out[:, :, head] = np.einsum("bst,bth->bsh", softmax(scores), v[:, :, kv])
    return np.einsum("bsnh,nhd->bsd", out, f64(wo))


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu(x, w_gate, w_up, w_down):
    x = f64(x)
    return (silu(x @ f64(w_gate)) * (x @ f64(w_up))) @ f64(w_down)


def route(logits_TE, k, norm_topk_prob):
    probs = softmax(logits_TE)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    return w, ids, probs


def load_balance(probs_TE, ids_TK):
    t, e = probs_TE.shape
    f = np.array([(ids_TK == i).sum() for i in range(e)], np.float64) / ids_TK.size
    return e * float(np.sum(f * f64(probs_TE).mean(0)))


def z_loss(logits_TE):
    z = f64(logits_TE)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    return float(np.mean(lse**2))


def moe(x_TD, w_router, w_gate, w_up, w_down, k, norm_topk_prob, keep_TK=None):
    """sum_k w[t,k] * expert_{id[t,k]}(x_t), skipping assignments where keep_TK is False."""
    x = f64(x_TD)
    w, ids, _ = route(x @ f64(w_router), k, norm_topk_prob)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            if keep_TK is None or keep_TK[t, j]:
                e = ids[t, j]
                out[t] += w[t, j] * swiglu(x[t], w_gate[e], w_up[e], w_down[e])
    return out


def capacity_keep(ids_TK, num_experts, cap):
    """Which assignments fit: first choices of all tokens (in token order), then second, ..."""
    t, k = ids_TK.shape
    fill = np.zeros(num_experts, int)
    keep = np.zeros((t, k), bool)
    for j in range(k):
        for i in range(t):
            e = ids_TK[i, j]
            keep[i, j] = fill[e] < cap
            fill[e] += 1
    return keep
