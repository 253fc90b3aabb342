"""Writes the Hugging Face fixtures of tests/convert/ (run by hand, not by CI): Qwen3-MoE,
Qwen2-MoE and DeepSeek-V3.

Needs torch and transformers, which moetext itself never imports; use a separate venv:

    python3.11 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install --no-deps 'torch==2.13.*'
    /tmp/hfvenv/bin/pip install filelock sympy networkx jinja2 fsspec typing-extensions \
        transformers==5.23.0 safetensors numpy
    /tmp/hfvenv/bin/python scripts/make_hf_fixture.py [--out tests/fixtures/hf] [--only NAME ...]

Each fixture is a tiny random Qwen3MoeForCausalLM (one Qwen2MoeForCausalLM) saved by
`save_pretrained` (config.json + safetensors) with `input_ids.npy` [2, 12] and the float32
eager-attention logits of those ids, `logits.npy` [2, 12, V]. The configurations cover: a dense
first layer (mlp_only_layers), decoder_sparse_step 2, norm_topk_prob true and false,
head_dim != hidden_size / heads, tied and untied embeddings, one file and sharded files with an
index, Qwen2-MoE's q/k/v bias and sigmoid-gated shared expert, and both config.json spellings
(transformers 5 as written; `released` is rewritten as the released Qwen3 checkpoints spell it:
num_experts, rope_theta, torch_dtype).

`qwen3_chat` is a model to fine-tune (end_to_end/cpu/run_all.sh stage f): tiny-qwen3-moe's shape
with the chat tokenizer fixture's files beside it (vocab_size 416 for its 400 pieces),
transformers' own initialisation (not scaled up), bfloat16 safetensors as Qwen releases them;
its logits.npy are float32 logits of the bfloat16-rounded weights.

DeepSeek-V3 (scripts/make_deepseek_fixture.py): `deepseek_v3_t5`, a tiny random
DeepseekV3ForCausalLM with q_lora, YaRN (mscale != mscale_all_dim), interleaved RoPE, a dense
first layer, group-limited routing with a non-zero e_score_correction_bias and a shared expert,
saved by transformers 5 (float32) plus a random MTP layer as released checkpoints store it
(`model.layers.{num_hidden_layers}.*`); `deepseek_v3_fp8`, its twin as DeepSeek releases weights:
the projections block-scaled float8_e4m3fn with weight_scale_inv in 4 x 6 blocks (several per
tensor, partial ones at the edges), the rest bfloat16, config.json in the released spelling;
its logits are transformers' on the dequantized weights.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

FIXTURES = {
    # transformers 5 spelling, one file, dense first layer, head_dim 16 != 32 / 4, no renorm.
    "dense_first_t5": dict(
        config=dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            mlp_only_layers=[0],
            norm_topk_prob=False,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
        released=False,
        shard=None,
    ),
    # released spelling, sharded, sparse step 2, renormalised top-k, tied embeddings.
    "sparse_step_released": dict(
        config=dict(
            vocab_size=80,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        released=True,
        shard="40KB",
    ),
    # Qwen2-MoE: q/k/v bias, no q/k norm, one sigmoid-gated shared expert, dense layer 1.
    "qwen2_shared_expert": dict(
        arch="qwen2",
        config=dict(
            vocab_size=72,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
        released=False,
        shard=None,
    ),
    # A model to fine-tune (end_to_end/cpu/run_all.sh stage f): tiny-qwen3-moe's shape with a
    # vocabulary for the chat tokenizer fixture (400 pieces, padded to 416 as Qwen pads its
    # own), that tokenizer's files beside it, transformers' initialisation left as it is
    # (std 0.02: a fresh model, not the scaled-up parity weights), stored in bfloat16 as the
    # released checkpoints are; logits.npy are float32 logits of the bfloat16 weights.
    "qwen3_chat": dict(
        config=dict(
            vocab_size=416,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=2,  # <|im_end|>, as the instruct model's config.json
            pad_token_id=0,
        ),
        released=False,
        shard=None,
        fresh=True,
        dtype="bfloat16",
        tokenizer="chat_tokenizer",
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def released_spelling(cfg: dict) -> dict:
    """config.json as the released Qwen3-MoE checkpoints (transformers 4.x) spell it."""
    cfg = dict(cfg)
    cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def make(name: str, spec: dict, out: Path) -> None:
    torch.manual_seed(sum(map(ord, name)))
    qwen2 = spec.get("arch") == "qwen2"
    config_cls, model_cls = (
        (Qwen2MoeConfig, Qwen2MoeForCausalLM) if qwen2 else (Qwen3MoeConfig, Qwen3MoeForCausalLM)
    )
    model = model_cls(config_cls(**spec["config"], attn_implementation="eager"))
    if not spec.get("fresh"):
        # Random init is ~N(0, 0.02): scale up so routing and logits are far from uniform.
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim > 1:
                    p.mul_(10.0)
                else:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.eval()
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    for f in d.iterdir():
        f.unlink()
    kwargs = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
    if spec.get("dtype") == "bfloat16":
        # Saved in bfloat16; the logits below are float32 ones of the rounded weights (rounded
        # in place: casting the model back and forth would also round RoPE's inv_freq buffer).
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(d, **kwargs)
    else:
        model.save_pretrained(d, **kwargs)
    if spec.get("tokenizer"):
        src = out / spec["tokenizer"]
        vocab = json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]
        assert len(vocab) <= spec["config"]["vocab_size"], (len(vocab), name)
        for fname in TOKENIZER_FILES:
            (d / fname).write_bytes((src / fname).read_bytes())
    (d / "generation_config.json").unlink(missing_ok=True)
    if spec["released"]:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(released_spelling(cfg), indent=2) + "\n")
    gen = np.random.default_rng(0)
    ids = gen.integers(0, spec["config"]["vocab_size"], size=(2, 12), dtype=np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(ids)).logits.float().numpy()
    np.save(d / "input_ids.npy", ids.astype(np.int32))
    np.save(d / "logits.npy", logits.astype(np.float32))
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"{d}: {sorted(f.name for f in d.iterdir())}, {size / 1e3:.0f} kB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/hf"))
    p.add_argument("--only", nargs="*", help="fixture names (qwen ones, deepseek, chat_tokenizer)")
    args = p.parse_args()
    want = set(args.only or [])
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    if not want or "chat_tokenizer" in want:
        # The chat tokenizer fixture (a BPE tokenizer.json, Qwen3's chat template, the ids
        # transformers renders): scripts/make_chat_fixture.py, also runnable alone. First:
        # qwen3_chat copies its files.
        from make_chat_fixture import make_chat_tokenizer

        make_chat_tokenizer(Path(args.out))
    for name, spec in FIXTURES.items():
        if not want or name in want:
            make(name, spec, Path(args.out))
    if not want or "deepseek" in want:
        from make_deepseek_fixture import make_deepseek_fixtures

        make_deepseek_fixtures(Path(args.out))


if __name__ == "__main__":
    main()
