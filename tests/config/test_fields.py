"""Every config field declares what a checkpoint's config must match (config/fields.py), and the
declarations are the rules resume and params loading have always applied."""

import dataclasses
import os

import pytest

from moetext.config import Config, ModelConfig, fields

# The fields that decide a parameter's shape or meaning (loaded params must match them).
SHAPES_PARAMS = {
    *(
        f"model.{k}"
        for k in (
            "family",
            "vocab_size",
            "emb_dim",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "mlp_dim",
            "rope_theta",
            "rms_norm_eps",
            "qk_norm",
            "attention_bias",  # adds the q/k/v bias params
            "tie_embeddings",
            "decoder_sparse_step",
            "mlp_only_layers",
        )
    ),
    *(
        f"moe.{k}"
        for k in (
            "num_experts",
            "num_experts_per_tok",
            "router",  # the params' meaning: which router reads the router weight
            "moe_intermediate_size",
            "norm_topk_prob",
            "num_shared_experts",
            "shared_intermediate_size",
            "shared_expert_gate",  # adds the shared gate's param
        )
    ),
}
# The fields a resumed run may change (every other one must match, but optim.clip_norm).
RESUME_SAFE = {
    *(
        f"train.{k}"
        for k in (
            "steps",
            "run_dir",
            "log_every",
            "eval_every",
            "peak_tflops",
            "progress_bar",
            "tensorboard",
            "skip_nonfinite_steps",
            "profile_steps",
            "profile_processes",
            "grad_accum_steps",
            "routing_trace",
            "log_batch_hash",
            "compilation_cache_dir",
        )
    ),
    *(
        f"checkpoint.{k}"
        for k in ("enabled", "every", "keep", "async_save", "resume", "load_params_from")
    ),
    *(
        f"optim.{k}"
        for k in (
            "learning_rate",
            "warmup_steps",
            "decay_steps",
            "min_lr_ratio",
            "b1",
            "b2",
            "eps",
            "weight_decay",
        )
    ),
    "moe.aux_loss_weight",
    "moe.z_loss_weight",
    "moe.ep_buffer_factor",
    "moe.bias_update_rate",
    "moe.initial_bias",
    "model.remat_policy",
    "model.attention_kernel",
    "model.loss_chunk_size",
    "model.loss_chunks",
    *(
        f"kernels.{k}"
        for k in (
            "gmm_backend",
            "checked",
            "tiling",
            "quantization",
            "recipe",
            "fuse_gate_up",
            "grad_reduce_dtype",
            "decode_moe",
        )
    ),
    *(f"data.{k}" for k in ("data_dir", "prefetch", "eval_split", "eval_batches")),
    *(f"sharding.{k}" for k in ("preset", "mesh", "dcn_mesh")),
    *(
        f"distributed.{k}"
        for k in (
            "initialize",
            "coordinator_address",
            "num_processes",
            "process_id",
            "initialization_timeout_s",
        )
    ),
}


def _declared() -> dict[str, fields.Declaration | None]:
    return {name: fields.declaration(f) for name, f, _ in fields.leaves(Config())}


def test_every_field_of_every_section_declares_its_checkpoint_rule():
    assert fields.undeclared(Config()) == [], (
        "declare these fields with moetext.config.fields (shapes_params, must_match, "
        "resume_safe or resume_safe_if)"
    )


def test_a_field_without_a_declaration_is_found_in_a_nested_subclass() -> None:
    @dataclasses.dataclass(frozen=True)
    class Extra(ModelConfig):
        plain: int = 0
        declared: int = fields.shapes_params(1)

    @dataclasses.dataclass(frozen=True)
    class Outer:
        model: Extra = dataclasses.field(default_factory=Extra)

    assert fields.undeclared(Outer()) == ["model.plain"]


def test_the_declarations_are_the_rules_resume_and_params_loading_apply():
    declared = _declared()
    assert {k for k, d in declared.items() if d and d.params} == SHAPES_PARAMS
    assert {k for k, d in declared.items() if d and d.resume == "safe"} == RESUME_SAFE
    conditional = {k: d for k, d in declared.items() if d and callable(d.resume)}
    assert set(conditional) == {"optim.clip_norm", "data.tokenizer"}
    clip = conditional["optim.clip_norm"]
    assert clip.resume_allows(1.0, 0.5) and clip.resume_allows(None, None)
    assert not clip.resume_allows(1.0, None) and not clip.resume_allows(None, 1.0)
    # A checkpoint saved before paths were resolved at load recorded the path as typed.
    tok = conditional["data.tokenizer"]
    assert tok.resume_allows("tok/a.model", os.path.abspath("tok/a.model"))
    assert tok.resume_allows("~/a.model", os.path.expanduser("~/a.model"))
    assert tok.resume_allows(None, None) and not tok.resume_allows(None, "/t/a.model")
    assert not tok.resume_allows("tok/a.model", os.path.abspath("tok/b.model"))
    for name in SHAPES_PARAMS:
        assert not declared[name].resume_allows(1, 2), name


@pytest.mark.parametrize(
    ("maker", "resume", "params"),
    [
        (fields.shapes_params, "must_match", True),
        (fields.must_match, "must_match", False),
        (fields.resume_safe, "safe", False),
    ],
)
def test_each_helper_keeps_the_default_or_factory(maker, resume, params) -> None:
    @dataclasses.dataclass(frozen=True)
    class Section:
        n: int = maker(3)
        d: dict = maker(default_factory=dict)

    a, b = Section(), Section()
    assert a.n == 3 and a.d == {} and a.d is not b.d
    for f in dataclasses.fields(Section):
        assert fields.declaration(f) == fields.Declaration(resume, params=params)
