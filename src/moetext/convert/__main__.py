"""python -m moetext.convert {hf-to-orbax,orbax-to-hf} ... (see docs/convert.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import moetext  # noqa: F401  (quiets libtpu's TPU probing before jax starts)
from moetext import paths
from moetext.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moetext.convert", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hf-to-orbax", help="Hugging Face safetensors -> moetext orbax checkpoint")
    h.add_argument("--hf", required=True, help="directory with config.json and *.safetensors")
    h.add_argument("--out", required=True, help="output checkpoint directory (must not exist)")
    h.add_argument("--config", help="moetext config to check against config.json and save")
    h.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="stored dtype")
    h.add_argument("--emit_config", action="store_true", help="also print the config YAML")
    h.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    o = sub.add_parser("orbax-to-hf", help="moetext orbax checkpoint -> Hugging Face safetensors")
    o.add_argument(
        "--checkpoint", required=True, help="a run's checkpoints/<step>/ or hf-to-orbax output"
    )
    o.add_argument("--out", required=True, help="output directory (must not exist)")
    o.add_argument("--config", help="config to use instead of the one saved in the checkpoint")
    o.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="stored dtype")
    o.add_argument("--max_shard_size_gb", type=float, default=5.0, help="cap per safetensors file")
    o.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    # orbax reports routine facts (no per-process OCDBT subdirs to merge, no step metadata
    # in a state/ item) as absl warnings; this command's own errors are one `error:` line.
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        _resolve_paths(args)
        if args.command == "hf-to-orbax":
            from moetext.checkpoint.bounded_save import return_large_frees_to_os
            from moetext.convert.hf_to_orbax import emit_config, hf_to_orbax

            # Freed write buffers back to the OS, not cached per thread (checkpoint/bounded_save).
            return_large_frees_to_os()

            cfg = hf_to_orbax(
                args.hf,
                args.out,
                config_path=args.config,
                dtype=args.dtype,
                overwrite=args.overwrite,
            )
            if args.emit_config:
                print(emit_config(cfg), end="")
            print(f"wrote {args.out}", file=sys.stderr)
        else:
            from moetext.convert.orbax_to_hf import orbax_to_hf

            files = orbax_to_hf(
                args.checkpoint,
                args.out,
                config_path=args.config,
                dtype=args.dtype,
                max_shard_bytes=int(args.max_shard_size_gb * 1e9),
                overwrite=args.overwrite,
            )
            print(f"wrote {args.out}: {len(files)} files", file=sys.stderr)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _resolve_paths(args: argparse.Namespace) -> None:
    """Every path flag made absolute and checked before anything is written (PathError, one
    line naming the flag); --config stays as given (config.load finds shipped configs)."""
    if args.command == "hf-to-orbax":
        args.hf = os.fspath(paths.existing_dir(args.hf, "--hf"))
    else:
        args.checkpoint = os.fspath(paths.existing_dir(args.checkpoint, "--checkpoint"))
    args.out = os.fspath(paths.new_dir(args.out, "--out", overwrite=args.overwrite))


if __name__ == "__main__":
    sys.exit(main())
