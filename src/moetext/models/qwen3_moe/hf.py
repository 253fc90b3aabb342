"""Hugging Face Qwen3-MoE / Qwen2-MoE <-> moetext: config.json fields and the tensor name map.

`config_from_hf(config_json)` reads both spellings of config.json (released Qwen3 checkpoints:
`num_experts`, `rope_theta`, `torch_dtype`; transformers 5: `num_local_experts`,
`rope_parameters.rope_theta`, `dtype`); `config_to_hf` writes the released spelling.

`tensor_map(model_cfg, moe_cfg)` lists, for every parameter of the *unscanned* Decoder (path in
its nnx state, e.g. ("layers", 3, "attn", "w_q")), the HF tensors it is made of and how
(`models.hf.Tensor`). `HF` is the family's adapter (`ModelFamily.hf`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moetext.config.schema import ModelConfig, MoEConfig
from moetext.errors import ConfigError
from moetext.models.hf import HfAdapter, ParamPath, Tensor, hf_dtype
from moetext.models.qwen3_moe.config import QwenModelConfig, QwenMoEConfig, qwen_sections
from moetext.models.qwen3_moe.model import moe_layer_pattern

# model_type -> architecture. Qwen2-MoE is this decoder without q/k norm, with q/k/v bias and a
# sigmoid-gated shared expert (QwenModelConfig.attention_bias, QwenMoEConfig.shared_expert_gate).
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def tensor_map(m: QwenModelConfig, moe: QwenMoEConfig) -> list[Tensor]:
    """Every parameter of the unscanned qwen3_moe Decoder with its HF tensors."""
    d, n, kv, h, v = m.emb_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size
    e, f = moe.num_experts, moe.moe_intermediate_size
    out = [Tensor(("embed",), ("model.embed_tokens.weight",), (v, d), "same")]
    for i, is_moe in enumerate(moe_layer_pattern(m)):
        hf, me = f"model.layers.{i}", ("layers", i)
        attn = f"{hf}.self_attn"
        out += [
            Tensor((*me, "attn", "w_q"), (f"{attn}.q_proj.weight",), (d, n, h), "heads_in"),
            Tensor((*me, "attn", "w_k"), (f"{attn}.k_proj.weight",), (d, kv, h), "heads_in"),
            Tensor((*me, "attn", "w_v"), (f"{attn}.v_proj.weight",), (d, kv, h), "heads_in"),
            Tensor((*me, "attn", "w_o"), (f"{attn}.o_proj.weight",), (n, h, d), "heads_out"),
            Tensor((*me, "attn_norm", "scale"), (f"{hf}.input_layernorm.weight",), (d,), "same"),
            Tensor(
                (*me, "mlp_norm", "scale"), (f"{hf}.post_attention_layernorm.weight",), (d,), "same"
            ),
        ]
        if m.attention_bias:
            for which, heads in (("q", n), ("k", kv), ("v", kv)):
                bias: ParamPath = (*me, "attn", f"b_{which}")
                out.append(Tensor(bias, (f"{attn}.{which}_proj.bias",), (heads, h), "bias_heads"))
        if m.qk_norm:
            for which in ("q_norm", "k_norm"):
                norm: ParamPath = (*me, "attn", which, "scale")
                out.append(Tensor(norm, (f"{attn}.{which}.weight",), (h,), "same"))
        if is_moe:
            out.append(
                Tensor((*me, "mlp", "router", "w"), (f"{hf}.mlp.gate.weight",), (d, e), "linear")
            )
            for ours, theirs, shape in (
                ("w_gate", "gate_proj", (e, d, f)),
                ("w_up", "up_proj", (e, d, f)),
                ("w_down", "down_proj", (e, f, d)),
            ):
                names = tuple(f"{hf}.mlp.experts.{j}.{theirs}.weight" for j in range(e))
                out.append(Tensor((*me, "mlp", "experts", ours), names, shape, "experts"))
            if moe.num_shared_experts:
                width = moe.num_shared_experts * (
                    moe.shared_intermediate_size or moe.moe_intermediate_size
                )
                for ours, theirs, shape2 in (
                    ("w_gate", "gate_proj", (d, width)),
                    ("w_up", "up_proj", (d, width)),
                    ("w_down", "down_proj", (width, d)),
                ):
                    names2 = (f"{hf}.mlp.shared_expert.{theirs}.weight",)
                    out.append(Tensor((*me, "mlp", "shared", ours), names2, shape2, "linear"))
            if moe.shared_expert_gate:
                names2 = (f"{hf}.mlp.shared_expert_gate.weight",)
                out.append(Tensor((*me, "mlp", "shared_gate"), names2, (d, 1), "linear"))
        else:
            for ours, theirs, shape2 in (
                ("w_gate", "gate_proj", (d, m.mlp_dim)),
                ("w_up", "up_proj", (d, m.mlp_dim)),
                ("w_down", "down_proj", (m.mlp_dim, d)),
            ):
                out.append(
                    Tensor((*me, "mlp", ours), (f"{hf}.mlp.{theirs}.weight",), shape2, "linear")
                )
    out.append(Tensor(("final_norm", "scale"), ("model.norm.weight",), (d,), "same"))
    if not m.tie_embeddings:
        out.append(Tensor(("lm_head",), ("lm_head.weight",), (v, d), "same"))
    return out


# --- config.json ------------------------------------------------------------------------------


def _get(hf: Mapping[str, Any], *names: str, default: Any = None, required: bool = True) -> Any:
    for name in names:
        if name in hf:
            return hf[name]
    if required and default is None:
        raise ConfigError(f"config.json has none of {', '.join(names)} (a Qwen3-MoE field)")
    return default


def rope_theta(hf: Mapping[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    kind = (params or {}).get("rope_type", "default")
    if (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")) or (
        kind != "default"
    ):
        raise ConfigError(
            f"config.json rope scaling {scaling or params!r} is not supported (plain RoPE only)"
        )
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    return float(theta)


def config_from_hf(hf: Mapping[str, Any]) -> tuple[QwenModelConfig, QwenMoEConfig, str]:
    """(model, moe, stored dtype) from a Qwen3-MoE or Qwen2-MoE config.json; unsupported values
    and architectures fail naming the field."""
    kind = hf.get("model_type")
    arch = hf.get("architectures") or []
    if kind not in ARCHITECTURES or any(a != ARCHITECTURES[kind] for a in arch):
        supported = ", ".join(f"{k} ({v})" for k, v in ARCHITECTURES.items())
        raise ConfigError(
            f"config.json describes model_type={kind!r} architectures={arch}; supported: "
            f"{supported}"
        )
    qwen2 = kind == "qwen2_moe"
    unsupported = {
        "use_sliding_window": (hf.get("use_sliding_window", False), False),
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
    }
    if not qwen2:  # Qwen3-MoE's attention_bias would also put a bias on o_proj
        unsupported["attention_bias"] = (hf.get("attention_bias", False), False)
    for field, (got, want) in unsupported.items():
        if got != want:
            raise ConfigError(f"config.json {field}={got!r} is not supported (needs {want!r})")
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if qwen2 else 0
    model = QwenModelConfig(
        family="qwen3_moe",
        vocab_size=int(hf["vocab_size"]),
        emb_dim=hidden,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(_get(hf, "num_key_value_heads", default=heads)),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        mlp_dim=int(hf["intermediate_size"]),
        rope_theta=rope_theta(hf),
        rms_norm_eps=float(hf["rms_norm_eps"]),
        qk_norm=not qwen2,
        attention_bias=bool(hf.get("qkv_bias", True)) if qwen2 else False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
    )
    moe = QwenMoEConfig(
        num_experts=int(_get(hf, "num_experts", "num_local_experts")),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        num_shared_experts=1 if shared else 0,
        shared_intermediate_size=shared,
        shared_expert_gate=bool(shared),
        aux_loss_weight=float(hf.get("router_aux_loss_coef", QwenMoEConfig.aux_loss_weight)),
    )
    return model, moe, hf_dtype(hf)


def hf_model_type(m: QwenModelConfig, moe: QwenMoEConfig) -> str:
    """qwen3_moe or qwen2_moe, whichever describes the model exactly; else a ConfigError."""
    qwen3 = m.qk_norm and not m.attention_bias and not moe.num_shared_experts
    qwen2 = (
        not m.qk_norm
        and moe.num_shared_experts <= 1
        and moe.shared_expert_gate == bool(moe.num_shared_experts)
        and m.head_dim * m.num_heads == m.emb_dim
    )
    if m.family != "qwen3_moe" or not (qwen3 or qwen2):
        raise ConfigError(
            f"model.family={m.family!r} qk_norm={m.qk_norm} attention_bias={m.attention_bias} "
            f"moe.num_shared_experts={moe.num_shared_experts} "
            f"shared_expert_gate={moe.shared_expert_gate} head_dim={m.head_dim} is neither "
            "Qwen3MoeForCausalLM (qk_norm, no bias, no shared experts) nor Qwen2MoeForCausalLM "
            "(no qk_norm, at most one gated shared expert, head_dim = emb_dim / num_heads)"
        )
    return "qwen3_moe" if qwen3 else "qwen2_moe"


# The routing Qwen's HF architectures compute (softmax, top-k over all experts, unscaled
# weights): any other value of these fields routes tokens the exported model would not.
HF_ROUTING = {
    "router": "softmax_topk",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "routing_override": "none",
}


def check_hf_routing(moe: MoEConfig) -> None:
    """ConfigError naming every moe field whose routing Qwen's HF models cannot express."""
    bad = [f"moe.{k}={getattr(moe, k)!r}" for k, v in HF_ROUTING.items() if getattr(moe, k) != v]
    if bad:
        want = ", ".join(f"{k}={v!r}" for k, v in HF_ROUTING.items())
        raise ConfigError(
            f"{', '.join(bad)}: Qwen's Hugging Face models route by softmax top-k over all "
            f"experts ({want}); this model has no HF equivalent to export to"
        )


def config_to_hf(m: QwenModelConfig, moe: QwenMoEConfig, dtype: str) -> dict[str, Any]:
    """config.json in the spelling of the released Qwen3-MoE / Qwen2-MoE checkpoints."""
    check_hf_routing(moe)
    kind = hf_model_type(m, moe)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": m.vocab_size,
        "hidden_size": m.emb_dim,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.mlp_dim,
        "rope_theta": m.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": m.rms_norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "decoder_sparse_step": m.decoder_sparse_step,
        "mlp_only_layers": list(m.mlp_only_layers),
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "router_aux_loss_coef": moe.aux_loss_weight,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "torch_dtype": dtype,
    }
    if kind == "qwen3_moe":
        out["attention_bias"] = False
    else:
        del out["head_dim"]
        out["qkv_bias"] = m.attention_bias
        out["shared_expert_intermediate_size"] = moe.shared_intermediate_size or (
            moe.moe_intermediate_size if moe.num_shared_experts else 0
        )
    return out


def _config_to_hf(m: ModelConfig, moe: MoEConfig, dtype: str) -> dict[str, Any]:
    return config_to_hf(*qwen_sections(m, moe), dtype)


def _tensor_map(m: ModelConfig, moe: MoEConfig) -> list[Tensor]:
    return tensor_map(*qwen_sections(m, moe))


HF = HfAdapter(
    model_types=tuple(ARCHITECTURES),
    config_from_hf=config_from_hf,
    config_to_hf=_config_to_hf,
    tensor_map=_tensor_map,
)
