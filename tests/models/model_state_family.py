"""A test-only model family with state outside the gradient: the default family's model with a
ModelState step counter and a running sum of its aux expert_load, both advanced by its
`update_model_state` after every optimizer step (models.ModelStateLM).

test_family.py imports it (registering the family); run as a script it is the training CLI with
the family registered, for tests that train in a subprocess:

    python tests/models/model_state_family.py CONFIG model.family=toy_counter key=value ...
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from moetext import models
from moetext.config.schema import KernelsConfig, ModelConfig, MoEConfig
from moetext.models.layers.params import make_model_state

NAME = "toy_counter"
BASE = ModelConfig().family  # the default family: its model is wrapped here


class CountingLM(nnx.Module):
    def __init__(self, m: ModelConfig, moe: MoEConfig, k: KernelsConfig, rngs: nnx.Rngs):
        base = dataclasses.replace(m, family=BASE)
        self.inner = models.build(base, moe, k, rngs=rngs)
        n_moe = sum(models.get_family(BASE).moe_layers(base))
        self.steps = make_model_state(jnp.zeros((), jnp.int32), ())
        self.load_sum = make_model_state(
            jnp.zeros((n_moe, moe.num_experts), jnp.float32), (None, "exp")
        )

    def __call__(
        self,
        tokens_BS: jax.Array,
        *,
        positions_BS: jax.Array | None = None,
        segment_ids_BS: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        logits, aux = self.inner(
            tokens_BS, positions_BS=positions_BS, segment_ids_BS=segment_ids_BS
        )
        # The forward reads the model state: the steps counted before this one, as a metric.
        return logits, {**aux, "counted_steps": self.steps.get_value().astype(jnp.float32)}

    def update_model_state(self, aux: dict[str, jax.Array]) -> None:
        self.steps.set_value(self.steps.get_value() + 1)
        self.load_sum.set_value(self.load_sum.get_value() + aux["expert_load"])


FAMILY = models.register_family(
    dataclasses.replace(
        models.get_family(BASE),
        name=NAME,
        description="test-only: the default family's model with a ModelState step counter",
        build=CountingLM,
        stack_layers=None,
        unstack_layers=None,
    ),
    replace=True,  # imported by pytest and, as __main__, by the CLI in one process at most
)

if __name__ == "__main__":
    from moetext.cli import main

    sys.exit(main())
