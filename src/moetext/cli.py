"""`python -m train config.yml key=value ...`: parse -> load config -> build -> run."""

from __future__ import annotations

import argparse
import sys

from moetext.errors import ConfigError


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m train",
        description="Train a moetext model from a YAML config.",
        epilog="Overrides: section.key=value, e.g. train.steps=20 kernels.gmm_backend=ragged_dot",
    )
    p.add_argument("config", help="path to a YAML config, e.g. configs/models/tiny-qwen3-moe.yml")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, *, compilation_cache: bool = False) -> int:
    """The trainer; `compilation_cache`: point JAX's persistent cache at
    train.compilation_cache_dir first (the process entry point, src/train.py, does; an
    in-process caller keeps JAX's settings)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # models before the config: each model family registers its config sections on import.
    from moetext import config, models  # noqa: F401

    try:
        cfg = config.load(args.config, args.overrides)  # paths made absolute (moetext.paths)
        config.validate_paths(cfg)  # before anything is written
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    import jax

    from moetext import train
    from moetext.sharding.mesh import initialize_distributed

    # Before anything touches devices: afterwards every process sees the global device set.
    initialize_distributed(cfg.distributed)
    cache_line = None
    if compilation_cache:  # before anything is compiled
        from moetext import compilation_cache as cc

        cache_line = cc.enable(cfg.train.compilation_cache_dir)[1]

    if jax.process_index() == 0:
        print(
            f"moetext: {cfg.model.family} on {jax.device_count()} {jax.default_backend()} "
            f"device(s); run dir {cfg.train.run_dir}",
            flush=True,
        )
        if cache_line:
            print(cache_line, flush=True)
    from moetext.checkpoint import CheckpointError, CheckpointWriteError
    from moetext.train.nonfinite import NonFiniteError

    try:
        last = train.run(cfg)
    except CheckpointError as e:  # no usable checkpoint, or one saved with another config
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except CheckpointWriteError as e:  # the checkpoints before it are kept
        print(f"error: {e}", file=sys.stderr)
        return 1
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if jax.process_index() == 0:
        print(
            "done: "
            + " ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in last.items()
                if not hasattr(v, "shape")  # expert_load [layers, E] is in metrics.jsonl
            ),
            flush=True,
        )
        if "eval_ce_loss" in last:
            print(
                f"eval: cross-entropy {last['eval_ce_loss']:.3f} nats/token (perplexity "
                f"{last['eval_perplexity']:.1f}) vs {last['eval_unigram_entropy']:.3f} for the "
                f"best unigram model of the same tokens",
                flush=True,
            )
        if last.get("preempted"):
            print(
                f"preempted after step {last['step']} of {cfg.train.steps}: re-run the same "
                f"command to resume from its checkpoint",
                flush=True,
            )
    return 0
