"""python -m moetext.generate CONFIG --checkpoint DIR --prompt TEXT [--prompt ...] [key=value ...]

One completion per prompt on stdout (--jsonl: one JSON object per prompt); logs on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from moetext import paths
from moetext.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moetext.generate", description=__doc__)
    p.add_argument("config", help="the run's config.yml (or any config describing the model)")
    p.add_argument("overrides", nargs="*", help="section.key=value, as for python -m train")
    p.add_argument(
        "--checkpoint", required=True, help="a run's checkpoints/<step>/ or a conversion"
    )
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_k", type=int, default=0, help="0: no top-k cut")
    p.add_argument("--top_p", type=float, default=1.0, help="1: no nucleus cut")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_len", type=int, help="cache slots per row (default: data.seq_len)")
    p.add_argument("--tokenizer", help="default: the checkpoint's or the run's tokenizer")
    p.add_argument("--jsonl", action="store_true", help="JSON lines instead of plain text")
    args = p.parse_intermixed_args(argv)
    # orbax reports routine facts (no per-process OCDBT subdirs to merge, no step metadata
    # in a state/ item) as absl warnings; this command's own errors are one `error:` line.
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        # Paths absolute at the boundary (orbax needs them so); a bad one is one line. The
        # config is config.load's: a relative configs/... path may name a shipped config.
        checkpoint = os.fspath(paths.existing_dir(args.checkpoint, "--checkpoint"))
        tokenizer = args.tokenizer and os.fspath(paths.existing(args.tokenizer, "--tokenizer"))

        from moetext.generate import Sampling, batch_shards, generate_text, load
        from moetext.program import make_plan

        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        t0 = time.perf_counter()
        cfg, model, tok = load(args.config, checkpoint, args.overrides, tokenizer)
        print(f"loaded {args.checkpoint} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        t0 = time.perf_counter()
        plan = make_plan(cfg)
        with plan.rules():  # the preset's activation sharding and MoE dispatch, as in training
            texts, out = generate_text(
                model,
                tok,
                args.prompt,
                max_new_tokens=args.max_new_tokens,
                sampling=sampling,
                seed=args.seed,
                max_len=args.max_len or cfg.data.seq_len,
                batch_multiple=batch_shards(plan),
            )
        n = sum(len(t) for t in out.tokens)
        dt = time.perf_counter() - t0
        print(f"generated {n} tokens in {dt:.1f} s (with compilation)", file=sys.stderr)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, text, ids, eos in zip(
        args.prompt, texts, out.tokens, out.stopped_at_eos, strict=True
    ):
        if args.jsonl:
            print(json.dumps({"prompt": prompt, "completion": text, "tokens": ids, "eos": eos}))
        else:
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
