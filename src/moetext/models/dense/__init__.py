"""Dense Qwen3: the qwen3_moe decoder with every layer a SwiGLU of width mlp_dim (no router,
no experts; the moe section of the config is unused)."""

from __future__ import annotations

from flax import nnx

from moetext.config.schema import KernelsConfig, ModelConfig, MoEConfig
from moetext.models.family import ModelFamily, ParamCounts, register_family
from moetext.models.qwen3_moe import LOGICAL_AXES
from moetext.models.qwen3_moe.flops import decoder_flops_per_token, decoder_param_counts
from moetext.models.qwen3_moe.model import Decoder, stack_layers, unstack_layers


def _pattern(m: ModelConfig) -> tuple[bool, ...]:
    return (False,) * m.num_layers


def _build(m: ModelConfig, moe: MoEConfig, k: KernelsConfig, rngs: nnx.Rngs) -> Decoder:
    return Decoder(m, moe, k, moe_pattern=_pattern(m), rngs=rngs)


def _count(m: ModelConfig, moe: MoEConfig) -> ParamCounts:
    return decoder_param_counts(m, moe, _pattern(m))


def _flops(m: ModelConfig, moe: MoEConfig, seq_len: int) -> float:
    return decoder_flops_per_token(m, moe, seq_len, _pattern(m))


FAMILY = register_family(
    ModelFamily(
        name="dense",
        description="dense Qwen3 decoder: GQA + qk-norm, every layer a SwiGLU",
        build=_build,
        moe_layers=_pattern,
        count_params=_count,
        flops_per_token=_flops,
        logical_axes=LOGICAL_AXES - {"exp", "mlp_moe"},
        stack_layers=lambda p, m: stack_layers(p, _pattern(m)),
        unstack_layers=lambda p, m: unstack_layers(p, _pattern(m)),
    )
)
