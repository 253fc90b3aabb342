"""A checkpoint's model state (sigmoid_topk's selection bias) travels with its params: decoding
(`generate.load`) and a new run from it (`checkpoint.load_params_from`) read it in either layer
layout, and export to Qwen's HF format refuses a router HF cannot express.

One tiny run (scanned layers, the bias moving) serves every test; the bias is compared bitwise
(a restore copies the saved float32 values).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moetext import config, generate, program, train
from moetext.checkpoint import LeafReader
from moetext.convert.orbax_to_hf import orbax_to_hf
from moetext.errors import ConfigError
from moetext.train import resume

REPO = Path(__file__).resolve().parents[2]
TINY_YML = REPO / "configs/models/tiny-qwen3-moe.yml"
SIGMOID = [
    "moe.router=sigmoid_topk",
    "moe.bias_update_rate=0.01",
    "moe.aux_loss_weight=0",
    "train.log_every=2",
    "checkpoint.every=2",
    "checkpoint.async_save=false",
    "train.progress_bar=false",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sigmoid_run")
    cfg = config.load(
        TINY_YML, [*SIGMOID, "train.steps=2", "model.scan_layers=true", f"train.run_dir={run_dir}"]
    )
    train.run(cfg)
    ckpt = run_dir / "checkpoints/2"
    stacked = LeafReader(ckpt, item="model_state").tree["stacks"]
    return run_dir, ckpt, {int(j): s for j, s in stacked.items()}


def _saved_biases(ckpt: Path, stacks: dict[int, object]) -> list[np.ndarray]:
    """The saved selection bias of every MoE layer, in layer order (from the stacked runs)."""
    reader = LeafReader(ckpt, item="model_state")
    out: list[np.ndarray] = []
    for j in sorted(stacks):
        stacked = reader.get(("stacks", j, "mlp", "router", "selection_bias"))
        out.extend(stacked)
    return out


def test_generate_decodes_with_the_saved_selection_bias(run):
    run_dir, ckpt, stacks = run
    saved = _saved_biases(ckpt, stacks)
    assert all(np.any(b != 0) for b in saved)  # two steps at rate 0.01 moved it
    cfg, model, _ = generate.load(run_dir / "config.yml", str(ckpt))
    moe = [layer.mlp.router for layer in model.layers if layer.use_moe]
    got = [np.asarray(r.selection_bias[...]) for r in moe]
    assert len(got) == len(saved)
    for g, s in zip(got, saved, strict=True):
        np.testing.assert_array_equal(g, s)


def test_a_new_run_from_the_checkpoint_starts_from_its_bias(run, tmp_path):
    run_dir, ckpt, stacks = run
    cfg = config.load(
        TINY_YML,
        [
            *SIGMOID,
            "train.steps=0",
            "model.scan_layers=false",  # the other layout: unstacked on load
            f"checkpoint.load_params_from={ckpt}",
            f"train.run_dir={tmp_path}",
        ],
    )
    b = program.build(cfg)
    state = resume.initial_state(b, None, None)
    layers = state.model_state["layers"]
    got = [np.asarray(layers[i]["mlp"]["router"]["selection_bias"].get_value()) for i in layers]
    for g, s in zip(got, _saved_biases(ckpt, stacks), strict=True):
        np.testing.assert_array_equal(g, s)


def test_export_to_qwen_hf_refuses_a_router_hf_cannot_express(run, tmp_path):
    _, ckpt, _ = run
    out = tmp_path / "hf"
    with pytest.raises(ConfigError, match=r"moe.router='sigmoid_topk'.*no HF equivalent"):
        orbax_to_hf(ckpt, out)
    assert not out.exists()
