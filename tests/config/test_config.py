"""Config loading: every shipped YAML, inheritance, overrides, and each user error."""

import dataclasses
from pathlib import Path

import pytest

from moetext import config
from moetext.config import Config, ConfigError, docs

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for p in (REPO / "configs").rglob("*.yml") if "sharding" not in p.parts)
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_loads(path):
    cfg = config.load(path)
    assert isinstance(cfg, Config)


def test_real_qwen3_shapes():
    a = config.load(REPO / "configs/models/qwen3-30b-a3b.yml")
    assert (a.model.num_layers, a.model.emb_dim, a.model.num_heads, a.model.num_kv_heads) == (
        48,
        2048,
        32,
        4,
    )
    assert (a.moe.num_experts, a.moe.num_experts_per_tok, a.moe.moe_intermediate_size) == (
        128,
        8,
        768,
    )
    assert a.model.vocab_size == 151936 and a.model.rope_theta == 1e7
    b = config.load(REPO / "configs/models/qwen3-235b-a22b.yml")
    assert (
        b.model.num_layers,
        b.model.emb_dim,
        b.model.num_heads,
        b.moe.moe_intermediate_size,
    ) == (94, 4096, 64, 1536)
    assert b.model.rope_theta == 5e6 and b.model.rms_norm_eps == 1e-6
    for c in (a, b):
        assert c.model.qk_norm and c.moe.norm_topk_prob and c.model.head_dim == 128


def test_bench_tiny_moe_shape():
    c = config.load(REPO / "configs/models/bench-tiny-moe.yml")
    got = (
        c.model.num_layers,
        c.model.emb_dim,
        c.model.num_heads,
        c.model.num_kv_heads,
        c.model.head_dim,
        c.moe.num_experts,
        c.moe.num_experts_per_tok,
        c.moe.moe_intermediate_size,
        c.model.vocab_size,
        c.data.seq_len,
        c.data.global_batch_size,
    )
    assert got == (2, 256, 4, 2, 64, 8, 2, 512, 32000, 256, 4)
    assert c.model.qk_norm and c.moe.norm_topk_prob and c.data.kind == "synthetic"


def test_inheritance_child_overrides_base(tmp_path):
    (tmp_path / "base.yml").write_text(
        "model:\n  emb_dim: 96\n  num_layers: 3\ntrain:\n  steps: 7\n"
    )
    (tmp_path / "child.yml").write_text("base_config: base.yml\nmodel:\n  num_layers: 5\n")
    cfg = config.load(tmp_path / "child.yml")
    assert (cfg.model.emb_dim, cfg.model.num_layers, cfg.train.steps) == (96, 5, 7)


def test_base_config_cycle_is_an_error(tmp_path):
    (tmp_path / "a.yml").write_text("base_config: b.yml\n")
    (tmp_path / "b.yml").write_text("base_config: a.yml\n")
    with pytest.raises(ConfigError, match="cycle"):
        config.load(tmp_path / "a.yml")


def test_overrides_are_typed():
    cfg = config.load(
        TINY,
        [
            "train.steps=3",
            "optim.learning_rate=1e-3",
            "train.run_dir=/tmp/x",
            "kernels.gmm_backend=ragged_dot",
            "model.qk_norm=false",
            "train.log_every=2",
            "model.mlp_only_layers=[0]",
            "optim.clip_norm=null",
            "train.peak_tflops=1",
        ],
    )
    assert cfg.train.steps == 3 and isinstance(cfg.train.steps, int)
    assert cfg.optim.learning_rate == 1e-3 and isinstance(cfg.optim.learning_rate, float)
    assert cfg.train.run_dir == "/tmp/x" and cfg.kernels.gmm_backend == "ragged_dot"
    assert cfg.model.qk_norm is False and cfg.model.mlp_only_layers == (0,)
    assert cfg.optim.clip_norm is None and cfg.train.peak_tflops == 1.0


def test_config_is_frozen() -> None:
    cfg = config.load(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 1  # type: ignore[misc]


def test_unknown_key_names_the_near_miss(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stepz'.*'train.steps'"):
        config.load(TINY, ["train.stepz=3"])
    (tmp_path / "bad.yml").write_text(f"base_config: {TINY}\nmoe:\n  num_expert: 4\n")
    with pytest.raises(ConfigError, match=r"'moe.num_expert'.*did you mean 'moe.num_experts'"):
        config.load(tmp_path / "bad.yml")
    with pytest.raises(ConfigError, match="unknown config key 'modle'.*'model'"):
        config.load(TINY, ["modle.emb_dim=3"])


def test_wrong_type_names_key_type_and_value():
    with pytest.raises(ConfigError, match=r"'train.steps': expected int, got 'many' \(str\)"):
        config.load(TINY, ["train.steps=many"])
    with pytest.raises(ConfigError, match=r"'model.qk_norm': expected bool, got 3"):
        config.load(TINY, ["model.qk_norm=3"])
    with pytest.raises(
        ConfigError, match=r"'moe.dispatch': expected one of \['dropless', 'capacity'\]"
    ):
        config.load(TINY, ["moe.dispatch=sorted"])


def test_quantization_settings_that_would_be_ignored_are_errors():
    with pytest.raises(
        ConfigError, match=r"kernels.recipe sets qag but kernels.quantization is 'none'"
    ):
        config.load(TINY, ["kernels.recipe.qag=true"])
    with pytest.raises(ConfigError, match=r"needs moe.dispatch='dropless'.*'capacity'"):
        config.load(TINY, ["kernels.quantization=fp8_blockwise", "moe.dispatch=capacity"])
    cfg = config.load(TINY, ["kernels.quantization=fp8_blockwise", "kernels.recipe.qag=true"])
    assert cfg.kernels.recipe == {"qag": True}
    with pytest.raises(
        ConfigError,
        match=r"kernels.regather_weights=true is implemented for kernels.quantization=none "
        r"only, got kernels.quantization='fp8_blockwise'",
    ):
        config.load(TINY, ["kernels.quantization=fp8_blockwise", "kernels.regather_weights=true"])
    assert config.load(TINY, ["kernels.regather_weights=true"]).kernels.regather_weights


@pytest.mark.parametrize(
    "old, new",
    [
        ("kernels.fp8_block_size=64", "kernels.recipe.block_size"),
        ("kernels.fp8_weight_block=128x128", "kernels.recipe.weight_block"),
        ("kernels.fp8_bwd_quantize=true", "kernels.recipe.bwd_quantize"),
        ("kernels.qag=true", "kernels.recipe.qag"),
    ],
)
def test_moved_keys_name_their_new_place(old, new, tmp_path):
    key, value = old.split("=")
    message = rf"config key '{key}' has moved to '{new}'"
    with pytest.raises(ConfigError, match=message):
        config.load(TINY, ["kernels.quantization=fp8_blockwise", old])
    section, field = key.split(".")
    path = tmp_path / "old.yml"
    path.write_text(f"base_config: {TINY}\n{section}:\n  {field}: {value}\n")
    with pytest.raises(ConfigError, match=message):
        config.load(path)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found: '.*nope.yml'"):
        config.load("configs/models/nope.yml")


def test_malformed_override():
    with pytest.raises(ConfigError, match="section.key=value"):
        config.load(TINY, ["train.steps"])
    with pytest.raises(ConfigError, match="must name a section and a field"):
        config.load(TINY, ["steps=3"])


def test_topk_larger_than_experts():
    with pytest.raises(ConfigError, match="num_experts_per_tok=9 exceeds moe.num_experts=8"):
        config.load(TINY, ["moe.num_experts_per_tok=9"])


def test_heads_not_divisible_by_kv_heads():
    with pytest.raises(ConfigError, match="num_heads=4 is not divisible by model.num_kv_heads=3"):
        config.load(TINY, ["model.num_kv_heads=3"])


@pytest.mark.parametrize("window", ["[3,3]", "[0,2]", "[5,2]"])
def test_profile_window_must_be_start_before_stop_from_step_1(window):
    with pytest.raises(ConfigError, match=r"train.profile_steps=\[.*\] must be \[start, stop\]"):
        config.load(TINY, [f"train.profile_steps={window}"])
    assert config.load(TINY, ["train.profile_steps=[1,2]"]).train.profile_steps == (1, 2)


def test_ep_buffer_factor_must_be_non_negative_and_dropless():
    with pytest.raises(ConfigError, match=r"moe.ep_buffer_factor must be >= 0.*got -1.0"):
        config.load(TINY, ["moe.ep_buffer_factor=-1"])
    with pytest.raises(ConfigError, match=r"ep_buffer_factor=1.25 bounds.*'capacity'"):
        config.load(TINY, ["moe.ep_buffer_factor=1.25", "moe.dispatch=capacity"])
    assert config.load(TINY, ["moe.ep_buffer_factor=1.25"]).moe.ep_buffer_factor == 1.25


def test_batch_not_divisible_by_devices():
    cfg = config.load(TINY, ["data.global_batch_size=6"])
    config.validate_for_devices(cfg, 3)
    with pytest.raises(ConfigError, match="global_batch_size=6 is not divisible by the 4 devices"):
        config.validate_for_devices(cfg, 4)


def test_resolved_config_round_trips(tmp_path):
    cfg = config.load(TINY, ["train.steps=11", "model.mlp_only_layers=[1]"])
    config.save(cfg, tmp_path / "config.yml")
    assert config.load(tmp_path / "config.yml") == cfg


def test_config_docs_are_current():
    assert (REPO / "docs/config.md").read_text() == docs.render(), (
        "docs/config.md is stale: run scripts/gen_config_docs.py"
    )


# --- family sections: model.family decides which model/moe fields exist ----------------------


def test_a_family_decodes_its_own_section_classes():
    from moetext.models.qwen3_moe.config import QwenModelConfig, QwenMoEConfig

    cfg = config.load(TINY, ["moe.num_shared_experts=1", "moe.shared_expert_gate=true"])
    assert type(cfg.model) is QwenModelConfig and type(cfg.moe) is QwenMoEConfig
    assert cfg.model.qk_norm and cfg.moe.shared_expert_gate
    # Built in code from the shared classes, the sections become the family's (its own fields at
    # their defaults), and a config round-trips through its dict unchanged.
    built = Config(model=config.ModelConfig(emb_dim=64), moe=config.MoEConfig(num_experts=4))
    assert type(built.model) is QwenModelConfig and built.model.decoder_sparse_step == 1
    assert config.from_dict(config.to_dict(cfg)) == cfg


def test_a_field_of_another_family_names_the_family_that_has_it(tmp_path):
    from moetext import models

    # dense reads the Qwen classes; a family registered with the shared classes reads no more.
    plain = dataclasses.replace(
        models.get_family("dense"),
        name="plain_test_family",
        model_config=config.ModelConfig,
        moe_config=config.MoEConfig,
    )
    models.register_family(plain, replace=True)
    base = tmp_path / "plain.yml"
    base.write_text(
        f"base_config: {REPO / 'configs/base.yml'}\nmodel: {{family: plain_test_family}}\n"
    )
    cfg = config.load(base)
    assert type(cfg.model) is config.ModelConfig
    with pytest.raises(
        ConfigError,
        # (families that tests register with the Qwen classes may be named after these two)
        match=r"unknown config key 'model.qk_norm': a field of model.family dense / qwen3_moe"
        r"( / \w+)*, not of this one \(valid keys in model: family, ",
    ):
        config.load(base, ["model.qk_norm=true"])
    with pytest.raises(ConfigError, match=r"moe.shared_expert_gate.*not of this one"):
        config.load(base, ["moe.shared_expert_gate=false"])
    # In code: a Qwen section set off its default cannot become the plain family's.
    qwen = config.load(TINY, ["model.qk_norm=false"])
    with pytest.raises(ConfigError, match=r"model.qk_norm=False is not a field of "):
        qwen.replace(model=dataclasses.replace(qwen.model, family="plain_test_family"))


def test_an_unknown_family_names_the_registered_ones():
    with pytest.raises(
        ConfigError,
        match=r"model.family='qwen3_mo' is not a registered model family \(did you mean "
        r"'qwen3_moe'\?\); valid names: .*dense.*qwen3_moe",
    ):
        config.load(TINY, ["model.family=qwen3_mo"])
