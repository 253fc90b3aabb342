"""Decoder building blocks: RMSNorm, RoPE, GQA attention, SwiGLU MLP."""

from moetext.models.layers.attention import Attention, attend
from moetext.models.layers.mlp import SwiGLU
from moetext.models.layers.norms import RMSNorm, rms_norm
from moetext.models.layers.params import as_dtype, make_param
from moetext.models.layers.rope import apply_rope, rope_cos_sin

__all__ = [
    "Attention",
    "RMSNorm",
    "SwiGLU",
    "apply_rope",
    "as_dtype",
    "attend",
    "make_param",
    "rms_norm",
    "rope_cos_sin",
]
