"""The router seam: what a router returns (`Routing`), what it is (`Router`), the registry.

Legend: T tokens (B*S flattened), D emb_dim, E experts, K experts per token.

    router = build_router(cfg.moe, emb_dim=..., init_std=..., param_dtype=..., rngs=...)
    routing = router(x_TD, segment_ids_BS=seg)  # weights_TK, ids_TK, moe_loss, losses, metrics
    router.accumulate_state(metrics)            # after each micro-batch of an accumulated step
    router.update_state(metrics)                # after the optimizer update; no-op by default

`moe.router: <name>` picks the class registered under that name (`register_router`); the MoE
block receives the built router and reads only the `Routing` it returns.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

import jax
from flax import nnx
from jax.typing import DTypeLike

from moetext.config.schema import MoEConfig
from moetext.errors import ConfigError

# The unweighted losses every router reports (0.0 for one it does not compute) and the metric
# every router reports, so each MoE layer returns the same aux keys whichever router it holds
# (a scanned stack, the trainer's metrics and the logs need one shape).
LOSS_KEYS = ("load_balance_loss", "router_z_loss")
LOAD_KEY = "expert_load"
# Non-padding assignments per expert (float32 [E]): what load balancing acts on.
COUNTS_KEY = "expert_counts"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """One router call's result (a pytree, so a router may be jitted on its own)."""

    weights_TK: jax.Array
    """float32: the weight of each chosen expert in the token's output."""
    ids_TK: jax.Array
    """int32 in [0, E): the chosen experts, K distinct per token."""
    moe_loss: jax.Array
    """float32 scalar added to the training loss: the router's losses already weighted by
    its config (e.g. moe.aux_loss_weight, moe.z_loss_weight)."""
    losses: dict[str, jax.Array]
    """Unweighted float32 scalars by name, for the logs; holds at least LOSS_KEYS."""
    metrics: dict[str, jax.Array]
    """Per-layer statistics over the non-padding tokens: expert_load float32 [E] (the fraction
    of their assignments routed to each expert, before any capacity drop) and expert_counts
    (the assignments themselves); holds at least LOAD_KEY and COUNTS_KEY."""


class Router(nnx.Module):
    """Hidden states -> `Routing`. Subclasses hold their parameters (nnx.Param, trained) and any
    state the optimizer must not see (an nnx.Variable that is not a Param, e.g. a selection
    bias), and are constructed as `Cls(cfg: MoEConfig, *, emb_dim, init_std, param_dtype,
    rngs)` (see `RouterBuilder`)."""

    def __call__(self, x_TD: jax.Array, *, segment_ids_BS: jax.Array | None = None) -> Routing:
        """x_TD in the compute dtype, T = B*S in row order. segment_ids_BS (None: every token
        counts, each row one document) is the packed document of each token, 0 for padding:
        padding is left out of every loss, load and statistic."""
        raise NotImplementedError(f"{type(self).__name__} must define __call__")

    def accumulate_state(self, metrics: Mapping[str, jax.Array]) -> None:
        """Updates non-parameter state after each micro-batch of an accumulated step (the
        micro-batch's aux of this layer), before the next one runs; the default does nothing."""
        del metrics

    def update_state(self, metrics: Mapping[str, jax.Array]) -> None:
        """Updates non-parameter state from one train step's metrics of this layer (the block's
        aux: every key of `Routing.losses` and `Routing.metrics`, averaged over the step's
        micro-batches, but expert_counts summed: the global batch's). Called outside the
        gradient, after the optimizer update; the default has no state and does nothing."""
        del metrics


class RouterBuilder(Protocol):
    """What `register_router` stores: a Router class (or function) built from the moe section
    and the layer's dimensions; parameters are drawn from rngs' "params" stream."""

    def __call__(
        self,
        cfg: MoEConfig,
        *,
        emb_dim: int,
        init_std: float,
        param_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ) -> Router: ...


B = TypeVar("B", bound=RouterBuilder)
_ROUTERS: dict[str, RouterBuilder] = {}


def register_router(name: str, *, replace: bool = False) -> Callable[[B], B]:
    """Class decorator: `moe.router: <name>` builds the class. A second router of one name is an
    error unless replace=True. A router may be registered from outside the package (tests do)."""
    if not name.isidentifier():
        raise ValueError(f"router name {name!r} must be a Python identifier")

    def register(builder: B) -> B:
        old = _ROUTERS.get(name)
        if old is not None and old is not builder and not replace:
            raise ValueError(
                f"router {name!r} is already registered ({getattr(old, '__name__', old)}); pass "
                "replace=True to replace it"
            )
        _ROUTERS[name] = builder
        return builder

    return register


def available_routers() -> list[str]:
    return sorted(_ROUTERS)


def get_router(name: str) -> RouterBuilder:
    """The router registered as `name`; a ConfigError with the valid names (and the nearest)
    if there is none."""
    if name not in _ROUTERS:
        near = difflib.get_close_matches(name, _ROUTERS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(
            f"unknown moe.router {name!r}{hint}; valid routers: {', '.join(available_routers())}"
        )
    return _ROUTERS[name]


def build_router(
    cfg: MoEConfig, *, emb_dim: int, init_std: float, param_dtype: DTypeLike, rngs: nnx.Rngs
) -> Router:
    """The router `cfg.router` names, built for one layer."""
    router = get_router(cfg.router)(
        cfg, emb_dim=emb_dim, init_std=init_std, param_dtype=param_dtype, rngs=rngs
    )
    if not isinstance(router, Router):
        raise TypeError(
            f"router {cfg.router!r} built a {type(router).__name__}, not a moe.routers.Router"
        )
    return router
