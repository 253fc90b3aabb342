"""`GateRouter`: what the linear-gate routers share (softmax_topk, sigmoid_topk): the gate
weight, group-limited top-k, padding-aware balance losses by scope, the z-loss, load metrics,
and the global-batch load buffer.

Legend: T tokens (B*S flattened), D emb_dim, E experts, K experts per token.

A subclass defines `affinities(logits_TE)` -> (choice_TE: what top-k ranks, gate_TE: what
the chosen weights are read from, probs_TE: the per-token normalised affinity the balance loss
averages) and the group score it uses.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moetext.config.schema import MoEConfig
from moetext.models.layers.params import make_model_state, make_param, normal
from moetext.models.layers.project import project
from moetext.models.moe.routers.base import COUNTS_KEY, LOAD_KEY, Router, Routing
from moetext.models.moe.routers.losses import (
    balance_loss,
    expert_counts,
    load_fraction,
    router_z_loss,
    token_mask,
)
from moetext.models.moe.routers.select import select_experts

W_NAMES = ("embed", None)
F32 = jnp.float32


class GateRouter(Router):
    """Linear D -> E gate `w` in float32 (top-k and the losses are precision-sensitive), then
    the subclass's affinities, group-limited top-k, weights renormalised (norm_topk_prob) and
    scaled (routed_scaling_factor).

    The weight is replicated over the expert axis ("embed", None): every shard needs all E
    logits to pick its top-k, and the matrix is tiny. It is the HF gate (`mlp.gate.weight`,
    transposed). With aux_loss_scope global_batch the router keeps `load_prior` (ModelState
    [E]): the step's earlier micro-batches' assignment counts, zero between steps.
    """

    group_score = "max"
    norm_eps = 0.0  # added to the renormalisation's denominator

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        emb_dim: int,
        init_std: float,
        param_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ):
        self.k, self.e = cfg.num_experts_per_tok, cfg.num_experts
        self.norm_topk_prob, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.aux_loss_weight, self.z_loss_weight = cfg.aux_loss_weight, cfg.z_loss_weight
        self.scope = cfg.aux_loss_scope
        self.w = make_param(rngs, normal(init_std), (emb_dim, self.e), W_NAMES, param_dtype)
        if self.scope == "global_batch":
            self.load_prior = make_model_state(jnp.zeros((self.e,), F32), (None,))

    def logits(self, x_TD: jax.Array) -> jax.Array:
        """logits_TE float32."""
        return project("td,de->te", x_TD.astype(F32), self.w[...], W_NAMES, F32)

    def affinities(self, logits_TE: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """-> (choice_TE, gate_TE, probs_TE), see the module docstring."""
        raise NotImplementedError(f"{type(self).__name__} must define affinities")

    def extra_metrics(self) -> dict[str, jax.Array]:
        """Per-layer statistics a subclass adds (e.g. its selection bias)."""
        return {}

    def __call__(self, x_TD: jax.Array, *, segment_ids_BS: jax.Array | None = None) -> Routing:
        logits_TE = self.logits(x_TD)
        choice_TE, gate_TE, probs_TE = self.affinities(logits_TE)
        ids_TK = select_experts(
            choice_TE,
            self.k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            group_score=self.group_score,
        )
        weights_TK = jnp.take_along_axis(gate_TE, ids_TK, axis=1)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + self.norm_eps)
        if self.scale != 1.0:
            weights_TK = weights_TK * self.scale
        valid_T = token_mask(segment_ids_BS, x_TD.shape[0])
        prior = self.load_prior[...] if self.scope == "global_batch" else None
        lb = balance_loss(self.scope, probs_TE, ids_TK, valid_T, segment_ids_BS, prior)
        z = router_z_loss(logits_TE, valid_T)
        counts_E = expert_counts(ids_TK, valid_T, self.e)
        return Routing(
            weights_TK,
            ids_TK,
            moe_loss=self.aux_loss_weight * lb + self.z_loss_weight * z,
            losses={"load_balance_loss": lb, "router_z_loss": z},
            metrics={
                LOAD_KEY: load_fraction(counts_E),
                COUNTS_KEY: counts_E,
                **self.extra_metrics(),
            },
        )

    def accumulate_state(self, metrics: Mapping[str, jax.Array]) -> None:
        if self.scope == "global_batch":
            self.load_prior[...] = self.load_prior[...] + metrics[COUNTS_KEY]

    def update_state(self, metrics: Mapping[str, jax.Array]) -> None:
        if self.scope == "global_batch":
            self.load_prior[...] = jnp.zeros_like(self.load_prior[...])
