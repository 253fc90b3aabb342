"""DeepSeek-V3 config.json both ways (models/deepseek_v3/hf.py): transformers 5's spelling and
the released one read to the same config; DeepSeek-V3, Kimi K2 and Moonlight as published;
export writes what reads back; what the architecture differs in fails naming the field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moetext.errors import ConfigError
from moetext.models.deepseek_v3.hf import config_from_hf, config_to_hf, fit_config, tensor_map

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"

# Published config.json fields (huggingface.co deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct,
# moonshotai/Moonlight-16B-A3B), the ones the family reads and checks.
YARN = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "aux_loss_alpha": 0.001,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": YARN,
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}
KIMI_K2 = {
    **DEEPSEEK_V3,
    "model_type": "kimi_k2",
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
    "n_group": 1,
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "topk_group": 1,
    "vocab_size": 163840,
}
MOONLIGHT = {
    **{k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"},
    "first_k_dense_replace": 1,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "max_position_embeddings": 8192,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": None,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446,
    "topk_group": 1,
    "vocab_size": 163840,
}


def _fixture_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def test_both_spellings_read_to_the_same_config():
    t5 = _fixture_config("deepseek_v3_t5")  # rope_parameters, dtype, as transformers 5 writes
    released = _fixture_config("deepseek_v3_fp8")  # rope_scaling type yarn, rope_theta, ...
    assert "rope_parameters" in t5 and "rope_scaling" in released and "dtype" in t5
    m, moe, dtype = config_from_hf(t5)
    assert (m, moe) == config_from_hf(released)[:2]
    assert (dtype, config_from_hf(released)[2]) == ("float32", "bfloat16")
    # Every feature the fixture turns on is read.
    assert m.family == "deepseek_v3" and m.q_lora_rank == 24 and m.kv_lora_rank == 16
    assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (8, 8, 8)
    assert m.rope_interleave and m.first_k_dense_replace == 1 and m.mtp_layers == 1
    assert (m.yarn_factor, m.yarn_original_max_position_embeddings) == (40.0, 4096)
    assert (m.yarn_mscale, m.yarn_mscale_all_dim, m.yarn_beta_fast) == (0.8, 1.0, 32.0)
    assert (moe.router, moe.n_group, moe.topk_group, moe.num_experts) == ("sigmoid_topk", 4, 2, 8)
    assert (moe.routed_scaling_factor, moe.num_shared_experts, moe.norm_topk_prob) == (
        2.5,
        1,
        True,
    )


@pytest.mark.parametrize("published", [DEEPSEEK_V3, KIMI_K2, MOONLIGHT])
def test_published_configs_read_and_export_to_what_reads_back(published):
    m, moe, dtype = config_from_hf(published)
    out = config_to_hf(m, moe, dtype)
    assert config_from_hf(out) == (m, moe, dtype)
    # Export writes the released spelling, model_type deepseek_v3 (transformers reads it natively).
    assert out["model_type"] == "deepseek_v3" and out["torch_dtype"] == "bfloat16"
    assert (out["topk_method"], out["scoring_func"], out["moe_layer_freq"]) == (
        "noaux_tc",
        "sigmoid",
        1,
    )
    for key in ("n_routed_experts", "n_shared_experts", "num_nextn_predict_layers", "n_group"):
        assert out[key] == published[key]
    if published["rope_scaling"] is None:
        assert out["rope_scaling"] is None and m.yarn is None
    else:
        assert out["rope_scaling"]["type"] == "yarn"
        assert out["max_position_embeddings"] == published["max_position_embeddings"]
        for key, value in published["rope_scaling"].items():
            assert out["rope_scaling"][key] == value, key


def test_published_shapes():
    v3, v3_moe, _ = config_from_hf(DEEPSEEK_V3)
    assert (v3.num_layers, v3.q_lora_rank, v3.mtp_layers, v3.yarn_factor) == (61, 1536, 1, 40.0)
    assert (v3_moe.num_experts, v3_moe.n_group, v3_moe.topk_group) == (256, 8, 4)
    kimi, kimi_moe, _ = config_from_hf(KIMI_K2)
    assert (kimi.num_heads, kimi_moe.num_experts, kimi_moe.n_group, kimi.mtp_layers) == (
        64,
        384,
        1,
        0,
    )
    moon, moon_moe, _ = config_from_hf(MOONLIGHT)
    assert moon.q_lora_rank is None and moon.yarn is None and moon.rms_norm_eps == 1e-5
    assert (moon_moe.num_shared_experts, moon_moe.shared_intermediate_size) == (2, 0)
    # Moonlight's plain query projection and two shared experts, as tensors.
    names = {n for t in tensor_map(moon, moon_moe) for n in t.hf_names}
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("q_a_proj" in n for n in names)
    shared = [t for t in tensor_map(moon, moon_moe) if t.path[-2:] == ("shared", "w_gate")]
    assert shared[0].hf_shape == (2 * 1408, 2048)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            {"topk_method": "group_limited_greedy", "scoring_func": "softmax"},
            r"topk_method='group_limited_greedy' is not supported \(DeepSeek-V3 needs "
            r"'noaux_tc': DeepSeek-V2's",
        ),
        ({"scoring_func": "softmax"}, r"scoring_func='softmax' is not supported"),
        ({"moe_layer_freq": 2}, r"moe_layer_freq=2 is not supported"),
        ({"attention_bias": True}, r"attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"num_key_value_heads": 8}, r"num_key_value_heads=8 != num_attention_heads=128"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope type 'linear'"),
        (
            {"rope_scaling": {**YARN, "attention_factor": 1.5}},
            r"rope attention_factor=1.5 is not supported",
        ),
        ({"model_type": "deepseek_v2"}, r"model_type='deepseek_v2'.*reads model_type "),
        ({"architectures": ["DeepseekV2ForCausalLM"]}, r"architectures=\['DeepseekV2"),
        ({"kv_lora_rank": None}, r"config.json has none of kv_lora_rank"),
    ],
)
def test_what_deepseek_v3_does_not_describe_fails_naming_the_field(edit, match):
    with pytest.raises(ConfigError, match=match):
        config_from_hf({**DEEPSEEK_V3, **edit})


def test_export_refuses_routing_with_no_hf_equivalent():
    m, moe, _ = config_from_hf(DEEPSEEK_V3)
    for edit, match in (
        ({"router": "softmax_topk"}, r"moe\.router='softmax_topk'"),
        ({"routing_override": "balanced"}, r"moe\.routing_override='balanced'"),
        ({"shared_intermediate_size": 1024}, r"moe\.shared_intermediate_size=1024"),
    ):
        bad = dataclasses.replace(moe, **edit)
        with pytest.raises(ConfigError, match=match + r".*no HF equivalent"):
            config_to_hf(m, bad, "bfloat16")


def test_mtp_layers_fit_what_the_checkpoint_stores():
    m, moe, _ = config_from_hf(DEEPSEEK_V3)
    main = [n for t in tensor_map(dataclasses.replace(m, mtp_layers=0), moe) for n in t.hf_names]
    # transformers saves no MTP layer though its config.json announces one: MTP off, a warning.
    fitted = fit_config(m, moe, main)
    assert fitted.model.mtp_layers == 0
    assert fitted.warnings == (
        "config.json num_nextn_predict_layers=1 but the checkpoint stores no MTP layer "
        "(model.layers.61.*): converting with model.mtp_layers=0",
    )
    # A checkpoint that stores it keeps it, without a word.
    stored = fit_config(m, moe, [*main, "model.layers.61.eh_proj.weight"])
    assert stored.model.mtp_layers == 1 and not stored.warnings
    # The MTP layer's tensors, as released, are listed after the decoder's, with the copies.
    mtp = [t for t in tensor_map(m, moe) if t.path[0] == "mtp"]
    names = {n for t in mtp for n in t.hf_names}
    assert {"model.layers.61.eh_proj.weight", "model.layers.61.mlp.gate.weight"} <= names
    assert all(n.startswith("model.layers.61.") for n in names)
    eh = next(t for t in mtp if t.path[-1] == "eh_proj")
    assert (eh.shape, eh.hf_shape) == ((2 * 7168, 7168), (7168, 2 * 7168))
    copies = {c for t in tensor_map(m, moe) for c in t.copies}
    assert copies == {
        "model.layers.61.embed_tokens.weight",
        "model.layers.61.shared_head.head.weight",
    }


def test_unset_yarn_mscale_keeps_transformers_attention_factor():
    # transformers: cos/sin x mscale(factor, mscale) / mscale(factor, mscale_all_dim) only when
    # both are set, else x mscale(factor, 1) = 0.1 ln(40) + 1.
    from moetext.models.deepseek_v3.rope import yarn_attention_factor

    no_mscale = {k: v for k, v in YARN.items() if k != "mscale"}
    m, _, _ = config_from_hf({**DEEPSEEK_V3, "rope_scaling": no_mscale})
    assert m.yarn is not None
    assert yarn_attention_factor(m.yarn) == pytest.approx(0.1 * np.log(40) + 1, rel=1e-12)
    m, _, _ = config_from_hf(DEEPSEEK_V3)  # mscale = mscale_all_dim = 1: the ratio, 1
    assert m.yarn is not None and yarn_attention_factor(m.yarn) == 1.0
