"""`sigmoid_topk`: DeepSeek-V3's router (also Kimi K2, Moonlight, GLM-4.5): sigmoid scores,
selection by top-k of score + a per-expert bias that is not a parameter, nudged toward balance
after every step (auxiliary-loss-free balancing), optionally limited to each token's best
expert groups.

Legend: T tokens (B*S flattened), E experts, K experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from moetext.config.schema import MoEConfig
from moetext.models.layers.params import make_model_state
from moetext.models.moe.routers.base import COUNTS_KEY, register_router
from moetext.models.moe.routers.gate import GateRouter

BIAS_KEY = "selection_bias"


@register_router("sigmoid_topk")
class SigmoidTopK(GateRouter):
    """scores = sigmoid(logits) in float32; experts chosen by top-k of scores + selection_bias
    (the bias decides which experts, never their weights; groups scored by the sum of their two
    highest biased scores); weights = the chosen unbiased scores, renormalised with DeepSeek's
    1e-20 under norm_topk_prob, times routed_scaling_factor. The balance loss averages the
    per-token normalised scores s / sum(s).

    selection_bias (ModelState [E] float32; HF's e_score_correction_bias) starts at
    moe.initial_bias (zeros when empty); with moe.bias_update_rate > 0 each step adds
    rate * sign(mean load - load_e), the load counted over the step's global batch.
    """

    group_score = "top2_sum"
    norm_eps = 1e-20

    def __init__(self, cfg: MoEConfig, **dims: Any):
        """dims: GateRouter's (emb_dim, init_std, param_dtype, rngs)."""
        super().__init__(cfg, **dims)
        self.rate = cfg.bias_update_rate
        bias = jnp.asarray(cfg.initial_bias or [0.0] * cfg.num_experts, jnp.float32)
        self.selection_bias = make_model_state(bias, (None,))

    def affinities(self, logits_TE: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        scores_TE = jax.nn.sigmoid(logits_TE.astype(jnp.float32))
        choice_TE = scores_TE + self.selection_bias[...][None, :]
        probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
        return choice_TE, scores_TE, probs_TE

    def extra_metrics(self) -> dict[str, jax.Array]:
        return {BIAS_KEY: self.selection_bias[...]}

    def update_state(self, metrics: Mapping[str, jax.Array]) -> None:
        super().update_state(metrics)
        if self.rate > 0:
            counts_E = metrics[COUNTS_KEY]
            step_E = jnp.sign(jnp.mean(counts_E) - counts_E)
            self.selection_bias[...] = self.selection_bias[...] + jnp.float32(self.rate) * step_E
