"""A run's checkpoint has readable tree metadata: params-only reads (generate,
load_params_from) and conversion look up what it holds without reading arrays."""

from pathlib import Path

from moetext import checkpoint, config, train

TINY = Path(__file__).resolve().parents[2] / "configs/models/tiny-qwen3-moe.yml"


def test_a_runs_checkpoint_names_its_train_state_fields(tmp_path, monkeypatch):
    # A relative run dir, as users type it (orbax finds no tree metadata under a relative path).
    monkeypatch.chdir(tmp_path)
    cfg = config.load(
        TINY,
        [
            "data.kind=synthetic",
            "train.steps=2",
            "train.log_every=1",
            "train.eval_every=0",
            "train.progress_bar=false",
            "checkpoint.every=2",
            "train.run_dir=runs/x",
        ],
    )
    train.run(cfg)
    items = checkpoint.saved_items("runs/x/checkpoints/2")
    assert set(items) == {"step", "params", "opt_state", "rng"}, items
    assert "embed" in items["params"]
