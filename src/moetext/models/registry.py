"""Model families by name: `build(model_cfg, moe_cfg, kernels_cfg, rngs=...)` picks the builder.

A family is a function (model_cfg, moe_cfg, kernels_cfg, rngs) -> nnx.Module whose __call__ is
`(tokens_BS, *, positions_BS=None, segment_ids_BS=None) -> (logits_BSV float32, aux dict)`
(see Decoder). Adding one is one `register_family` call.
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from moetext.config.schema import KernelsConfig, ModelConfig, MoEConfig
from moetext.models.decoder import Decoder, moe_layer_pattern

Builder = Callable[[ModelConfig, MoEConfig, KernelsConfig, nnx.Rngs], nnx.Module]
_FAMILIES: dict[str, Builder] = {}


def register_family(name: str, builder: Builder) -> None:
    _FAMILIES[name] = builder


def available_families() -> list[str]:
    return sorted(_FAMILIES)


def build(
    model_cfg: ModelConfig, moe_cfg: MoEConfig, kernels_cfg: KernelsConfig, *, rngs: nnx.Rngs
) -> nnx.Module:
    """The model of `model_cfg.family`, with params initialised from `rngs` (stream "params")."""
    if model_cfg.family not in _FAMILIES:
        raise ValueError(
            f"unknown model family {model_cfg.family!r}; valid names: "
            f"{', '.join(available_families())}"
        )
    return _FAMILIES[model_cfg.family](model_cfg, moe_cfg, kernels_cfg, rngs)


def _qwen3_moe(model_cfg, moe_cfg, kernels_cfg, rngs):
    pattern = moe_layer_pattern(model_cfg)
    return Decoder(model_cfg, moe_cfg, kernels_cfg, moe_pattern=pattern, rngs=rngs)


def _dense(model_cfg, moe_cfg, kernels_cfg, rngs):
    pattern = (False,) * model_cfg.num_layers
    return Decoder(model_cfg, moe_cfg, kernels_cfg, moe_pattern=pattern, rngs=rngs)


register_family("qwen3_moe", _qwen3_moe)
register_family("dense", _dense)
