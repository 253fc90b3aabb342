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


def assigned_fractions(ids_TK, e):
    """f_e: the share of the T * K assignments that went to expert e."""
    return np.array([(ids_TK == i).sum() for i in range(e)], np.float64) / ids_TK.size


def load_balance(probs_TE, ids_TK):
    e = probs_TE.shape[1]
    return e * float(np.sum(assigned_fractions(ids_TK, e) * f64(probs_TE).mean(0)))


def logsumexp(z_TE):
    z = f64(z_TE)
    return np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)


def z_loss(logits_TE):
    return float(np.mean(logsumexp(logits_TE) ** 2))


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


def moe_sin_loss_grads(x_TD, w_router, w_gate, w_up, w_down, k, lb_coef, z_coef):
    """Gradients of sum(sin(moe(x))) + lb_coef * load_balance + z_coef * z_loss (top-k weights
    renormalised, nothing dropped) with respect to x and each weight, the backward written out
    by hand: the top-k choice is fixed by the forward and the load-balance fractions are counts,
    so neither carries a gradient."""
    x, wr, wg, wu, wd = (f64(a) for a in (x_TD, w_router, w_gate, w_up, w_down))
    t, e = x.shape[0], wr.shape[1]
    logits = x @ wr
    w, ids, probs = route(logits, k, True)
    picked = np.take_along_axis(probs, ids, axis=-1)
    y = moe(x, wr, wg, wu, wd, k, True)
    dy = np.cos(y)
    g = {"x": np.zeros_like(x), "router": np.zeros_like(wr)}
    g.update(w_gate=np.zeros_like(wg), w_up=np.zeros_like(wu), w_down=np.zeros_like(wd))
    dprobs = np.zeros_like(probs)
    for i in range(t):
        dw = np.zeros(k)
        for j in range(k):
            ex = ids[i, j]
            a, b = x[i] @ wg[ex], x[i] @ wu[ex]
            sig = 1.0 / (1.0 + np.exp(-a))
            h = a * sig * b
            dw[j] = dy[i] @ (h @ wd[ex])
            g["w_down"][ex] += w[i, j] * np.outer(h, dy[i])
            dh = w[i, j] * (wd[ex] @ dy[i])
            da = dh * b * sig * (1.0 + a * (1.0 - sig))  # d silu(a) / da
            db = dh * a * sig
            g["w_gate"][ex] += np.outer(x[i], da)
            g["w_up"][ex] += np.outer(x[i], db)
            g["x"][i] += wg[ex] @ da + wu[ex] @ db
        # w = picked / sum(picked): d picked_j = (dw_j - sum_j' dw_j' w_j') / sum(picked).
        dprobs[i, ids[i]] += (dw - dw @ w[i]) / picked[i].sum()
    # load_balance = E * sum_e f_e * mean_t probs[t, e], f the (constant) assignment fractions.
    dprobs += lb_coef * e * assigned_fractions(ids, e) / t
    dlogits = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True))
    # z_loss = mean_t logsumexp(logits_t)^2, and d logsumexp / d logits = probs.
    dlogits += z_coef * 2.0 * logsumexp(logits)[:, None] * probs / t
    g["router"] += x.T @ dlogits
    g["x"] += dlogits @ wr.T
    return g


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


def _top_ids(x_TE, k):
    """Each row's k largest, ties to the lowest index (torch.topk on CPU, DeepSeek's gate)."""
    return np.argsort(-x_TE, axis=-1, kind="stable")[:, :k]


def group_limited(choice_TE, k, n_group, topk_group, group_score):
    """ids_TK: top-k of choice among each token's topk_group best of n_group groups (group score
    "max": DeepSeek-V2; "top2_sum": DeepSeek-V3), the other groups' experts masked to -inf."""
    choice = f64(choice_TE).copy()
    t, e = choice.shape
    if n_group > 1:
        g_TGN = choice.reshape(t, n_group, e // n_group)
        if group_score == "max":
            score_TG = g_TGN.max(-1)
        else:
            score_TG = np.sort(g_TGN, axis=-1)[..., -2:].sum(-1)
        keep_TG = np.zeros((t, n_group), bool)
        np.put_along_axis(keep_TG, _top_ids(score_TG, topk_group), True, axis=-1)
        choice = np.where(np.repeat(keep_TG, e // n_group, axis=1), choice, -np.inf)
    return _top_ids(choice, k)


def sigmoid_gate(logits_TE, bias_E, k, n_group, topk_group, norm_topk_prob, scale):
    """DeepSeek-V3's gate (transformers' DeepseekV3TopkRouter + get_topk_indices): sigmoid
    scores; bias added for the choice only; weights the unbiased scores, renormalised with
    +1e-20, times routed_scaling_factor. -> (weights_TK, ids_TK, scores_TE)."""
    scores = 1.0 / (1.0 + np.exp(-f64(logits_TE)))
    ids = group_limited(scores + f64(bias_E)[None], k, n_group, topk_group, "top2_sum")
    w = np.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * scale, ids, scores


def softmax_group_gate(logits_TE, k, n_group, topk_group, norm_topk_prob):
    """DeepSeek-V2's group_limited_greedy over softmax probabilities (group score = max)."""
    probs = softmax(logits_TE)
    ids = group_limited(probs, k, n_group, topk_group, "max")
    w = np.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    return w, ids, probs


def counts(ids_TK, valid_T, e):
    """Assignments per expert of the valid tokens."""
    c = np.zeros(e)
    for t, row in enumerate(np.asarray(ids_TK)):
        if valid_T[t]:
            for i in row:
                c[i] += 1
    return c


def switch_balance(probs_TE, ids_TK, valid_T, prior_E=None):
    """E * sum_e f_e * P_e over the valid tokens; f from counts (+ prior), normalised."""
    p, v = f64(probs_TE), f64(valid_T)
    e = p.shape[1]
    c = counts(ids_TK, v, e) + (0.0 if prior_E is None else f64(prior_E))
    return e * float(np.sum(c / c.sum() * (p * v[:, None]).sum(0) / v.sum()))


def sequence_balance(probs_TE, ids_TK, segment_ids_BS, k):
    """DeepSeek-V3 eqs. 17-20 per packed document: f_i = E/(K*T_s) * count_i, P_i = mean over
    the document's tokens of the normalised affinity; L = sum_i f_i P_i, averaged over
    documents (segment 0 = padding, skipped)."""
    p, seg = f64(probs_TE), np.asarray(segment_ids_BS)
    b, s = seg.shape
    e = p.shape[1]
    p_BSE, ids_BSK = p.reshape(b, s, e), np.asarray(ids_TK).reshape(b, s, k)
    losses = []
    for r in range(b):
        for d in sorted(set(seg[r].tolist()) - {0}):
            at = seg[r] == d
            t_s = at.sum()
            c = np.array([(ids_BSK[r][at] == i).sum() for i in range(e)], np.float64)
            losses.append(float(np.sum(e / (k * t_s) * c * p_BSE[r][at].mean(0))))
    return float(np.mean(losses))


def masked_z_loss(logits_TE, valid_T):
    z = f64(logits_TE)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    v = f64(valid_T)
    return float(np.sum(lse**2 * v) / v.sum())


def bias_update(bias_E, counts_E, rate):
    """DeepSeek-V3's auxiliary-loss-free update: b += rate * sign(mean load - load)."""
    c = f64(counts_E)
    return f64(bias_E) + rate * np.sign(c.mean() - c)
