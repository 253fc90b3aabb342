"""checkpoint.load_params_from: a converted (or any) checkpoint's params start a run, in
either layer layout, sharded; a trained run's checkpoint converts back out."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from fake_devices import run_worker
from moetext import checkpoint, config, models, program, train
from moetext.convert.hf import load_model
from moetext.convert.hf_to_orbax import hf_to_orbax
from moetext.convert.orbax_to_hf import orbax_to_hf
from moetext.errors import ConfigError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "dense_first_t5"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "ckpt"
    hf_to_orbax(FIXTURE, out)
    return out


def _load(cfg, directory):
    return checkpoint.load_params(
        str(directory), cfg, program.params_target(cfg, program.make_plan(cfg))
    )


def _pure(params) -> dict:
    return nnx.to_pure_dict(params)


def _equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )


@pytest.mark.parametrize("scan", [False, True])
def test_loaded_params_are_the_hf_weights_in_either_layout(converted, scan, caplog):
    cfg = config.load(converted / "config.yml", [f"model.scan_layers={str(scan).lower()}"])
    with caplog.at_level(logging.INFO, logger="absl"):
        params = _load(cfg, converted)
    # orbax's routine 'Metadata file does not exist: state/_CHECKPOINT_METADATA' is dropped.
    assert not [r for r in caplog.records if "Metadata file does not exist" in r.getMessage()]
    _, ref = load_model(FIXTURE)
    want = _pure(nnx.state(ref, nnx.Param))
    got = _pure(params)
    if scan:
        assert "stacks" in got and "layers" not in got
        got = models.get_family("qwen3_moe").unstack_layers(got, cfg.model)
    assert _equal(got, want)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(got))  # model.param_dtype


def test_mismatched_model_or_missing_directory_is_named(converted, tmp_path):
    cfg = config.load(converted / "config.yml", ["model.emb_dim=64", "model.head_dim=8"])
    with pytest.raises(ConfigError, match=r"model.emb_dim: the checkpoint has 32, this run 64"):
        _load(cfg, converted)
    with pytest.raises(ConfigError, match="does not exist"):
        _load(cfg, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a moetext checkpoint"):
        _load(cfg, tmp_path / "empty")


def test_each_device_receives_only_its_shard(converted):
    r = run_worker(
        "tests.convert.load_params_worker", str(converted), str(FIXTURE), devices=4, timeout_s=300
    )
    assert r["devices"] == 4 and r["equal"], r
    # w_q [D=32, N=4, H=16] with embed over fsdp=4: every device holds [8, 4, 16].
    assert r["w_q_global"] == [32, 4, 16] and r["w_q_shards"] == [[8, 4, 16]], r


def test_train_from_converted_then_export_the_trained_scanned_run(converted, tmp_path):
    run = tmp_path / "run"
    overrides = [
        f"checkpoint.load_params_from={converted}",
        "model.scan_layers=true",
        "data.seq_len=16",
        "data.global_batch_size=4",
        "train.steps=3",
        "train.log_every=1",
        "train.eval_every=0",
        "train.progress_bar=false",
        "train.peak_tflops=1",
        "checkpoint.every=3",
        f"train.run_dir={run}",
    ]
    cfg = config.load(converted / "config.yml", overrides)
    train.run(cfg)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl") if '"loss"' in line]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # The run's own checkpoint (scanned) converts out; its weights are the trained ones.
    orbax_to_hf(run / "checkpoints" / "3", tmp_path / "hf")
    _, exported = load_model(tmp_path / "hf")
    trained = checkpoint.load_params(
        str(run / "checkpoints" / "3"),
        unscanned := config.load(converted / "config.yml", ["model.scan_layers=false"]),
        program.params_target(unscanned, program.make_plan(cfg)),
    )
    assert _equal(_pure(nnx.state(exported, nnx.Param)), _pure(trained))
    _, start = load_model(FIXTURE)
    assert not _equal(_pure(nnx.state(start, nnx.Param)), _pure(trained))  # it trained
    # Resuming takes the run's own checkpoint; load_params_from is ignored.
    cfg4 = config.load(
        converted / "config.yml", [*overrides[:-2], "train.steps=4", *overrides[-1:]]
    )
    train.run(cfg4)
    steps = [json.loads(line)["step"] for line in open(run / "metrics.jsonl") if '"loss"' in line]
    assert steps == [1, 2, 3, 4]
