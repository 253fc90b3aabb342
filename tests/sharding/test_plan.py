"""Presets, mesh sizing and shardings, and every sharding error, checked before compilation.

Meshes with more than one device use libtpu's description of a v5p topology (no TPU needed):
building a mesh and NamedShardings never touches the devices, so one process covers 8 chips.
"""

import dataclasses
import os
import textwrap

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from moetext import config, program
from moetext.aot import tpu_devices
from moetext.config import ConfigError
from moetext.program import abstract_batch
from moetext.sharding import logical, mesh, plan, rules

TINY = os.path.join(os.path.dirname(__file__), "../../configs/models/tiny-qwen3-moe.yml")
QUIET = ["train.progress_bar=false", "checkpoint.enabled=false"]


@pytest.fixture(scope="module")
def chips8():
    return tpu_devices("v5p:2x2x2")


def load(*overrides):
    return config.load(TINY, [*QUIET, *overrides])


def spec_at(b, *path):
    node = b.state.params
    for p in path:
        node = node[p]
    return node.sharding.spec


# --- presets and mesh sizing -----------------------------------------------------------------


def test_every_preset_loads_with_the_four_axes_and_covers_the_model_names():
    model_names = {
        "vocab",
        "embed",
        "heads",
        "kv_heads",
        "head_dim",
        "mlp",
        "exp",
        "mlp_moe",
        "norm",
        "layers",
        "batch",
        "length",
    }
    assert set(rules.available_presets()) >= {"fsdp", "fsdp_tp", "fsdp_ep"}
    for name in rules.available_presets():
        p = rules.load_preset(name)
        assert p.mesh_axes == ("data", "fsdp", "expert", "tensor"), name
        assert p.mesh == {"data": 1, "fsdp": -1, "expert": 1, "tensor": 1}, name
        assert model_names <= p.rule_names(), (name, model_names - p.rule_names())


@pytest.mark.parametrize(
    "overrides, devices, expect",
    [
        ({}, 8, {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}),
        ({"tensor": 2}, 8, {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}),
        ({"fsdp": 2, "data": -1}, 8, {"data": 4, "fsdp": 2, "expert": 1, "tensor": 1}),
        ({"expert": 4, "fsdp": 2}, 8, {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1}),
    ],
)
def test_mesh_sizes_fill_the_minus_one_axis(overrides, devices, expect):
    cfg = config.ShardingConfig(preset="fsdp", mesh=overrides)
    ici, dcn = mesh.axis_sizes(rules.resolve(cfg), devices)
    assert ici == expect and set(dcn.values()) == {1}


def test_dcn_mesh_splits_devices_into_slices():
    cfg = config.ShardingConfig(preset="fsdp", dcn_mesh={"data": 2})
    ici, dcn = mesh.axis_sizes(rules.resolve(cfg), 8)
    assert ici["fsdp"] == 4 and dcn["data"] == 2


def test_sliced_grid_keeps_each_slice_contiguous():
    # 8 stand-in devices, 2 slices of 4 on `data`: data index i holds devices [4i, 4i + 4).
    grid = mesh._sliced_grid([1, 4], [2, 1], list(range(8)))
    assert grid.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_mesh_axes_are_auto(chips8):
    m = plan.make_plan(config.ShardingConfig(preset="fsdp_tp", mesh={"tensor": 2}), chips8).mesh
    assert dict(m.shape) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    assert set(m.axis_types) == {jax.sharding.AxisType.Auto}


# --- shardings follow the rules --------------------------------------------------------------


def test_fsdp_shards_embed_dim_of_every_weight_and_mirrors_into_adam_moments(chips8):
    b = program.build(load(), chips8, abstract=True)
    assert spec_at(b, "embed") == P(None, "fsdp")
    assert spec_at(b, "lm_head") == P(None, "fsdp")
    assert spec_at(b, "layers", 0, "attn", "w_q") == P("fsdp", None, None)
    assert spec_at(b, "layers", 0, "mlp", "experts", "w_down") == P(None, None, "fsdp")
    assert spec_at(b, "final_norm", "scale") == P(None)
    assert b.batch_sharding.spec == P(("data", "fsdp", "expert"), None)
    # Optimizer moments carry the params' logical names: same specs, leaf for leaf.
    param_specs = jax.tree.leaves(jax.tree.map(lambda x: x.sharding.spec, b.state.params))
    for moments in _adam_moments(b.state.opt_state):
        assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding.spec, moments)) == param_specs
    assert b.state.step.sharding.spec == P()


def _adam_moments(opt_state):
    found = []
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")):
        if hasattr(node, "mu"):
            found += [node.mu, node.nu]
    assert found, "no Adam moments in the optimizer state"
    return found


def test_fsdp_tp_adds_tensor_on_heads_mlp_and_vocab(chips8):
    b = program.build(
        load("sharding.preset=fsdp_tp", "sharding.mesh.tensor=2"), chips8, abstract=True
    )
    assert spec_at(b, "layers", 0, "attn", "w_q") == P("fsdp", "tensor", None)
    assert spec_at(b, "layers", 0, "attn", "w_o") == P("tensor", None, "fsdp")
    assert spec_at(b, "layers", 0, "mlp", "experts", "w_gate") == P(None, "fsdp", "tensor")
    assert spec_at(b, "lm_head") == P("tensor", "fsdp")
    assert b.batch_sharding.spec == P(("data", "fsdp", "expert"), None)


def test_fsdp_ep_puts_experts_on_the_expert_axis(chips8):
    b = program.build(
        load("sharding.preset=fsdp_ep", "sharding.mesh.expert=4"), chips8, abstract=True
    )
    assert spec_at(b, "layers", 0, "mlp", "experts", "w_gate") == P("expert", "fsdp", None)
    assert spec_at(b, "layers", 0, "mlp", "experts", "w_down") == P("expert", None, "fsdp")
    # Weights without an expert dim split embed over every chip (fsdp x expert), as under fsdp.
    assert spec_at(b, "layers", 0, "attn", "w_q") == P(("fsdp", "expert"), None, None)


def test_scanned_layers_keep_the_layers_dim_replicated(chips8):
    b = program.build(load("model.scan_layers=true"), chips8, abstract=True)
    assert spec_at(b, "stacks", 0, "attn", "w_q") == P(None, "fsdp", None, None)


# --- errors before compilation ---------------------------------------------------------------


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown sharding.preset 'fsdpp'.*fsdp, fsdp_ep"):
        load("sharding.preset=fsdpp")


def test_two_fill_axes_is_an_error():
    with pytest.raises(ConfigError, match=r"more than one axis is -1 \(fsdp=-1, tensor=-1\)"):
        load("sharding.mesh.tensor=-1")


def test_unknown_mesh_axis_names_the_valid_axes():
    with pytest.raises(ConfigError, match=r"unknown mesh axis 'tensr'.*data, fsdp, expert, tensor"):
        load("sharding.mesh.tensr=2")


def test_mesh_product_must_equal_device_count():
    cfg = load("sharding.mesh.fsdp=2", "sharding.mesh.tensor=2")
    with pytest.raises(
        ConfigError,
        match=r"data=1 x fsdp=2 x expert=1 x tensor=2.*covers 4 "
        r"devices.*this run has 8 devices",
    ):
        config.validate_for_devices(cfg, 8)
    config.validate_for_devices(cfg, 4)


def test_fill_axis_that_cannot_divide_is_an_error():
    with pytest.raises(ConfigError, match=r"fixed axes take 3 devices.*8 devices per slice"):
        config.validate_for_devices(load("sharding.mesh.tensor=3"), 8)


def test_axis_size_that_does_not_divide_a_param_dim_names_it(chips8):
    # Tiny config: 2 kv heads cannot split 4 ways over `tensor`: named by its config field,
    # before any param is looked at.
    cfg = load("sharding.preset=fsdp_tp", "sharding.mesh.tensor=4")
    msg = (
        r"model.num_kv_heads=2 is not divisible by mesh axis 'tensor' of size 4, which logical "
        r"axis 'kv_heads' maps to \(preset 'fsdp_tp'"
    )
    with pytest.raises(ConfigError, match=msg):
        program.build(cfg, chips8, abstract=True)
    # Any other param dim is named by the param: a vocab of 510 rows over 4.
    cfg = load(
        "sharding.preset=fsdp_tp",
        "sharding.mesh.tensor=4",
        "model.num_kv_heads=4",
        "model.vocab_size=510",
    )
    msg = (
        r"param params.embed of shape \(510, 64\): dim 0 "
        r"\(logical 'vocab', size 510\) is not divisible by mesh axis 'tensor' of size 4"
    )
    with pytest.raises(ConfigError, match=msg):
        program.build(cfg, chips8, abstract=True)


def _preset_without(tmp_path, name: str) -> str:
    text = (rules.PRESET_DIR / "fsdp.yml").read_text()
    kept = [line for line in text.splitlines() if not line.strip().startswith(f"- [{name},")]
    path = tmp_path / f"no_{name}.yml"
    path.write_text("\n".join(kept) + "\n")
    return str(path)


def test_param_logical_name_without_rule_names_axis_and_param(tmp_path):
    cfg = load(f"sharding.preset={_preset_without(tmp_path, 'kv_heads')}", "sharding.mesh.fsdp=1")
    # The family declares its axes: the trainer names the missing one before building.
    with pytest.raises(
        ConfigError, match=r"logical axis 'kv_heads' of model family 'qwen3_moe' has no rule"
    ):
        program.build(cfg, jax.devices()[:1], abstract=True)
    # Behind it, each param's names are checked too (and name the param).
    params = nnx.state(nnx.eval_shape(lambda: program.create_model(cfg)), nnx.Param)
    with pytest.raises(
        ConfigError, match=r"logical axis 'kv_heads' of param layers.0.attn.w_k has no rule"
    ):
        program.make_plan(cfg, jax.devices()[:1]).shardings_for(params)


def test_activation_logical_name_without_rule_is_an_error(tmp_path):
    b = program.build(load("sharding.mesh.fsdp=1"), jax.devices()[:1], abstract=True)
    cfg = load(f"sharding.preset={_preset_without(tmp_path, 'length')}", "sharding.mesh.fsdp=1")
    # Trace under a plan whose rules lack "length" (the family check would stop a real run
    # earlier): the activation check names it.
    b_no_length = dataclasses.replace(b, plan=program.make_plan(cfg, jax.devices()[:1]))
    batch = abstract_batch(8, 64, b.batch_sharding)
    with pytest.raises(ConfigError, match=r"logical axis 'length' of an activation constraint"):
        program.lower_checked(b_no_length, program.jit_train_step(b), b.state, batch)


def test_recording_restores_the_lookup():
    before = logical.logical_to_mesh_spec
    with plan.record_logical_names() as names:
        logical.logical_to_mesh_spec(("batch", "x"), [("batch", "data")])
    assert names == {"batch", "x"} and logical.logical_to_mesh_spec is before


def test_malformed_rule_is_an_error(tmp_path):
    path = tmp_path / "bad.yml"
    path.write_text(
        textwrap.dedent("""\
        mesh_axes: [data, fsdp]
        logical_axis_rules:
          - [embed, fsdpp]
    """)
    )
    with pytest.raises(ConfigError, match=r"maps 'embed' to unknown mesh axis 'fsdpp'"):
        rules.load_preset(str(path))


def test_params_are_created_sharded_on_cpu_device():
    b = program.build(load("sharding.mesh.fsdp=1"), jax.devices()[:1])
    leaf = b.state.params["embed"]
    assert isinstance(leaf, nnx.Param)
    assert leaf.sharding.mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert leaf.sharding.spec == P(None, "fsdp")
