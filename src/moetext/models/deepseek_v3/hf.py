"""Hugging Face DeepSeek-V3 / Kimi K2 / Moonlight <-> moetext: config.json and the tensor map.

`config_from_hf` reads config.json as the released checkpoints spell it (DeepSeek-V3/R1, Kimi K2:
`rope_scaling` with `type: yarn`, `rope_theta`, `torch_dtype`, `topk_method: noaux_tc`,
`scoring_func: sigmoid`, `n_routed_experts`, `num_nextn_predict_layers`, ...) and as
transformers 5 writes it (`rope_parameters`, `dtype`); model_type `deepseek_v3` (DeepSeek-V3,
R1, Moonlight-16B-A3B with its plain query projection, `q_lora_rank: null`) or `kimi_k2` (the
same DeepseekV3ForCausalLM). What the architecture differs in (DeepSeek-V2's softmax/greedy
routing, MoE every other layer, attention biases, ...) fails naming the field. `config_to_hf`
writes the released spelling with model_type deepseek_v3, which transformers reads natively.

`tensor_map` lists every parameter of the unscanned Decoder with its HF tensors. HF stores torch
Linear [out, in]; MLA's per-head maps are the `heads_in`/`heads_out` kinds of models/hf.py:
q_b_proj / q_proj [N * (P + R), Q or D] <-> w_q_b / w_q [Q or D, N, P + R] and kv_b_proj
[N * (P + V), C] <-> w_kv_b [C, N, P + V] (HF views the output as N heads of P + R / P + V, so
a reshape is the whole map); o_proj [D, N * V] <-> w_o [N, V, D]. The RoPE dims stay in the
order HF stores them: with rope_interleave both apply the rotation to interleaved pairs
(mla.py gathers even then odd dims, as transformers' apply_rotary_pos_emb_interleave).
Block-scaled FP8 weights are dequantized before the map reads them (convert/fp8.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from moetext.config.schema import ModelConfig, MoEConfig
from moetext.errors import ConfigError
from moetext.models.deepseek_v3.config import DeepSeekModelConfig, deepseek_model
from moetext.models.hf import Fitted, HfAdapter, ParamPath, Tensor, hf_dtype

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
"""config.json model_type values read: DeepSeek-V3/R1/V3.1 and Moonlight (deepseek_v3), Kimi K2
(kimi_k2). Export writes deepseek_v3."""

# The routing DeepseekV3ForCausalLM computes: sigmoid scores, the selection bias, group-limited
# top-k. Any other moe.router / routing_override routes tokens the exported model would not.
HF_ROUTING = {"router": "sigmoid_topk", "routing_override": "none"}
# Released spelling -> what it must be (else the architecture is another one, e.g. DeepSeek-V2).
RELEASED_ROUTING = {
    "topk_method": ("noaux_tc", "DeepSeek-V2's greedy / group_limited_greedy are softmax routing"),
    "scoring_func": ("sigmoid", "DeepSeek-V2 scores by softmax"),
    "moe_layer_freq": (1, "every layer after first_k_dense_replace is MoE"),
}


# --- config.json ------------------------------------------------------------------------------


def _need(hf: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    raise ConfigError(f"config.json has none of {', '.join(names)} (a DeepSeek-V3 field)")


def _check_architecture(hf: Mapping[str, Any]) -> None:
    kind, arch = hf.get("model_type"), hf.get("architectures") or []
    if kind not in MODEL_TYPES or any(a != ARCHITECTURE for a in arch):
        raise ConfigError(
            f"config.json describes model_type={kind!r} architectures={arch}; the deepseek_v3 "
            f"family reads model_type {' or '.join(MODEL_TYPES)} with {ARCHITECTURE}"
        )
    for field, (want, why) in RELEASED_ROUTING.items():
        got = hf.get(field, want)
        if got != want:
            raise ConfigError(
                f"config.json {field}={got!r} is not supported (DeepSeek-V3 needs {want!r}: {why})"
            )
    for field, got, want in (
        ("hidden_act", hf.get("hidden_act", "silu"), "silu"),
        ("attention_bias", hf.get("attention_bias", False), False),
        ("pretraining_tp", hf.get("pretraining_tp", 1), 1),
    ):
        if got != want:
            raise ConfigError(f"config.json {field}={got!r} is not supported (needs {want!r})")
    heads, kv = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if kv is not None and kv != heads:
        raise ConfigError(
            f"config.json num_key_value_heads={kv} != num_attention_heads={heads}: MLA has one "
            "key and value head per query head"
        )


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta and the yarn_* fields from rope_scaling (released) or rope_parameters (5.x)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    rope = {**scaling, **params}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    out: dict[str, Any] = {"rope_theta": float(theta), "yarn_factor": None}
    if kind == "default":
        return out
    if kind != "yarn":
        raise ConfigError(
            f"config.json rope type {kind!r} is not supported (DeepSeek-V3: 'yarn' or none)"
        )
    for field, want in (("attention_factor", None), ("truncate", True)):
        if rope.get(field, want) != want:
            raise ConfigError(
                f"config.json rope {field}={rope[field]!r} is not supported (needs {want!r})"
            )
    factor = rope.get("factor")
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("config.json yarn rope has no original_max_position_embeddings")
    if factor is None:  # transformers: the ratio of the context lengths
        factor = _need(hf, "max_position_embeddings") / original
    out.update(
        yarn_factor=float(factor),
        yarn_original_max_position_embeddings=int(original),
        yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
        yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
        # Unset is 0 for both, as in transformers: mscale counts only beside mscale_all_dim.
        yarn_mscale=float(rope.get("mscale") or 0.0),
        yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
    )
    return out


def config_from_hf(hf: Mapping[str, Any]) -> tuple[DeepSeekModelConfig, MoEConfig, str]:
    """(model, moe, stored dtype) from a DeepSeek-V3 / Kimi K2 / Moonlight config.json; what the
    family cannot represent fails naming the field."""
    _check_architecture(hf)
    heads = int(_need(hf, "num_attention_heads"))
    q_lora = hf.get("q_lora_rank")
    rope = _rope(hf)
    model = DeepSeekModelConfig(
        family="deepseek_v3",
        vocab_size=int(_need(hf, "vocab_size")),
        emb_dim=int(_need(hf, "hidden_size")),
        num_layers=int(_need(hf, "num_hidden_layers")),
        num_heads=heads,
        # MLA reads neither: one key/value head per query head, as the family's configs write;
        # head_dim stays at its default, as they leave it (MLA's head dims are its own fields).
        num_kv_heads=heads,
        mlp_dim=int(_need(hf, "intermediate_size")),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(_need(hf, "kv_lora_rank")),
        qk_nope_head_dim=int(_need(hf, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_need(hf, "qk_rope_head_dim")),
        v_head_dim=int(_need(hf, "v_head_dim")),
        first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        mtp_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0),
        **rope,
    )
    moe = MoEConfig(
        num_experts=int(_need(hf, "n_routed_experts", "num_local_experts")),
        num_experts_per_tok=int(_need(hf, "num_experts_per_tok")),
        router="sigmoid_topk",
        moe_intermediate_size=int(_need(hf, "moe_intermediate_size")),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        num_shared_experts=int(hf.get("n_shared_experts") or 0),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        aux_loss_weight=float(hf.get("aux_loss_alpha", MoEConfig.aux_loss_weight)),
    )
    return model, moe, hf_dtype(hf)


def check_hf_routing(moe: MoEConfig) -> None:
    """ConfigError naming every moe field DeepseekV3ForCausalLM cannot express."""
    bad = [f"moe.{k}={getattr(moe, k)!r}" for k, v in HF_ROUTING.items() if getattr(moe, k) != v]
    if moe.shared_intermediate_size not in (0, moe.moe_intermediate_size):
        bad.append(f"moe.shared_intermediate_size={moe.shared_intermediate_size}")
    if bad:
        raise ConfigError(
            f"{', '.join(bad)}: DeepseekV3ForCausalLM routes with sigmoid_topk (routing_override "
            "none) and sizes each shared expert moe_intermediate_size (shared_intermediate_size "
            "0); this model has no HF equivalent to export to"
        )


def config_to_hf(m: DeepSeekModelConfig, moe: MoEConfig, dtype: str) -> dict[str, Any]:
    """config.json in the spelling of the released DeepSeek-V3 checkpoints."""
    if m.family != "deepseek_v3":
        raise ConfigError(f"model.family={m.family!r} is not deepseek_v3")
    check_hf_routing(moe)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v3",
        "vocab_size": m.vocab_size,
        "hidden_size": m.emb_dim,
        "intermediate_size": m.mlp_dim,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "num_hidden_layers": m.num_layers,
        "num_nextn_predict_layers": m.mtp_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_heads,
        "n_shared_experts": moe.num_shared_experts,
        "n_routed_experts": moe.num_experts,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "kv_lora_rank": m.kv_lora_rank,
        "q_lora_rank": m.q_lora_rank,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "topk_method": "noaux_tc",
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_layer_freq": 1,
        "first_k_dense_replace": m.first_k_dense_replace,
        "norm_topk_prob": moe.norm_topk_prob,
        "scoring_func": "sigmoid",
        "aux_loss_alpha": moe.aux_loss_weight,
        "hidden_act": "silu",
        "rms_norm_eps": m.rms_norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": None,
        "rope_interleave": m.rope_interleave,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": m.tie_embeddings,
        "torch_dtype": dtype,
    }
    yarn = m.yarn
    if yarn is not None:
        out["max_position_embeddings"] = int(yarn.original_max_position_embeddings * yarn.factor)
        out["rope_scaling"] = {
            "type": "yarn",
            "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow,
            "mscale": yarn.mscale,
            "mscale_all_dim": yarn.mscale_all_dim,
        }
    return out


# --- tensors ----------------------------------------------------------------------------------


def _attention(m: DeepSeekModelConfig, hf: str, me: ParamPath) -> list[Tensor]:
    d, n, q = m.emb_dim, m.num_heads, m.q_lora_rank
    c, r, e, v = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_head_dim, m.v_head_dim
    attn, at = f"{hf}.self_attn", (*me, "attn")
    if q is None:
        out = [Tensor((*at, "w_q"), (f"{attn}.q_proj.weight",), (d, n, e), "heads_in")]
    else:
        out = [
            Tensor((*at, "w_q_a"), (f"{attn}.q_a_proj.weight",), (d, q), "linear"),
            Tensor((*at, "q_a_norm", "scale"), (f"{attn}.q_a_layernorm.weight",), (q,), "same"),
            Tensor((*at, "w_q_b"), (f"{attn}.q_b_proj.weight",), (q, n, e), "heads_in"),
        ]
    kv_b = (c, n, m.qk_nope_head_dim + v)
    return [
        *out,
        Tensor((*at, "w_kv_a"), (f"{attn}.kv_a_proj_with_mqa.weight",), (d, c + r), "linear"),
        Tensor((*at, "kv_a_norm", "scale"), (f"{attn}.kv_a_layernorm.weight",), (c,), "same"),
        Tensor((*at, "w_kv_b"), (f"{attn}.kv_b_proj.weight",), kv_b, "heads_in"),
        Tensor((*at, "w_o"), (f"{attn}.o_proj.weight",), (n, v, d), "heads_out"),
    ]


def _swiglu(hf: str, me: ParamPath, d: int, f: int) -> list[Tensor]:
    """A SwiGLU of width f: HF `{hf}.{gate,up,down}_proj.weight` <-> `me.w_{gate,up,down}`."""
    return [
        Tensor((*me, f"w_{w}"), (f"{hf}.{w}_proj.weight",), shape, "linear")
        for w, shape in (("gate", (d, f)), ("up", (d, f)), ("down", (f, d)))
    ]


def _moe(moe: MoEConfig, hf: str, me: ParamPath, d: int) -> list[Tensor]:
    e, f = moe.num_experts, moe.moe_intermediate_size
    out = [
        Tensor((*me, "router", "w"), (f"{hf}.gate.weight",), (d, e), "linear"),
        Tensor(
            (*me, "router", "selection_bias"),
            (f"{hf}.gate.e_score_correction_bias",),
            (e,),
            "same",
            item="model_state",
        ),
    ]
    for w, shape in (("gate", (e, d, f)), ("up", (e, d, f)), ("down", (e, f, d))):
        names = tuple(f"{hf}.experts.{j}.{w}_proj.weight" for j in range(e))
        out.append(Tensor((*me, "experts", f"w_{w}"), names, shape, "experts"))
    if moe.num_shared_experts:
        width = moe.num_shared_experts * (moe.shared_intermediate_size or f)
        out += _swiglu(f"{hf}.shared_experts", (*me, "shared"), d, width)
    return out


def decoder_layer(
    m: DeepSeekModelConfig, moe: MoEConfig, hf: str, me: ParamPath, use_moe: bool
) -> list[Tensor]:
    """One decoder layer's tensors: HF prefix `hf` (model.layers.i) <-> moetext path `me`."""
    d = m.emb_dim
    out = _attention(m, hf, me)
    out += [
        Tensor((*me, "attn_norm", "scale"), (f"{hf}.input_layernorm.weight",), (d,), "same"),
        Tensor(
            (*me, "mlp_norm", "scale"), (f"{hf}.post_attention_layernorm.weight",), (d,), "same"
        ),
    ]
    if use_moe:
        return out + _moe(moe, f"{hf}.mlp", (*me, "mlp"), d)
    return out + _swiglu(f"{hf}.mlp", (*me, "mlp"), d, m.mlp_dim)


def mtp_prefix(m: DeepSeekModelConfig, k: int) -> str:
    """HF prefix of MTP depth k (0-based): released checkpoints put it after the decoder layers."""
    return f"model.layers.{m.num_layers + k}"


def _mtp(m: DeepSeekModelConfig, moe: MoEConfig, k: int) -> list[Tensor]:
    """MTP depth k: enorm, hnorm, eh_proj ([D, 2D] torch: input embedding first), a full MoE
    decoder layer and shared_head.norm (its embed_tokens / shared_head.head are copies of the
    model's, listed on those tensors)."""
    d, hf, me = m.emb_dim, mtp_prefix(m, k), ("mtp", "depths", k)
    return [
        Tensor((*me, "enorm", "scale"), (f"{hf}.enorm.weight",), (d,), "same"),
        Tensor((*me, "hnorm", "scale"), (f"{hf}.hnorm.weight",), (d,), "same"),
        Tensor((*me, "eh_proj"), (f"{hf}.eh_proj.weight",), (2 * d, d), "linear"),
        *decoder_layer(m, moe, hf, (*me, "layer"), use_moe=True),
        Tensor(
            (*me, "shared_head", "norm", "scale"), (f"{hf}.shared_head.norm.weight",), (d,), "same"
        ),
    ]


def tensor_map(m: DeepSeekModelConfig, moe: MoEConfig) -> list[Tensor]:
    """Every parameter (and router selection bias) of the unscanned Decoder with its HF
    tensors, the MTP depths (model.mtp_layers) included."""
    d, v, depths = m.emb_dim, m.vocab_size, range(m.mtp_layers)
    embed_copies = tuple(f"{mtp_prefix(m, k)}.embed_tokens.weight" for k in depths)
    head_copies = tuple(f"{mtp_prefix(m, k)}.shared_head.head.weight" for k in depths)
    if m.tie_embeddings:  # the head is the embedding: so are its copies
        embed_copies, head_copies = embed_copies + head_copies, ()
    out = [Tensor(("embed",), ("model.embed_tokens.weight",), (v, d), "same", copies=embed_copies)]
    for i, use_moe in enumerate(m.moe_layers()):
        out += decoder_layer(m, moe, f"model.layers.{i}", ("layers", i), use_moe)
    out.append(Tensor(("final_norm", "scale"), ("model.norm.weight",), (d,), "same"))
    if not m.tie_embeddings:
        out.append(Tensor(("lm_head",), ("lm_head.weight",), (v, d), "same", copies=head_copies))
    for k in depths:
        out += _mtp(m, moe, k)
    return out


def fit_config(model: ModelConfig, moe: MoEConfig, names: Collection[str]) -> Fitted:
    """MTP as the checkpoint stores it: config.json's num_nextn_predict_layers with no
    `model.layers.{num_hidden_layers}.*` tensors (what transformers saves, its model has no MTP
    weights) converts with model.mtp_layers 0 and a warning."""
    m = deepseek_model(model)
    prefix = mtp_prefix(m, 0)
    if m.mtp_layers == 0 or any(n.startswith(prefix + ".") for n in names):
        return Fitted(m, moe)
    why = (
        f"config.json num_nextn_predict_layers={m.mtp_layers} but the checkpoint stores no MTP "
        f"layer ({prefix}.*)"
    )
    off = dataclasses.replace(m, mtp_layers=0)
    return Fitted(off, moe, warnings=(f"{why}: converting with model.mtp_layers=0",))


def _config_to_hf(m: ModelConfig, moe: MoEConfig, dtype: str) -> dict[str, Any]:
    return config_to_hf(deepseek_model(m), moe, dtype)


def _tensor_map(m: ModelConfig, moe: MoEConfig) -> list[Tensor]:
    return tensor_map(deepseek_model(m), moe)


HF = HfAdapter(
    model_types=MODEL_TYPES,
    config_from_hf=config_from_hf,
    config_to_hf=_config_to_hf,
    tensor_map=_tensor_map,
    fit_config=fit_config,
)
