"""The MoE feed-forward block: router -> dispatch -> experts -> combine (+ shared experts).

The block receives a built router (models/moe/routers) and reads only the `Routing` it returns:
which router it holds is decided by `moe.router`, never by a branch here.

Legend: B batch, S sequence, T = B*S tokens, D emb_dim, E experts, K experts per token,
M = T*K assignment rows, C capacity slots per expert.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moetext.config.schema import MoEConfig
from moetext.kernels.gmm import Gmm
from moetext.models.layers.mlp import SwiGLU
from moetext.models.layers.params import make_model_state, make_param, normal
from moetext.models.moe import decode as moe_decode
from moetext.models.moe import dispatch as dsp
from moetext.models.moe import ep
from moetext.models.moe.experts import Experts
from moetext.models.moe.routers import (
    COUNTS_KEY,
    LOAD_KEY,
    LOSS_KEYS,
    Router,
    Routing,
    build_router,
)
from moetext.models.moe.routers.losses import expert_counts, load_fraction, token_mask

__all__ = [
    "AUX_KEYS",
    "COUNTS_KEY",
    "DISPATCH_MODES",
    "DROPPED_KEY",
    "IDS_KEY",
    "LOAD_KEY",
    "MoEBlock",
    "capture_expert_ids",
    "check_moe_config",
    "zero_aux",
]

DISPATCH_MODES = ("dropless", "capacity")
OVERRIDES = ("none", "balanced", "random")
# The scalars of every layer's aux (zeros for a layer without MoE); a model reports each as the
# mean over its MoE layers. Every other key of an MoE layer's aux is a per-layer statistic (the
# router's metrics: expert_load, expert_counts, ...; DROPPED_KEY under capacity dispatch or
# moe.ep_buffer_factor;
# IDS_KEY while capturing), which a model stacks into [num_moe_layers, ...] in layer order.
AUX_KEYS = ("moe_loss", *LOSS_KEYS, "dropped_fraction")
DROPPED_KEY = "layer_dropped_fraction"  # float32 scalar per layer (capacity, EP bound)
IDS_KEY = "expert_ids"  # int32 [T, K] per layer, only inside capture_expert_ids()
_CAPTURE = contextvars.ContextVar("capture_expert_ids", default=False)


@contextlib.contextmanager
def capture_expert_ids() -> Iterator[None]:
    """While tracing inside this context, every MoE block adds its chosen experts (IDS_KEY,
    int32 [T, K] global ids) to its aux (train.routing_trace); outside it they are not output."""
    token = _CAPTURE.set(True)
    try:
        yield
    finally:
        _CAPTURE.reset(token)


def zero_aux() -> dict[str, jax.Array]:
    """The scalar aux of a layer without MoE (a scanned stack holds layers of one kind only)."""
    return {key: jnp.zeros((), jnp.float32) for key in AUX_KEYS}


def check_moe_config(cfg: MoEConfig) -> None:
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if e < 1 or not 1 <= k <= e:
        raise ValueError(f"need 1 <= num_experts_per_tok ({k}) <= num_experts ({e})")
    if cfg.routing_override not in OVERRIDES:
        raise ValueError(
            f"unknown moe.routing_override {cfg.routing_override!r}; valid: {', '.join(OVERRIDES)}"
        )
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
    """x_BSD -> (y_BSD, aux). aux holds the router's `Routing`: moe_loss (already weighted by
    the config's loss weights), each of its losses (load_balance_loss, router_z_loss) and
    metrics (expert_load f_E [E], the fraction of routed assignments per expert), plus the
    dispatch's dropped_fraction.

    gmm: the grouped matmul the dropless experts run (backend, quantization recipe, options),
    built once per model (`gmm_from_config(cfg.kernels)`) and shared by every MoE layer.
    router: the layer's built router (`routers.build_router(cfg, ...)`, drawing its params
    before the experts'); None builds the one `cfg.router` names from `rngs`.
    shared_expert_gate: scale the shared experts' output per token by sigmoid(x @ w [D, 1])
    (Qwen2-MoE; needs cfg.num_shared_experts >= 1).

    cfg.routing_override (benchmarks) replaces the router's choice after it ran (its losses stay
    the router's; the loads and counts become the override's): balanced sends token t to
    experts (t*K + j) mod E, random to K distinct experts drawn from `override_key` (ModelState,
    advanced every step), weights 1/K.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        gmm: Gmm,
        *,
        router: Router | None = None,
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
        if router is None:
            router = build_router(
                cfg, emb_dim=emb_dim, init_std=init_std, param_dtype=param_dtype, rngs=rngs
            )
        elif not isinstance(router, Router):
            raise ValueError(
                f"MoEBlock: router must be a models.moe.routers.Router (e.g. build_router(cfg, "
                f"...)), got {type(router).__name__}"
            )
        self.cfg, self.gmm, self.dtype = cfg, gmm, dtype
        self.router = router
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
        if cfg.routing_override == "random":
            key = jax.random.key_data(rngs.params())  # one stream per layer
            self.override_key = make_model_state(key.astype(jnp.uint32), (None,))

    def __call__(
        self, x_BSD: jax.Array, segment_ids_BS: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        b, s, d = x_BSD.shape
        x_TD = x_BSD.reshape(b * s, d).astype(self.dtype)
        routing = self._route(x_TD, segment_ids_BS)
        per_layer: dict[str, jax.Array] = {}
        if self.cfg.dispatch == "dropless":
            y_TD, dropped = self._dropless(x_TD, routing.ids_TK, routing.weights_TK)
            if self.cfg.ep_buffer_factor:
                per_layer[DROPPED_KEY] = dropped
        else:
            valid_T = None if segment_ids_BS is None else segment_ids_BS.reshape(-1) > 0
            y_TKD, dropped = self._capacity(x_TD, routing.ids_TK, valid_T)
            per_layer[DROPPED_KEY] = dropped
            y_TD = dsp.combine(y_TKD, routing.weights_TK, self.dtype)
        if _CAPTURE.get():
            per_layer[IDS_KEY] = routing.ids_TK
        if self.shared is not None:
            y_TD = y_TD + self._shared(x_TD)
        aux = {
            "moe_loss": routing.moe_loss,
            **routing.losses,
            "dropped_fraction": dropped,
            **routing.metrics,
            **per_layer,
        }
        return y_TD.reshape(b, s, d), aux

    def update_state(self, metrics: Mapping[str, jax.Array]) -> None:
        """The router's non-parameter state update from this layer's aux of a train step (see
        `Router.update_state`), and the random override's key advanced; called outside the
        gradient, after the optimizer update."""
        self.router.update_state(metrics)
        if self.cfg.routing_override == "random":
            key = jax.random.wrap_key_data(self.override_key[...])
            self.override_key[...] = jax.random.key_data(jax.random.fold_in(key, 1))

    def accumulate_state(self, metrics: Mapping[str, jax.Array]) -> None:
        """The router's state update after one micro-batch of an accumulated step (see
        `Router.accumulate_state`)."""
        self.router.accumulate_state(metrics)

    def decode(self, x_BSD: jax.Array) -> jax.Array:
        """The layer's output without the auxiliary losses, for decoding. With prefused experts
        (`moe.decode.prefuse`) it runs the decode path (the fused kernel, gathered or grouped;
        one gate|up matmul); otherwise the training forward."""
        if not moe_decode.is_prefused(self.experts):
            return self(x_BSD)[0]
        b, s, d = x_BSD.shape
        x_TD = x_BSD.reshape(b * s, d).astype(self.dtype)
        routing = self._route(x_TD, None)  # its losses and metrics are unused: jit drops them
        y_TD = moe_decode.routed_output(
            self.experts, x_TD, routing.ids_TK, routing.weights_TK, self.gmm, self.dtype
        )
        if self.shared is not None:
            y_TD = y_TD + self._shared(x_TD)
        return y_TD.reshape(b, s, d)

    def _route(self, x_TD: jax.Array, segment_ids_BS: jax.Array | None) -> Routing:
        """The router's Routing for x_TD (then the override's choice, if any), its shapes and
        keys checked (at trace time)."""
        routing = self.router(x_TD, segment_ids_BS=segment_ids_BS)
        want = (x_TD.shape[0], self.cfg.num_experts_per_tok)
        missing = [k for k in LOSS_KEYS if k not in routing.losses]
        missing += [k for k in (LOAD_KEY, COUNTS_KEY) if k not in routing.metrics]
        if routing.ids_TK.shape != want or routing.weights_TK.shape != want or missing:
            raise ValueError(
                f"router {type(self.router).__name__} returned ids {routing.ids_TK.shape} and "
                f"weights {routing.weights_TK.shape} for [T, K] = {list(want)}"
                + (f", without {missing}" if missing else "")
            )
        if self.cfg.routing_override == "none":
            return routing
        return self._override(routing, segment_ids_BS)

    def _override(self, routing: Routing, segment_ids_BS: jax.Array | None) -> Routing:
        """Routing with the benchmark override's experts, weights 1/K; its loads and counts
        are the override's (what the experts computed), its losses the router's own."""
        (t, k), e = routing.ids_TK.shape, self.cfg.num_experts
        if self.cfg.routing_override == "balanced":
            ids_TK = (jnp.arange(t)[:, None] * k + jnp.arange(k)[None, :]) % e
        else:  # random: the K largest of E uniform draws are K distinct experts
            key = jax.random.wrap_key_data(self.override_key[...])
            ids_TK = jax.lax.top_k(jax.random.uniform(key, (t, e)), k)[1]
        weights_TK = jnp.full((t, k), 1.0 / k, jnp.float32)
        ids_TK = ids_TK.astype(jnp.int32)
        counts_E = expert_counts(ids_TK, token_mask(segment_ids_BS, t), e)
        metrics = {**routing.metrics, LOAD_KEY: load_fraction(counts_E), COUNTS_KEY: counts_E}
        return dataclasses.replace(routing, weights_TK=weights_TK, ids_TK=ids_TK, metrics=metrics)

    def _shared(self, x_TD: jax.Array) -> jax.Array:
        """The shared experts' output, scaled per token by sigmoid(x @ w) under
        shared_expert_gate (Qwen2-MoE)."""
        assert self.shared is not None
        shared_TD = self.shared(x_TD)
        if self.shared_expert_gate:
            gate_T1 = jax.nn.sigmoid(jnp.dot(x_TD, self.shared_gate[...].astype(self.dtype)))
            shared_TD = gate_T1 * shared_TD
        return shared_TD

    def _dropless(
        self, x_TD: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(y_TD: the routed experts' outputs combined by weights_TK, the fraction of the
        assignments an expert-parallel receive bound dropped: 0 unless ep_buffer_factor)."""
        # The sharding rules, not a flag, decide: tokens or experts split over mesh axes of
        # size > 1 mean a per-shard dispatch in shard_map (with an all-to-all when "exp" is).
        layout = ep.layout_from_context(self.cfg.num_experts)
        if layout is not None:
            return ep.dropless(
                layout,
                x_TD,
                ids_TK,
                self.experts,
                self.gmm,
                weights_TK,
                buffer_factor=self.cfg.ep_buffer_factor,
            )
        xs_MD, group_sizes_E, order_M = dsp.permute(x_TD, ids_TK, self.cfg.num_experts)
        w_M = dsp.routing_weights_sorted(weights_TK, order_M)
        ys_MD = self.experts.grouped(xs_MD, group_sizes_E, self.gmm, row_scale=w_M)
        y_TD = dsp.unpermute_sum(ys_MD, order_M, ids_TK.shape[1], self.dtype)
        return y_TD, jnp.zeros((), jnp.float32)

    def _capacity(
        self, x_TD: jax.Array, ids_TK: jax.Array, valid_T: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]:
        """-> (y_TKD, the fraction of the non-padding tokens' assignments dropped)."""
        e = self.cfg.num_experts
        t, k = ids_TK.shape
        cap = dsp.capacity(t, k, e, self.cfg.capacity_factor)
        pos_TK, keep_TK = dsp.capacity_slots(ids_TK, e, cap)
        y_ECD = self.experts.batched(dsp.to_buffers(x_TD, ids_TK, pos_TK, e, cap))
        w_T1 = jnp.ones((t, 1), jnp.float32) if valid_T is None else valid_T[:, None]
        kept = jnp.sum(keep_TK.astype(jnp.float32) * w_T1) / jnp.maximum(k * jnp.sum(w_T1), 1.0)
        return dsp.from_buffers(y_ECD, ids_TK, pos_TK), 1.0 - kept
