"""What a decoder does with its MoE blocks' aux and state, whatever the family: reduce the
layers' aux to the model's (scalars averaged over MoE layers, per-layer statistics stacked in
layer order) and hand each block its own rows of a step's aux for its non-parameter state.

Legend: L layers of a scanned stack, N MoE layers of the model.

    acc = AuxAccumulator()
    acc.add_layer(aux) / acc.add_stack(aux_L)   # per layer, or a scanned stack's [L, ...] aux
    aux = acc.result()                          # AUX_KEYS means, per-layer keys as [N, ...]
    for_each_moe_block(blocks, aux, "update_state")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from moetext.models.moe.block import AUX_KEYS, zero_aux

Aux = dict[str, jax.Array]


class AuxAccumulator:
    """Sums the scalar aux (AUX_KEYS) of every layer and collects the per-layer statistics (every
    other key, present on MoE layers only) in layer order."""

    def __init__(self, num_moe_layers: int):
        self.n = num_moe_layers
        self.sums = zero_aux()
        self.rows: dict[str, list[jax.Array]] = {}

    def add_layer(self, aux: Aux) -> None:
        self.sums = {k: self.sums[k] + aux[k] for k in AUX_KEYS}
        for k, v in aux.items():
            if k not in AUX_KEYS:
                self.rows.setdefault(k, []).append(v[None])

    def add_stack(self, aux_L: Aux) -> None:
        """A scanned stack's aux: every value has a leading [L] axis."""
        self.sums = {k: self.sums[k] + jnp.sum(aux_L[k]) for k in AUX_KEYS}
        for k, v in aux_L.items():
            if k not in AUX_KEYS:
                self.rows.setdefault(k, []).append(v)

    def result(self) -> Aux:
        n = max(self.n, 1)
        aux = {k: self.sums[k] / n for k in AUX_KEYS}
        aux.update({k: jnp.concatenate(v, axis=0) for k, v in self.rows.items()})
        return aux


def per_layer(aux: Aux) -> Aux:
    """The per-layer statistics of a model's aux ([N, ...] each; scalars the step adds to the
    aux, such as loss_tokens, are not per layer)."""
    return {k: v for k, v in aux.items() if k not in AUX_KEYS and jnp.ndim(v) >= 1}


def for_each_moe_block(
    groups: Sequence[tuple[nnx.Module, int, bool]], aux: Aux, method: str
) -> None:
    """Calls `block.<method>(rows)` on every MoE block (`update_state`, `accumulate_state`),
    rows = its layer's per-layer statistics of `aux`.

    groups: in layer order, (module, count, stacked) where module is a decoder layer with the
    MoE block at `.mlp` (count 1, stacked False) or a scanned stack of `count` of them (stacked
    True: its state has a leading [count] axis; the method runs under vmap over it). Only
    layers holding an MoE block may be listed."""
    rows, i = per_layer(aux), 0
    for module, count, stacked in groups:
        if not stacked:
            getattr(module.mlp, method)({k: v[i] for k, v in rows.items()})  # type: ignore[attr-defined]
        else:
            graphdef, state = nnx.split(module)

            def one(st: Any, m: Aux, graphdef: Any = graphdef) -> Any:
                layer = nnx.merge(graphdef, st)
                getattr(layer.mlp, method)(m)
                return nnx.state(layer)

            mine = {k: v[i : i + count] for k, v in rows.items()}
            nnx.update(module, jax.vmap(one)(state, mine))
        i += count
