"""The MoE feed-forward block: router -> dispatch -> experts -> combine (+ shared experts).

Legend: B batch, S sequence, T = B*S tokens, D emb_dim, E experts, K experts per token,
M = T*K assignment rows, C capacity slots per expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moetext.config.schema import MoEConfig
from moetext.kernels.gmm import Gmm
from moetext.models.layers.mlp import SwiGLU
from moetext.models.layers.params import make_param, normal
from moetext.models.moe import decode as moe_decode
from moetext.models.moe import dispatch as dsp
from moetext.models.moe import ep
from moetext.models.moe.experts import Experts
from moetext.models.moe.router import (
    Router,
    expert_load,
    load_balance_loss,
    route,
    router_z_loss,
)

DISPATCH_MODES = ("dropless", "capacity")
AUX_KEYS = ("moe_loss", "load_balance_loss", "router_z_loss", "dropped_fraction")
# Besides the scalars, aux[LOAD_KEY] is the layer's expert_load f_E (fraction of the routed
# assignments per expert, float32 [E]); only MoE layers return it.
LOAD_KEY = "expert_load"


def zero_aux() -> dict[str, jax.Array]:
    """The scalar aux of a layer without MoE (a scanned stack holds layers of one kind only)."""
    return {key: jnp.zeros((), jnp.float32) for key in AUX_KEYS}


def check_moe_config(cfg: MoEConfig) -> None:
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if e < 1 or not 1 <= k <= e:
        raise ValueError(f"need 1 <= num_experts_per_tok ({k}) <= num_experts ({e})")
    if cfg.dispatch not in DISPATCH_MODES:
        raise ValueError(
            f"unknown moe.dispatch {cfg.dispatch!r}; valid: {', '.join(DISPATCH_MODES)}"
        )
    if cfg.dispatch == "capacity" and cfg.capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {cfg.capacity_factor}")
    if cfg.moe_intermediate_size < 1 or cfg.num_shared_experts < 0:
        raise ValueError(
            f"moe_intermediate_size ({cfg.moe_intermediate_size}) must be >= 1 and "
            f"num_shared_experts ({cfg.num_shared_experts}) >= 0"
        )


class MoEBlock(nnx.Module):
    """x_BSD -> (y_BSD, aux). aux["moe_loss"] is already weighted by the config's loss weights;
    aux["expert_load"] is f_E [E], the fraction of routed assignments per expert.

    gmm: the grouped matmul the dropless experts run (backend, quantization recipe, options),
    built once per model (`gmm_from_config(cfg.kernels)`) and shared by every MoE layer.
    shared_expert_gate: scale the shared experts' output per token by sigmoid(x @ w [D, 1])
    (Qwen2-MoE; needs cfg.num_shared_experts >= 1).
    """

    def __init__(
        self,
        cfg: MoEConfig,
        gmm: Gmm,
        *,
        emb_dim: int,
        init_std: float,
        param_dtype: DTypeLike,
        dtype: DTypeLike,
        rngs: nnx.Rngs,
        shared_expert_gate: bool = False,
    ):
        check_moe_config(cfg)
        if not isinstance(gmm, Gmm):
            raise ValueError(
                f"MoEBlock: gmm must be a kernels.gmm.Gmm (e.g. gmm_from_config(cfg.kernels)), "
                f"got {type(gmm).__name__}"
            )
        self.cfg, self.gmm, self.dtype = cfg, gmm, dtype
        self.router = Router(
            emb_dim, cfg.num_experts, init_std=init_std, param_dtype=param_dtype, rngs=rngs
        )
        self.experts = Experts(
            cfg.num_experts,
            emb_dim,
            cfg.moe_intermediate_size,
            init_std=init_std,
            param_dtype=param_dtype,
            dtype=dtype,
            rngs=rngs,
        )
        if cfg.num_shared_experts > 0:
            width = cfg.shared_intermediate_size or cfg.moe_intermediate_size
            self.shared: SwiGLU | None = SwiGLU(
                emb_dim,
                cfg.num_shared_experts * width,
                init_std=init_std,
                param_dtype=param_dtype,
                dtype=dtype,
                rngs=rngs,
            )
        else:
            self.shared = None
        if shared_expert_gate and self.shared is None:
            raise ValueError("shared_expert_gate needs num_shared_experts >= 1")
        self.shared_expert_gate = shared_expert_gate
        if shared_expert_gate:
            self.shared_gate = make_param(
                rngs, normal(init_std), (emb_dim, 1), ("embed", None), param_dtype
            )

    def __call__(self, x_BSD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        cfg = self.cfg
        b, s, d = x_BSD.shape
        x_TD = x_BSD.reshape(b * s, d).astype(self.dtype)
        logits_TE = self.router(x_TD)
        weights_TK, ids_TK, probs_TE = route(logits_TE, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        if cfg.dispatch == "dropless":
            y_TKD, dropped = self._dropless(x_TD, ids_TK), jnp.zeros((), jnp.float32)
        else:
            y_TKD, dropped = self._capacity(x_TD, ids_TK)
        y_TD = dsp.combine(y_TKD, weights_TK, self.dtype)
        if self.shared is not None:
            y_TD = y_TD + self._shared(x_TD)
        lb, z = load_balance_loss(probs_TE, ids_TK), router_z_loss(logits_TE)
        aux = {
            "moe_loss": cfg.aux_loss_weight * lb + cfg.z_loss_weight * z,
            "load_balance_loss": lb,
            "router_z_loss": z,
            "dropped_fraction": dropped,
            LOAD_KEY: expert_load(ids_TK, cfg.num_experts),
        }
        return y_TD.reshape(b, s, d), aux

    def decode(self, x_BSD: jax.Array) -> jax.Array:
        """The layer's output without the auxiliary losses, for decoding. With prefused experts
        (`moe.decode.prefuse`) it runs the decode path (gathered or grouped, one gate|up
        matmul); otherwise the training forward."""
        if not moe_decode.is_prefused(self.experts):
            return self(x_BSD)[0]
        cfg = self.cfg
        b, s, d = x_BSD.shape
        x_TD = x_BSD.reshape(b * s, d).astype(self.dtype)
        weights_TK, ids_TK, _ = route(
            self.router(x_TD), cfg.num_experts_per_tok, cfg.norm_topk_prob
        )
        y_TKD = moe_decode.expert_outputs(self.experts, x_TD, ids_TK, self.gmm, self.dtype)
        y_TD = dsp.combine(y_TKD, weights_TK, self.dtype)
        if self.shared is not None:
            y_TD = y_TD + self._shared(x_TD)
        return y_TD.reshape(b, s, d)

    def _shared(self, x_TD: jax.Array) -> jax.Array:
        """The shared experts' output, scaled per token by sigmoid(x @ w) under
        shared_expert_gate (Qwen2-MoE)."""
        assert self.shared is not None
        shared_TD = self.shared(x_TD)
        if self.shared_expert_gate:
            gate_T1 = jax.nn.sigmoid(jnp.dot(x_TD, self.shared_gate[...].astype(self.dtype)))
            shared_TD = gate_T1 * shared_TD
        return shared_TD

    def _dropless(self, x_TD: jax.Array, ids_TK: jax.Array) -> jax.Array:
        # The sharding rules, not a flag, decide: tokens or experts split over mesh axes of
        # size > 1 mean a per-shard dispatch in shard_map (with an all-to-all when "exp" is).
        layout = ep.layout_from_context(self.cfg.num_experts)
        if layout is not None:
            return ep.dropless(layout, x_TD, ids_TK, self.experts, self.gmm)
        xs_MD, group_sizes_E, order_M = dsp.permute(x_TD, ids_TK, self.cfg.num_experts)
        ys_MD = self.experts.grouped(xs_MD, group_sizes_E, self.gmm)
        return dsp.unpermute(ys_MD, order_M, ids_TK.shape[1])

    def _capacity(self, x_TD: jax.Array, ids_TK: jax.Array) -> tuple[jax.Array, jax.Array]:
        e = self.cfg.num_experts
        t, k = ids_TK.shape
        cap = dsp.capacity(t, k, e, self.cfg.capacity_factor)
        pos_TK, keep_TK = dsp.capacity_slots(ids_TK, e, cap)
        y_ECD = self.experts.batched(dsp.to_buffers(x_TD, ids_TK, pos_TK, e, cap))
        dropped = 1.0 - jnp.mean(keep_TK.astype(jnp.float32))
        return dsp.from_buffers(y_ECD, ids_TK, pos_TK), dropped
