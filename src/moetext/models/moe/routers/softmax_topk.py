"""`softmax_topk`: softmax over the experts' logits, then the K most probable (Qwen2/3-MoE,
Mixtral, Switch), with the Switch load-balancing loss and the ST-MoE z-loss.

Legend: T tokens (B*S flattened), D emb_dim, E experts, K experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moetext.config.schema import MoEConfig
from moetext.models.layers.params import make_param, normal
from moetext.models.layers.project import project
from moetext.models.moe.routers.base import Router, Routing, register_router
from moetext.models.moe.routers.losses import expert_load, load_balance_loss, router_z_loss

W_NAMES = ("embed", None)


@register_router("softmax_topk")
class SoftmaxTopK(Router):
    """Linear D -> E gate `w`, softmax, top-k; logits in float32 because top-k and the losses
    are precision-sensitive.

    The weight is replicated over the expert axis ("embed", None): every shard needs all E logits
    to pick its top-k, and the matrix is tiny. It is the HF gate (`mlp.gate.weight`, transposed).
    """

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        emb_dim: int,
        init_std: float,
        param_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ):
        self.k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.aux_loss_weight, self.z_loss_weight = cfg.aux_loss_weight, cfg.z_loss_weight
        self.w = make_param(
            rngs, normal(init_std), (emb_dim, cfg.num_experts), W_NAMES, param_dtype
        )

    def logits(self, x_TD: jax.Array) -> jax.Array:
        """logits_TE float32."""
        return project("td,de->te", x_TD.astype(jnp.float32), self.w[...], W_NAMES, jnp.float32)

    def __call__(self, x_TD: jax.Array, *, segment_ids_T: jax.Array | None = None) -> Routing:
        # Every token counts in the losses and the load, padding included (segment_ids_T unused).
        logits_TE = self.logits(x_TD)
        weights_TK, ids_TK, probs_TE = route(logits_TE, self.k, self.norm_topk_prob)
        lb, z = load_balance_loss(probs_TE, ids_TK), router_z_loss(logits_TE)
        return Routing(
            weights_TK,
            ids_TK,
            moe_loss=self.aux_loss_weight * lb + self.z_loss_weight * z,
            losses={"load_balance_loss": lb, "router_z_loss": z},
            metrics={"expert_load": expert_load(ids_TK, logits_TE.shape[-1])},
        )


def route(
    logits_TE: jax.Array, k: int, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Softmax over experts, then top-k (ties go to the lower expert id).

    Returns weights_TK float32 (renormalised to sum to 1 when norm_topk_prob), ids_TK int32 and
    the full probabilities probs_TE float32 (for the load-balancing loss).
    """
    probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    weights_TK, ids_TK = jax.lax.top_k(probs_TE, k)
    if norm_topk_prob:
        weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    return weights_TK, ids_TK.astype(jnp.int32), probs_TE
