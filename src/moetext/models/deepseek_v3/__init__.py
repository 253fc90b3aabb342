"""DeepSeek-V3 family (in progress): its multi-head latent attention and RoPE.

Not registered as a model family yet (no `model.family` selects it): the decoder, MoE wiring,
HF adapter and configs come next. Import the layer from here or from its modules.
"""

from moetext.models.deepseek_v3.mla import MLA, MLACache, MLAConfig
from moetext.models.deepseek_v3.rope import Yarn

__all__ = ["MLA", "MLACache", "MLAConfig", "Yarn"]
