"""python -m moetext.generate CONFIG --checkpoint DIR (--prompt T | --chat T) [...] [key=value]

One completion per prompt (or one assistant reply per --chat conversation) on stdout (--jsonl:
one JSON object each); logs on stderr. `--chat -` reads user turns from stdin, one a line, as
one multi-turn conversation. `--template-var NAME=VALUE` (repeatable, VALUE read as YAML:
true, 3, text) hands the chat template one more variable, as transformers'
apply_chat_template(**kwargs) does: `--template-var enable_thinking=false` makes Qwen3's
template start the reply with an empty think block (no thinking).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from moetext import paths
from moetext.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moetext.generate", description=__doc__)
    p.add_argument("config", help="the run's config.yml (or any config describing the model)")
    p.add_argument("overrides", nargs="*", help="section.key=value, as for python -m train")
    p.add_argument(
        "--checkpoint", required=True, help="a run's checkpoints/<step>/ or a conversion"
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", action="append", help="text to continue; repeat for a batch")
    what.add_argument(
        "--chat", action="append", help="a user message (its own conversation; repeat for a "
        "batch), answered with the chat template; '-': a multi-turn session on stdin",
    )  # fmt: skip
    p.add_argument("--system", help="--chat: a system message at the start of each conversation")
    p.add_argument(
        "--template-var",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="--chat: one more chat-template variable (VALUE as YAML), e.g. enable_thinking=false",
    )
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_k", type=int, default=0, help="0: no top-k cut")
    p.add_argument("--top_p", type=float, default=1.0, help="1: no nucleus cut")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_len", type=int, help="cache slots per row (default: data.seq_len)")
    p.add_argument("--tokenizer", help="default: the checkpoint's or the run's tokenizer")
    p.add_argument("--jsonl", action="store_true", help="JSON lines instead of plain text")
    return p


def main(argv: list[str] | None = None, *, compilation_cache: bool = False) -> int:
    """`compilation_cache`: point JAX's persistent cache at the config's
    train.compilation_cache_dir before decoding compiles (the process entry point below
    does; an in-process caller keeps JAX's settings)."""
    args = _parser().parse_intermixed_args(argv)
    # orbax reports routine facts (no per-process OCDBT subdirs to merge, no step metadata
    # in a state/ item) as absl warnings; this command's own errors are one `error:` line.
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        args.template_vars = template_vars(args.template_var)
        if args.template_vars and not args.chat:
            raise ConfigError("--template-var sets chat-template variables: it needs --chat")
        # Paths absolute at the boundary (orbax needs them so); a bad one is one line. The
        # config is config.load's: a relative configs/... path may name a shipped config.
        checkpoint = os.fspath(paths.existing_dir(args.checkpoint, "--checkpoint"))
        tokenizer = args.tokenizer and os.fspath(paths.existing(args.tokenizer, "--tokenizer"))

        from moetext.generate import Sampling, batch_shards, load
        from moetext.program import make_plan

        t0 = time.perf_counter()
        cfg, model, tok = load(args.config, checkpoint, args.overrides, tokenizer)
        print(f"loaded {args.checkpoint} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if compilation_cache:  # before prefill and decode compile
            from moetext import compilation_cache as cc

            print(cc.enable(cfg.train.compilation_cache_dir)[1], file=sys.stderr)
        plan = make_plan(cfg)
        run = dict(
            max_new_tokens=args.max_new_tokens,
            sampling=Sampling(args.temperature, args.top_k, args.top_p),
            seed=args.seed,
            max_len=args.max_len or cfg.data.seq_len,
            batch_multiple=batch_shards(plan),
        )
        with plan.rules():  # the preset's activation sharding and MoE dispatch, as in training
            if args.chat:
                return _chat(args, cfg, model, tok, run)
            _complete(args, model, tok, run)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def template_vars(items: list[str]) -> dict[str, Any]:
    """--template-var NAME=VALUE items -> {NAME: VALUE read as YAML}, or a ConfigError naming
    the item."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip().isidentifier():
            raise ConfigError(
                f"--template-var {item!r}: expected NAME=VALUE with NAME a template variable "
                f"name, e.g. enable_thinking=false"
            )
        try:
            out[name.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"--template-var {item!r}: VALUE is not YAML: {e}") from None
    return out


def _complete(args: argparse.Namespace, model: Any, tok: Any, run: dict[str, Any]) -> None:
    from moetext.generate import generate_text

    t0 = time.perf_counter()
    texts, out = generate_text(model, tok, args.prompt, **run)
    n = sum(len(t) for t in out.tokens)
    dt = time.perf_counter() - t0
    print(f"generated {n} tokens in {dt:.1f} s (with compilation)", file=sys.stderr)
    _print(args, args.prompt, texts, out)


def _print(args: argparse.Namespace, prompts: list[str], texts: list[str], out: Any) -> None:
    """Each completion on stdout: its text, or with --jsonl a JSON line of the prompt, the
    completion, its token ids and whether it stopped at EOS."""
    for prompt, text, ids, eos in zip(prompts, texts, out.tokens, out.stopped_at_eos, strict=True):
        if args.jsonl:
            print(json.dumps({"prompt": prompt, "completion": text, "tokens": ids, "eos": eos}))
        else:
            print(text)


def _chat(args: argparse.Namespace, cfg: Any, model: Any, tok: Any, run: dict[str, Any]) -> int:
    from moetext.generate import chat

    template = chat.template_for(tok, cfg.data.chat_template)
    ckpt = os.fspath(paths.existing_dir(args.checkpoint, "--checkpoint"))
    dirs = [ckpt, os.path.dirname(os.path.abspath(tok.path))]
    stop = chat.stop_ids(template, tok, *dirs)
    if args.chat == ["-"]:
        return _session(args, model, tok, template, stop, run)
    if "-" in args.chat:
        raise ConfigError("--chat -: a stdin session is the only --chat of its command")
    convs = [chat.conversation(u, args.system) for u in args.chat]
    replies, out = chat.reply(
        model, tok, template, convs, stop=stop, variables=args.template_vars, **run
    )
    _print(args, args.chat, replies, out)
    return 0


def _session(args: Any, model: Any, tok: Any, template: Any, stop: Any, run: Any) -> int:
    """One conversation on stdin: each line a user turn, each reply printed and kept."""
    from moetext.generate import chat

    conv = [{"role": "system", "content": args.system}] if args.system else []
    for line in sys.stdin:
        if not line.strip():
            continue
        conv.append({"role": "user", "content": line.rstrip("\n")})
        (text,), out = chat.reply(
            model, tok, template, [conv], stop=stop, variables=args.template_vars, **run
        )
        conv.append({"role": "assistant", "content": text})
        if args.jsonl:
            print(json.dumps({"prompt": conv[-2]["content"], "completion": text}), flush=True)
        else:
            print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(compilation_cache=True))
