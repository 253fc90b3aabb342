"""Multi-token prediction (DeepSeek-V3, section 2.2), laid out as the released checkpoints,
vLLM, SGLang and Megatron-Core lay it out.

Legend: B batch, S sequence, D emb_dim, V vocab, K MTP depths (model.mtp_layers).

Depth k = 1..K predicts token t_{i+k+1} at position i (the main model predicts t_{i+1}):

    h_0     = the main model's last hidden state, before its final norm
    h_k     = Layer_k(eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h_{k-1})]))   (embedding first)
    p_k     = softmax(head(shared_head.norm(h_k)))                        -> t_{i+k+1}
    L_k     = mean over the valid positions of -log p_k[t_{i+k+1}]
    mtp_loss = (1 / K) sum_k L_k,  the trainer's loss adds mtp_loss_weight * mtp_loss

Emb and head are the main model's (shared, as in the paper), Layer_k one full decoder layer the
decoder builds (`make_layer`), eh_proj a [2D, D] matmul; enorm, hnorm and shared_head.norm are
RMSNorms of depth k. The paper writes the concatenation as [h ; Emb]; the released checkpoints
and every inference engine put the embedding first, which is what the weights mean.

A target of depth k at position i counts when the main loss counts the target at position
i + k (not padding, same document as its input, in a chat batch's loss_mask) and that input is
in position i's document (segment ids equal): so no target past the row, in padding or in
another document than h_0's at i. A packed document is one run of a segment id, so then every
token between them is in that document too (the layer's attention never crosses it either).

L_k's mean is over the step's valid targets, as the main CE's: when the batch is one of N
micro-batches of a step (gradient accumulation; LossTargets.step_mask_BS), a micro-batch's L_k is
its NLL sum divided by C_k / N, C_k the step's count of depth-k targets, so the trainer's mean
of the N micro-batches' mtp_loss (and of the gradients) is the unsplit step's exactly, however
unevenly padding, document boundaries or loss masks spread the valid targets over them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from moetext.models.family import EXTRA_LOSS_KEY, LossTargets
from moetext.models.layers.norms import RMSNorm
from moetext.models.layers.params import as_dtype, make_param, normal
from moetext.models.layers.project import project

Aux = dict[str, jax.Array]
EH_NAMES = (None, "embed")  # eh_proj [2D, D]: the concatenated input dim stays whole
MTP_LOSS_KEY = "mtp_loss"
# (layer, x_BSD) -> (x_BSD, the layer's aux): runs one decoder layer of the decoder's kind,
# with the decoder's RoPE tables, segment ids and remat policy.
RunLayer = Callable[[nnx.Module, jax.Array], tuple[jax.Array, Aux]]


class SharedHead(nnx.Module):
    """The per-depth part of the output head: its RMSNorm (the head weight is the model's)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: Any, rngs: nnx.Rngs):
        self.norm = RMSNorm(dim, eps=eps, param_dtype=param_dtype, rngs=rngs)


class MTPDepth(nnx.Module):
    """One MTP module: enorm, hnorm, eh_proj, a decoder layer and shared_head.norm (HF's
    model.layers.{num_hidden_layers + k - 1}.*)."""

    def __init__(
        self,
        emb_dim: int,
        layer: nnx.Module,
        *,
        eps: float,
        init_std: float,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ):
        pdt = as_dtype(param_dtype)
        self.enorm = RMSNorm(emb_dim, eps=eps, param_dtype=pdt, rngs=rngs)
        self.hnorm = RMSNorm(emb_dim, eps=eps, param_dtype=pdt, rngs=rngs)
        self.eh_proj = make_param(rngs, normal(init_std), (2 * emb_dim, emb_dim), EH_NAMES, pdt)
        self.layer = layer
        self.shared_head = SharedHead(emb_dim, eps=eps, param_dtype=pdt, rngs=rngs)

    def __call__(
        self, e_BSD: jax.Array, h_BSD: jax.Array, run_layer: RunLayer
    ) -> tuple[jax.Array, jax.Array, Aux]:
        """(the embedded tokens t_{i+k}, h_{k-1}) -> (h_k, shared_head.norm(h_k), layer aux)."""
        dtype = h_BSD.dtype
        x_BSF = jnp.concatenate([self.enorm(e_BSD.astype(dtype)), self.hnorm(h_BSD)], axis=-1)
        x_BSD = project("bsf,fd->bsd", x_BSF, self.eh_proj[...], EH_NAMES, dtype)
        h_BSD, aux = run_layer(self.layer, x_BSD)
        return h_BSD, self.shared_head.norm(h_BSD), aux


class MTP(nnx.Module):
    """K MTP depths; `__call__` -> the MTP loss terms of one batch (module docstring).

    make_layer(k) builds depth k's decoder layer (k = 1..K; the decoder draws its params as it
    does its own layers'); weight is mtp_loss_weight (lambda)."""

    def __init__(
        self,
        num_depths: int,
        emb_dim: int,
        make_layer: Callable[[int], nnx.Module],
        *,
        weight: float,
        eps: float,
        init_std: float,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ):
        if num_depths < 1:
            raise ValueError(f"MTP needs at least one depth, got {num_depths}")
        self.weight = float(weight)
        self.depths = nnx.List(
            [
                MTPDepth(
                    emb_dim,
                    make_layer(k),
                    eps=eps,
                    init_std=init_std,
                    param_dtype=param_dtype,
                    rngs=rngs,
                )
                for k in range(1, num_depths + 1)
            ]
        )

    def __call__(
        self,
        h0_BSD: jax.Array,
        embed_VD: jax.Array,
        head_VD: jax.Array,
        targets: LossTargets,
        segment_ids_BS: jax.Array | None,
        run_layer: RunLayer,
    ) -> tuple[Aux, list[Aux]]:
        """-> ({mtp_loss (unweighted mean over depths), extra_loss (weight x mtp_loss)}, the
        depths' layer aux in depth order). h0_BSD: the main model's last hidden state before
        its final norm, in the compute dtype; embed_VD and head_VD: the model's (shared)."""
        losses, layer_aux = [], []
        h_BSD = h0_BSD
        for k, depth in enumerate(self.depths, start=1):
            tokens_BS, target_BS, mask_BS = depth_targets(targets, segment_ids_BS, k)
            e_BSD = jnp.take(embed_VD, tokens_BS, axis=0)
            h_BSD, out_BSD, aux = depth(e_BSD, h_BSD, run_layer)
            nll_sum, count = targets.nll(out_BSD, head_VD, target_BS, mask_BS)
            losses.append(nll_sum / step_share(targets, count, k))
            layer_aux.append(aux)
        mtp_loss = jnp.mean(jnp.stack(losses)).astype(jnp.float32)
        return {MTP_LOSS_KEY: mtp_loss, EXTRA_LOSS_KEY: self.weight * mtp_loss}, layer_aux


def depth_targets(
    targets: LossTargets, segment_ids_BS: jax.Array | None, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Depth k's (input tokens t_{i+k}, targets t_{i+k+1}, mask), each [B, S], from the main
    targets y (y[i] = t_{i+1}): inputs y[i + k - 1], targets y[i + k], counted where the main
    mask counts y[i + k] and position i + k is in position i's segment; positions whose
    targets fall past the row read token 0 and never count."""
    y_BS = targets.targets_BS
    tokens_BS = _shift_left(y_BS, k - 1)
    target_BS = _shift_left(y_BS, k)
    return tokens_BS, target_BS, depth_mask(targets.mask_BS, segment_ids_BS, k)


def depth_mask(mask_BS: jax.Array, segment_ids_BS: jax.Array | None, k: int) -> jax.Array:
    """Which depth-k targets count (depth_targets), from the main mask and segment ids."""
    out_BS = _shift_left(mask_BS.astype(bool), k)  # False past the row
    if segment_ids_BS is not None:
        out_BS = out_BS & (_shift_left(segment_ids_BS, k) == segment_ids_BS)
    return out_BS


def step_share(targets: LossTargets, count: jax.Array, k: int) -> jax.Array:
    """What a batch divides its depth-k NLL sum by: max(count, 1) for a whole step; for one of
    N micro-batches, max(C_k, 1) / N with C_k the step's count (module docstring)."""
    if targets.step_mask_BS is None:
        return jnp.maximum(count, 1.0)
    step_BS = depth_mask(targets.step_mask_BS, targets.step_segment_ids_BS, k)
    total = jnp.maximum(jnp.sum(step_BS, dtype=jnp.float32), 1.0)
    return total / targets.micro_batches


def _shift_left(x_BS: jax.Array, k: int) -> jax.Array:
    """x[:, i + k] at position i, zero (False) for i + k >= S."""
    if k == 0:
        return x_BS
    s = x_BS.shape[1]
    pad = jnp.zeros((x_BS.shape[0], min(k, s)), x_BS.dtype)
    return jnp.concatenate([x_BS[:, k:], pad], axis=1)
