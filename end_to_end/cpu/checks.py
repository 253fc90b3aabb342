"""The assertions of end_to_end/cpu/run_all.sh, one subcommand per stage.

    python end_to_end/cpu/checks.py SUBCOMMAND ARGS...

Each subcommand exits 0 and prints one summary line when its stage's result is right, and
exits 1 with `FAILED <stage>: <what>` on stderr when it is not. Only the standard library is
imported at the top: `wait-checkpoint` polls a live run and must start fast; the stages that
need jax import it themselves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Token rows for the logits check: real text from the corpus' domain, encoded with the run's
# tokenizer and cut to a common length.
LOGIT_TEXTS = (
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Return a new sorted list from the items in iterable. A custom key function can be given.",
    "The with statement is used to wrap the execution of a block with methods defined by a",
    "class Path: a subclass of PurePath that also offers methods to do system calls on paths.",
)
# Logits of the same float32 weights in two models, one built from the HF directory's
# config.json (other sections at their defaults), one from the run's resolved config. Measured
# equal bit for bit (max |diff| 0): same fields, same XLA program. Not asserted exact because
# the two configs may legitimately pick different but equivalent programs (e.g. the kernels
# section, which config.json does not carry, choosing another gmm backend); those differ by
# float32 rounding of reordered sums only (2.6e-6 at most measured for reordered decoding in
# tests/generate/test_sharded_decode.py). A wrong tensor mapping
# moves them by far more: measured 0.68 (gate/up swapped in one layer), 1.97 (two experts'
# gate weights swapped), 2.1 (KV heads swapped) on this stage's 60-step model.
LOGITS_ATOL = 1e-5


class CheckError(Exception):
    pass


def check(ok: bool, message: str) -> None:
    if not ok:
        raise CheckError(message)


def rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    check(path.exists(), f"{path} does not exist")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in rows(run_dir) if "loss" in r]


def complete_checkpoints(run_dir: Path) -> list[int]:
    """Committed checkpoint steps: orbax writes <step>.orbax-checkpoint-tmp and renames it to
    <step> when the save is complete."""
    d = run_dir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


# ---- (a) prepare ---------------------------------------------------------------------------


def prepare(args: argparse.Namespace) -> str:
    from moetext.data import corpus, prepare
    from moetext.data.tokenizer import load_tokenizer

    data_dir = Path(args.data_dir)
    dataset_dir, tokenizer_path = corpus.ensure_python_docs(str(data_dir), args.vocab_size)
    check(
        Path(dataset_dir).resolve().is_relative_to(data_dir.resolve()),
        f"the corpus went to {dataset_dir}, outside {data_dir}",
    )
    record = prepare.read_record(dataset_dir)
    check(record is not None, f"{dataset_dir} has no moetext_prepare.json")
    assert record is not None
    docs = record["stats"]["documents"]
    # ~500 stdlib modules and doc topics; ~2% held out for eval.
    check(docs["train"] >= 100 and docs["eval"] >= 1, f"too few documents: {docs}")
    for split in ("train", "eval"):
        shards = list(Path(dataset_dir).glob(f"python_docs-{split}.array_record-*"))
        check(bool(shards), f"no {split} array_record file in {dataset_dir}")
    check(tokenizer_path is not None, "no tokenizer was trained")
    tok = load_tokenizer(str(tokenizer_path))
    check(
        tok.vocab_size <= args.vocab_size,
        f"tokenizer has {tok.vocab_size} pieces, model.vocab_size is {args.vocab_size}",
    )
    text = LOGIT_TEXTS[0]
    check(tok.decode(tok.encode(text)) == text, "the tokenizer does not round-trip text")
    # Stage (f) fine-tunes the pretrained model on chats with the built-in ChatML template.
    missing = [t for t in ("<|im_start|>", "<|im_end|>") if tok.token_id(t) is None]
    check(not missing, f"the tokenizer lacks the ChatML pieces {missing}")
    return (
        f"{docs['train']} train / {docs['eval']} eval documents, "
        f"{tok.vocab_size}-piece tokenizer in {dataset_dir}"
    )


# ---- (b) the uninterrupted run -------------------------------------------------------------


def trained(args: argparse.Namespace) -> str:
    run = Path(args.run_dir)
    got = step_rows(run)
    steps = [r["step"] for r in got]
    check(steps == list(range(1, args.steps + 1)), f"logged steps {steps}, want 1..{args.steps}")
    losses = [r["loss"] for r in got]
    check(all(math.isfinite(x) for x in losses), "a non-finite loss was logged")
    # Real text: the loss starts near ln(vocab) and the model learns the unigram statistics
    # within a few dozen steps.
    check(losses[-1] < losses[0] - 0.5, f"loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    evals = [r["eval_loss"] for r in got if "eval_loss" in r]
    check(bool(evals) and all(math.isfinite(x) for x in evals), f"eval losses {evals}")
    ckpts = complete_checkpoints(run)
    check(bool(ckpts) and ckpts[-1] == args.steps, f"checkpoints {ckpts}, want the last at N")
    check((run / "tokenizer").is_dir() and (run / "config.yml").exists(), "run dir incomplete")
    mtp = ""
    if args.mtp:
        # Multi-token prediction on (model.mtp_layers > 0): its loss is logged on every step,
        # finite, and learnt like the main one (it predicts the token after the next).
        logged = [r.get("mtp_loss") for r in got]
        check(
            all(x is not None and math.isfinite(x) for x in logged),
            f"mtp_loss logged as {logged[:5]}",
        )
        m = [float(x) for x in logged if x is not None]
        check(m[-1] < m[0] - 0.5, f"mtp_loss did not fall: {m[0]:.4f} -> {m[-1]:.4f}")
        mtp = f", mtp_loss {m[0]:.4f} -> {m[-1]:.4f}"
    return (
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}{mtp}, eval {evals[-1]:.4f}, checkpoints {ckpts}"
    )


# ---- (c) kill -9 and resume ----------------------------------------------------------------


def wait_checkpoint(args: argparse.Namespace) -> str:
    """Returns once the run (pid) has a complete checkpoint and has logged a step past it, so
    that a kill now loses steps that the resume must redo; fails if the run ends first."""
    run, deadline = Path(args.run_dir), time.monotonic() + args.timeout
    while True:
        check(_alive(args.pid), f"the run (pid {args.pid}) ended before it could be killed")
        ckpts = complete_checkpoints(run)
        try:
            logged = [r["step"] for r in step_rows(run)] if (run / "metrics.jsonl").exists() else []
        except json.JSONDecodeError:  # a row being appended right now
            logged = []
        if ckpts and logged and logged[-1] > ckpts[-1]:
            check(
                logged[-1] < args.steps,
                f"the run reached step {logged[-1]} of {args.steps} before a kill: "
                "raise the step count so that it is still running after its first checkpoint",
            )
            return f"step {logged[-1]} logged, newest complete checkpoint {ckpts[-1]}"
        check(time.monotonic() < deadline, f"no checkpoint in {args.timeout} s")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by the shell) still answers kill(pid, 0).
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def killed(args: argparse.Namespace) -> str:
    """After the kill: the run stopped short of N with at least one complete checkpoint.
    Prints the step the resume must start from."""
    run = Path(args.run_dir)
    ckpts = complete_checkpoints(run)
    check(bool(ckpts), "no complete checkpoint survived the kill")
    check(ckpts[-1] < args.steps, f"the run finished (checkpoint {ckpts[-1]}) before the kill")
    return str(ckpts[-1])


def resumed(args: argparse.Namespace) -> str:
    run, ref = Path(args.run_dir), Path(args.reference)
    compiled = [r["step"] for r in rows(run) if r.get("event") == "compiled"]
    # One compile at the start, one at the resume: the second process started from the
    # newest checkpoint the kill left, not from scratch and not from an older one.
    check(compiled == [0, args.resumed_from], f"compiled at {compiled}, want [0, resume step]")
    got = step_rows(run)
    steps = [r["step"] for r in got]
    dupes = sorted({s for s in steps if steps.count(s) > 1})
    check(not dupes, f"steps logged more than once: {dupes}")
    check(steps == list(range(1, args.steps + 1)), f"logged steps {steps}, want 1..{args.steps}")
    # Bit for bit, on every step: the same compiled program, optimizer state, RNG and data
    # position. JSON floats round-trip exactly, so == compares the float32 values.
    keys = ("loss", "grad_norm", "eval_loss", "mtp_loss")  # mtp_loss: None when MTP is off
    want = {r["step"]: [r.get(k) for k in keys] for r in step_rows(ref)}
    bad = [(r["step"], [r.get(k) for k in keys], want.get(r["step"])) for r in got]
    bad = [b for b in bad if b[1] != b[2]]
    check(not bad, f"metrics differ from the uninterrupted run (step, got, want): {bad[:3]}")
    check(complete_checkpoints(run)[-1] == args.steps, "no final checkpoint after the resume")
    final = Path("checkpoints", str(args.steps))
    diff = _tree_difference(_params(run / final), _params(ref / final))
    check(not diff, f"final params differ from the uninterrupted run: {diff}")
    return (
        f"resumed at {args.resumed_from}, steps 1..{args.steps} once each, final loss "
        f"{got[-1]['loss']!r} == {want[args.steps][0]!r}, final params bit-identical"
    )


def _params(step_dir: Path) -> dict[str, Any]:
    """A checkpoint's params as {path: numpy array}, read with the loader runs use
    (checkpoint.load_params_from), under the config saved in the checkpoint; its model state
    (a router's selection bias, which routes tokens as much as the params do) too, as
    "model_state" + path, when the checkpoint has one."""
    import jax
    import numpy as np

    from moetext import checkpoint, program
    from moetext.checkpoint import read_meta_config

    cfg = read_meta_config(step_dir)
    plan = program.make_plan(cfg)
    state = checkpoint.load_params(str(step_dir), cfg, program.params_target(cfg, plan))
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    out = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    model_state = checkpoint.load_model_state(
        str(step_dir), cfg, program.model_state_target(cfg, plan)
    )
    if model_state is not None:
        for k, v in jax.tree_util.tree_flatten_with_path(model_state)[0]:
            out["model_state" + jax.tree_util.keystr(k)] = np.asarray(v)
    return out


def _tree_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    if sorted(a) != sorted(b):
        return f"names differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in sorted(a):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return f"{k}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}, not bit-identical"
    return ""


# ---- (d) generate --------------------------------------------------------------------------


def generated(args: argparse.Namespace) -> str:
    path = Path(args.jsonl)
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    check(len(lines) == args.prompts, f"{len(lines)} completions for {args.prompts} prompts")
    for r in lines:
        check(bool(r["tokens"]), f"no token generated for {r['prompt']!r}")
        check(bool(r["completion"].strip()), f"empty completion for {r['prompt']!r}: {r}")
    return "; ".join(f"{r['prompt']!r} -> {r['completion'][:40]!r}" for r in lines)


# ---- (e) convert ---------------------------------------------------------------------------


def hf_roundtrip(args: argparse.Namespace) -> str:
    """orbax -> HF (a) -> orbax (ckpt) -> HF (b): the tensors of a and b are bit-identical, and
    the orbax checkpoint in between holds the run's params bit for bit."""
    import numpy as np

    from moetext.convert.safetensors_io import SafetensorsReader

    def tensors(d: str) -> dict[str, Any]:
        r = SafetensorsReader(d)
        return {n: np.asarray(r.get(n)) for n in r.names()}

    a, b = tensors(args.hf_a), tensors(args.hf_b)
    diff = _tree_difference(a, b)
    check(not diff, f"HF tensors changed through hf-to-orbax -> orbax-to-hf: {diff}")
    dtypes = {str(x.dtype) for x in a.values()}
    check(dtypes == {"float32"}, f"HF tensors are {dtypes}; the run's params are float32")
    ca, cb = (json.loads(Path(d, "config.json").read_text()) for d in (args.hf_a, args.hf_b))
    keys = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
    check(not keys, f"config.json changed through the round trip: {keys}")
    diff = _tree_difference(_params(Path(args.checkpoint)), _params(Path(args.orbax)))
    check(not diff, f"hf-to-orbax did not give back the run's params: {diff}")
    n = sum(x.size for x in a.values())
    mtp = ""
    if args.mtp:
        # The MTP module went out and came back (the params comparison above includes it),
        # laid out as released DeepSeek-V3 checkpoints: after the decoder layers.
        depths, layers = ca.get("num_nextn_predict_layers"), ca.get("num_hidden_layers")
        check(bool(depths), f"config.json num_nextn_predict_layers is {depths!r}, want >= 1")
        names = [f"model.layers.{layers}.{t}.weight" for t in ("eh_proj", "enorm", "hnorm")]
        missing = [x for x in names if x not in a]
        check(not missing, f"the HF export lacks the MTP tensors {missing}")
        count = sum(k.startswith(f"model.layers.{layers}.") for k in a)
        mtp = f", MTP module included ({count} tensors)"
    return f"{len(a)} tensors ({n} float32 values) bit-identical; orbax params bit-identical{mtp}"


def logits(args: argparse.Namespace) -> str:
    import jax.numpy as jnp
    import numpy as np

    from moetext.convert.hf import load_model
    from moetext.data.tokenizer import load_tokenizer

    run_model = _run_model(Path(args.config), Path(args.checkpoint))
    _, hf_model = load_model(args.hf, dtype="float32")
    tok = load_tokenizer(Path(args.config).parent / "tokenizer")
    ids = [tok.encode(t) for t in LOGIT_TEXTS]
    s = min(len(i) for i in ids)
    check(s >= 8, f"the logit texts encode to only {s} tokens")
    tokens_BS = jnp.asarray(np.array([i[:s] for i in ids], dtype=np.int32))
    a = np.asarray(run_model(tokens_BS)[0])
    b = np.asarray(hf_model(tokens_BS)[0])
    check(a.dtype == b.dtype == np.float32, f"logits are {a.dtype} and {b.dtype}, not float32")
    check(a.shape == b.shape, f"logit shapes {a.shape} vs {b.shape}")
    check(bool(np.isfinite(a).all()), "non-finite logits")
    err = float(np.max(np.abs(a - b)))
    check(err <= LOGITS_ATOL, f"max |logit difference| {err:.3g} > {LOGITS_ATOL}")
    return f"logits {a.shape} max |diff| {err:.3g} (<= {LOGITS_ATOL})"


def _run_model(config: Path, step_dir: Path, overrides: tuple[str, ...] = ()) -> Any:
    """The run's (training) model with a checkpoint's params, built from the run's config.
    Not moetext.generate.load: its model has decoding's prefused experts and no full forward."""
    from flax import nnx

    from moetext import checkpoint, models, program
    from moetext import config as config_lib

    cfg = config_lib.load(config, list(overrides))
    plan = program.make_plan(cfg)
    params = checkpoint.load_params(str(step_dir), cfg, program.params_target(cfg, plan))
    # The model state (a router's selection bias): the checkpoint's, else a new model's.
    state = checkpoint.load_model_state(str(step_dir), cfg, program.model_state_target(cfg, plan))
    if state is None:
        state = program.initial_model_state(cfg, plan)
    abstract = nnx.eval_shape(
        lambda: models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=0))
    )
    graphdef, _, _, rest = nnx.split(abstract, nnx.Param, models.ModelState, ...)  # type: ignore[misc]
    return nnx.merge(graphdef, params, state, rest)


# ---- (f) fine-tune a Hugging Face checkpoint on conversations ------------------------------

# The HF fixture's logits (transformers', float32 of its bfloat16 weights) against the
# converted checkpoint's, both float32 with different summation orders: measured 2.1e-7 apart
# (logits ~0.6 at most: the weights are transformers' fresh std-0.02 initialisation). A wrong
# tensor mapping moves them by orders of magnitude more; computing in the converted config's
# bfloat16 instead of float32 moved them by 4e-3.
HF_LOGITS_ATOL = 1e-5

# The chat task: "a+b?" -> the sum, a, b digits: the answer is a function of the question, so
# learning it is measurable. These questions are never in the training set; generate --chat
# answers them.
HELD_OUT = ((0, 7), (3, 5), (6, 2), (9, 9))
# Every answer has a fixed non-empty think block before the sum. Qwen3's template renders an
# empty `<think>\n\n</think>\n\n` into the last assistant turn, which carries no loss, and its
# generation prompt ends at `<|im_start|>assistant\n`: a fresh model never learns to write that
# block. A non-empty one is trained (docs/data.md), so the model learns to open and close it.
THINK = "sum"
# Trained targets per conversation with the fixture's tokenizer: `<think>`, `\n`, `s`, `u`,
# `m`, `\n`, `</think>`, `\n`, `\n`, the sum's 1 or 2 digits, `<|im_end|>`: 11 or 12.
MAX_TRAINED_PER_CONVERSATION = 12


def _train_pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10) for b in range(10) if (a, b) not in HELD_OUT]


def _blind_ce() -> float:
    """The cross-entropy per trained target of a model that knows the form (the think block,
    the end of turn) and how often each sum occurs, but not the question: the entropy of the
    sum over the training questions, spread over at most 12 targets per conversation."""
    from collections import Counter

    counts = Counter(a + b for a, b in _train_pairs())
    n = sum(counts.values())
    entropy = -sum(c / n * math.log(c / n) for c in counts.values())
    return entropy / MAX_TRAINED_PER_CONVERSATION


def hf_logits(args: argparse.Namespace) -> str:
    """The checkpoint hf-to-orbax made from an HF fixture gives the fixture's logits
    (transformers') on its input_ids."""
    import jax.numpy as jnp
    import numpy as np

    hf = Path(args.hf)
    # config.json's dtype (bfloat16) is the converted config's compute dtype; the reference
    # logits are float32 ones.
    ckpt = Path(args.checkpoint)
    model = _run_model(ckpt / "config.yml", ckpt, ("model.dtype=float32",))
    ids = np.load(hf / "input_ids.npy")
    want = np.load(hf / "logits.npy")
    got = np.asarray(model(jnp.asarray(ids))[0])
    check(got.shape == want.shape, f"logit shapes {got.shape} vs transformers' {want.shape}")
    err = float(np.max(np.abs(got - want)))
    check(err <= HF_LOGITS_ATOL, f"max |logit difference| {err:.3g} > {HF_LOGITS_ATOL}")
    return f"converted logits {got.shape} == transformers' (max |diff| {err:.3g})"


def chats(args: argparse.Namespace) -> str:
    """Writes OUT/chats.jsonl (both line forms, some with a system message, the think block as
    reasoning_content or in the content) and OUT/held_out.txt (one question a line)."""
    import random

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    pairs = _train_pairs()
    lines: list[dict[str, Any]] = []
    for i in range(args.n):
        a, b = rng.choice(pairs)
        if i % 3 == 0:  # the think block in the content: the template moves it out
            completion = f"<think>\n{THINK}\n</think>\n\n{a + b}"
            lines.append({"prompt": f"{a}+{b}?", "completion": completion})
            continue
        msgs = [
            {"role": "user", "content": f"{a}+{b}?"},
            {"role": "assistant", "content": f"{a + b}", "reasoning_content": THINK},
        ]
        head = [{"role": "system", "content": "Add."}] if i % 3 == 1 else []
        lines.append({"messages": head + msgs})
    (out / "chats.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (out / "held_out.txt").write_text("".join(f"{a}+{b}?\n" for a, b in HELD_OUT))
    return f"{len(lines)} conversations over {len(pairs)} questions, {len(HELD_OUT)} held out"


def sft(args: argparse.Namespace) -> str:
    """The fine-tune from the converted HF checkpoint: every step's loss on the assistant
    tokens only (loss_tokens: ~12 per conversation, well under the row tokens), and the sums
    learnt: the final eval cross-entropy under half of a question-blind model's."""
    run = Path(args.run_dir)
    got = step_rows(run)
    steps = [r["step"] for r in got]
    check(steps == list(range(1, args.steps + 1)), f"logged steps {steps}, want 1..{args.steps}")
    counts = [int(r["loss_tokens"]) for r in got]
    # A conversation is ~30-37 tokens, 11-12 of them trained: measured 59-163 of the 512 per
    # step (rows end in padding where the next conversation does not fit).
    check(
        all(0 < c <= 0.4 * args.row_tokens for c in counts),
        f"loss_tokens {min(counts)}..{max(counts)} per step, want > 0 and at most 40% "
        f"of the {args.row_tokens} tokens per step (the assistant answers only)",
    )
    first, evals = got[0]["loss"], [r["eval_ce_loss"] for r in got if "eval_ce_loss" in r]
    check(bool(evals) and all(math.isfinite(x) for x in evals), f"eval losses {evals}")
    # The blind model's bound is ~0.23 nats (2.77 / 12); the 20 eval conversations' own sums
    # could let a blind model come somewhat under it by chance, not to half. Measured (400
    # steps): step 1 6.04 (ln 416, a fresh model), eval 0.26 at step 100 (the form learnt,
    # not the sums), 0.13 at 200, 0.088 at 300, 0.018 at 400.
    bar = _blind_ce() / 2
    check(
        evals[-1] < bar,
        f"not learnt: step 1 loss {first:.3f}, final eval_ce_loss {evals[-1]:.3f} (want below "
        f"{bar:.3f}, half the cross-entropy of a model that does not read the question)",
    )
    ckpts = complete_checkpoints(run)
    check(bool(ckpts) and ckpts[-1] == args.steps, f"checkpoints {ckpts}, want the last at N")
    return (
        f"loss {first:.4f} -> {got[-1]['loss']:.4f} on {min(counts)}-{max(counts)} trained "
        f"tokens per step, eval_ce_loss {evals[-1]:.4f} (< {bar:.3f}, half a question-blind "
        f"model's)"
    )


def chatted(args: argparse.Namespace) -> str:
    """generate --chat --jsonl on the held-out questions: one reply each, ended by the end of
    turn, in the trained form (the think block, then a sum 0..18), with no role header or user
    text."""
    path = Path(args.jsonl)
    got = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    want = [f"{a}+{b}?" for a, b in HELD_OUT]
    check([r["prompt"] for r in got] == want, f"replies to {[r['prompt'] for r in got]}")
    head = f"<think>\n{THINK}\n</think>\n\n"
    for r in got:
        check(r["eos"], f"no end of turn within the token budget for {r['prompt']!r}: {r}")
        text = r["completion"]
        check(
            text.startswith(head) and text[len(head) :] in {str(n) for n in range(19)},
            f"reply to {r['prompt']!r} is {text!r}, not {head!r} and a sum 0..18",
        )
    sums = [r["completion"][len(head) :] for r in got]
    right = sum(int(x) == a + b for x, (a, b) in zip(sums, HELD_OUT, strict=True))
    pairs = ", ".join(f"{r['prompt']} {x}" for r, x in zip(got, sums, strict=True))
    return f"{pairs} ({right} of {len(got)} right; the form is asserted, not the sums)"


def exported_tokenizer(args: argparse.Namespace) -> str:
    """orbax-to-hf of the fine-tuned run carries the HF tokenizer it was trained with: the
    fixture's tokenizer.json and tokenizer_config.json (with the chat template), byte for
    byte, and they load as the same tokenizer and template."""
    from moetext.data.chat_template import load_chat_template
    from moetext.data.tokenizer import load_tokenizer

    out, src = Path(args.hf), Path(args.source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        check((out / name).is_file(), f"{out} has no {name}")
        check((out / name).read_bytes() == (src / name).read_bytes(), f"{out / name} differs")
    check(
        "chat_template" in json.loads((out / "tokenizer_config.json").read_text()),
        f"{out}/tokenizer_config.json has no chat_template",
    )
    tok = load_tokenizer(str(out))
    conv = [{"role": "user", "content": "3+5?"}]
    text = load_chat_template(tok, None).render(conv, add_generation_prompt=True)
    ref = load_chat_template(load_tokenizer(str(src)), None).render(
        conv, add_generation_prompt=True
    )
    check(text == ref, f"the exported template renders {text!r}, the source's {ref!r}")
    return (
        f"tokenizer.json, tokenizer_config.json (chat template) exported ({tok.vocab_size} pieces)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="stage", required=True)
    stages: dict[str, Callable[[argparse.Namespace], str]] = {}

    def add(name: str, fn: Callable[[argparse.Namespace], str]) -> argparse.ArgumentParser:
        stages[name] = fn
        return sub.add_parser(name, help=(fn.__doc__ or "").split("\n")[0])

    s = add("prepare", prepare)
    s.add_argument("data_dir")
    s.add_argument("vocab_size", type=int)
    s = add("trained", trained)
    s.add_argument("run_dir")
    s.add_argument("steps", type=int)
    s.add_argument("--mtp", action="store_true", help="assert mtp_loss is logged and falls")
    s = add("wait-checkpoint", wait_checkpoint)
    s.add_argument("run_dir")
    s.add_argument("pid", type=int)
    s.add_argument("steps", type=int)
    s.add_argument("--timeout", type=float, default=180)
    s = add("killed", killed)
    s.add_argument("run_dir")
    s.add_argument("steps", type=int)
    s = add("resumed", resumed)
    s.add_argument("run_dir")
    s.add_argument("reference")
    s.add_argument("steps", type=int)
    s.add_argument("resumed_from", type=int)
    s = add("generated", generated)
    s.add_argument("jsonl")
    s.add_argument("prompts", type=int)
    s = add("hf-roundtrip", hf_roundtrip)
    s.add_argument("hf_a")
    s.add_argument("orbax")
    s.add_argument("hf_b")
    s.add_argument("checkpoint")
    s.add_argument("--mtp", action="store_true", help="assert the MTP module is exported")
    s = add("logits", logits)
    s.add_argument("config")
    s.add_argument("checkpoint")
    s.add_argument("hf")
    s = add("hf-logits", hf_logits)
    s.add_argument("checkpoint")
    s.add_argument("hf")
    s = add("chats", chats)
    s.add_argument("out")
    s.add_argument("n", type=int)
    s = add("sft", sft)
    s.add_argument("run_dir")
    s.add_argument("steps", type=int)
    s.add_argument("row_tokens", type=int)
    s = add("chatted", chatted)
    s.add_argument("jsonl")
    s = add("exported-tokenizer", exported_tokenizer)
    s.add_argument("hf")
    s.add_argument("source")
    args = p.parse_args(argv)
    # orbax warns on every restore of a run's state/ that it has no _CHECKPOINT_METADATA of
    # its own (the step directory holds it); absl is installed with jax and orbax.
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
    try:
        print(stages[args.stage](args))
    except CheckError as e:
        print(f"FAILED {args.stage}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
