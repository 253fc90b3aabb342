"""train.freeze: matching params stay bit-identical, have no optimizer state, and the regex
sees the same unscanned names under either model.scan_layers."""

from pathlib import Path

import jax
import numpy as np
import pytest

from moetext import config, program
from moetext.data import SyntheticData
from moetext.errors import ConfigError

TINY = Path(__file__).resolve().parents[2] / "configs/models/tiny-qwen3-moe.yml"
ROUTER = r"layers/\d+/mlp/router/w"


def _flat(params):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree.leaves_with_path(params)}


@pytest.mark.parametrize("scan", ["false", "true"])
def test_frozen_params_do_not_move_and_have_no_optimizer_state(scan):
    overrides = [f"model.scan_layers={scan}", f"train.freeze=[{ROUTER}, embed]"]
    cfg = config.load(TINY, [*overrides, "data.kind=synthetic", "data.seq_len=16"])
    b = program.build(cfg)
    before = _flat(b.state.params)
    frozen = {k for k in before if "router" in k or k.startswith("['embed']")}
    assert len(frozen) == (2 if scan == "true" else 3)  # one router stack, or 2 + embed
    trained = sum(v.size for k, v in before.items() if k not in frozen)
    # AdamW's mu and nu for the trained params only (+ its step count, + the schedule's).
    opt_sizes = [x.size for x in jax.tree.leaves(b.state.opt_state)]
    assert sum(opt_sizes) - opt_sizes.count(1) == 2 * trained
    step = program.jit_train_step(b)
    data, state = SyntheticData(cfg.data, cfg.model.vocab_size), b.state
    for i in range(3):
        state, metrics = step(state, program.put_batch(data.batch(i), b.batch_sharding))
    after = _flat(state.params)
    for k in before:
        moved = not np.array_equal(before[k], after[k])
        assert moved == (k not in frozen), k
    assert np.isfinite(float(metrics["loss"]))


def test_freeze_errors_name_the_pattern():
    base = ["data.kind=synthetic"]
    with pytest.raises(ConfigError, match=r"\['nope'\] match no parameter"):
        program.build(config.load(TINY, [*base, "train.freeze=[nope]"]))
    # Under scan_layers one array holds both layers' routers: freezing one is refused.
    cfg = config.load(TINY, [*base, "model.scan_layers=true", "train.freeze=[layers/1/mlp/.*]"])
    with pytest.raises(ConfigError, match="set model.scan_layers=false"):
        program.build(cfg)
    with pytest.raises(ConfigError, match="not a regex"):
        config.load(TINY, [*base, "train.freeze=['(']"])
