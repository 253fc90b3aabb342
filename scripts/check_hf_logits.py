"""A moetext model's logits against transformers' on the same token ids, in two steps.

torch and transformers are never moetext dependencies, so the reference is made by a Python that
has them (a side venv, as for scripts/make_hf_fixture.py) and compared by moetext's own:

    HF_PY=/tmp/hfvenv/bin/python   # python3.12 -m venv /tmp/hfvenv; pip install torch transformers
    $HF_PY scripts/check_hf_logits.py reference --hf HF_DIR --out REF \\
        [--prompt TEXT ...| --ids ids.npy] [--max_tokens 32] [--dtype float32|bfloat16]
    .venv/bin/python scripts/check_hf_logits.py compare --checkpoint CKPT --reference REF \\
        [--config YML] [--atol A] [--min_top1 F] [section.key=value ...]

REF holds `input_ids.npy` (int32 [N, S]: the prompts, tokenized by HF_DIR's tokenizer with its
defaults and cut to --max_tokens, right-padded to the longest), `logits.npy` (float32
[N, S, V], every position of every row: N x S x V x 4 bytes, 4 x 16 x 151936 x 4 = 39 MB for
four 16-token prompts at Qwen3's vocab) and `reference.json` (prompts, their lengths,
transformers and torch versions, the dtype transformers ran in). Attention is causal, so the
padding after a prompt changes none of its logits: both sides run the padded rows without a
mask and only the first `length` positions of each row are compared. A directory with only
input_ids.npy and logits.npy (tests/fixtures/hf/*, made by scripts/make_hf_fixture.py) is a
float32 reference whose every position counts.

CKPT is a moetext checkpoint (`python -m moetext.convert hf-to-orbax` output, or a run's
checkpoints/<step>/), loaded onto the config's sharding preset as moetext.generate loads one,
or a Hugging Face directory (config.json + safetensors, loaded by moetext.convert.hf.load_model
on one device). moetext computes in float32 (model.dtype=float32; params in the config's
model.param_dtype: model.param_dtype=bfloat16 halves memory and loses nothing for bf16-stored
weights) with float32 matmuls (jax.default_matmul_precision("highest"): at JAX's default
precision TPUs multiply float32 operands in bfloat16).

A prompt passes when max |logit diff| <= --atol over its positions and the fraction of its
positions where both sides' argmax agree is >= --min_top1. Defaults, by the reference's dtype:

- float32: atol 5e-2, min_top1 0.9. The tiny fixtures differ by 1.6e-6 to 6.2e-6 (3-4
  layers, width 32, |logits| < 5). float32 rounding error grows ~sqrt(layers x width) (x32 at
  48 layers x 2048, x55 at 94 x 4096) and with the logits' magnitude (~30: x6), so ~1e-3 to
  2e-3 is expected at full size; 5e-2 leaves >= 25x for other summation orders and a near tie
  in a router's top-k. A wrong mapping (a transposed or swapped weight, a wrong RoPE theta)
  moves logits by O(1), 20x above it. Argmax can only differ where the reference's top two
  are within 2 x atol; min_top1 tolerates such near ties.
- bfloat16 (transformers in bf16, e.g. for Qwen3-235B-A22B, which needs ~940 GB of RAM in
  float32): atol 4.0, min_top1 0.8. Here top-1 agreement is the test and atol only a backstop
  for gross errors: bf16 keeps 8 mantissa bits, so transformers' logits are rounded by up to
  ~0.06 at magnitude 30 and 48-94 layers of rounded activations move them further. On the tiny
  fixtures a bf16 reference differs by 0.05-0.36 with top-1 agreement 1.0. These bounds are a
  judgement, not a measurement at 30B or 235B (nothing that size was run where this was
  written).

Exit status: 0 when every prompt passes; 1 with one `FAILED ...` line naming each failing
prompt and its numbers; 2 with one `error: ...` line for bad input (missing files, shapes that
disagree, a vocabulary other than the reference's, a checkpoint that is neither kind).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Mixture-of-experts language models route every token to",
    "机器学习是人工智能的一个分支，",
)
# (atol, min_top1) by the dtype transformers ran in: see the module docstring.
TOLERANCES = {"float32": (5e-2, 0.9), "bfloat16": (4.0, 0.8)}
IDS, LOGITS, META = "input_ids.npy", "logits.npy", "reference.json"


class InputError(ValueError):
    """Bad input the user can fix: printed as one `error:` line, exit 2."""


# --- reference (torch + transformers) ----------------------------------------------------------


Rows = tuple[np.ndarray, list[int], list[str | None], int]  # ids [N, S], lengths, texts, pad id


def _rows_from_file(ids_file: str) -> Rows:
    """--ids: every position of every row counts; no tokenizer needed."""
    if not Path(ids_file).is_file():
        raise InputError(f"--ids {ids_file} does not exist")
    ids = np.load(ids_file)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.size == 0:
        raise InputError(
            f"--ids {ids_file} holds {ids.dtype}{list(ids.shape)}; expected int [N, S]"
        )
    return ids, [ids.shape[1]] * ids.shape[0], [None] * ids.shape[0], 0


def _rows_from_prompts(hf_dir: str, prompts: Sequence[str], max_tokens: int) -> Rows:
    """The prompts as HF_DIR's tokenizer encodes them by default, cut, right-padded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    rows = [list(tok(t)["input_ids"])[:max_tokens] for t in prompts]
    if any(not r for r in rows):
        raise InputError("a prompt tokenizes to no tokens: give non-empty prompts")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    lengths = [len(r) for r in rows]
    ids = np.full((len(rows), max(lengths)), pad_id, np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids, lengths, list(prompts), int(pad_id)


def make_reference(
    hf_dir: str,
    out: str,
    prompts: Sequence[str] | None,
    ids_file: str | None,
    max_tokens: int,
    dtype: str,
    device_map: str | None,
) -> dict[str, Any]:
    """Runs transformers (eager attention) on the prompts or ids; writes REF; returns its meta."""
    if not (Path(hf_dir) / "config.json").exists():
        raise InputError(f"--hf {hf_dir} has no config.json (not a Hugging Face checkpoint)")
    if ids_file is not None:
        ids, lengths, texts, pad_id = _rows_from_file(ids_file)
    else:
        ids, lengths, texts, pad_id = _rows_from_prompts(
            hf_dir, prompts or DEFAULT_PROMPTS, max_tokens
        )
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
    kwargs: dict[str, Any] = {dtype_kw: torch_dtype, "attn_implementation": "eager"}
    if device_map:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)
    model.eval()
    with torch.no_grad():
        x = torch.from_numpy(ids.astype(np.int64)).to(model.device)
        logits = model(x).logits.float().cpu().numpy()
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    np.save(d / IDS, ids.astype(np.int32))
    np.save(d / LOGITS, logits.astype(np.float32))
    meta = {
        "hf_dir": str(Path(hf_dir).resolve()),
        "prompts": texts,
        "lengths": lengths,
        "pad_id": int(pad_id),
        "dtype": dtype,
        "attn_implementation": "eager",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "logits_shape": list(logits.shape),
    }
    (d / META).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return meta


# --- compare (moetext) -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reference:
    ids: np.ndarray  # int32 [N, S]
    logits: np.ndarray  # float32 [N, S, V]
    lengths: list[int]  # positions compared per row
    prompts: list[str | None]
    dtype: str  # what transformers computed in
    directory: str


def read_reference(ref_dir: str) -> Reference:
    """REF as `reference` writes it, or a fixture directory (ids + float32 logits only)."""
    d = Path(ref_dir)
    if not d.is_dir():
        raise InputError(f"--reference {ref_dir} is not a directory")
    for name in (IDS, LOGITS):
        if not (d / name).exists():
            raise InputError(f"--reference {ref_dir} has no {name} (run the reference step)")
    ids, logits = np.load(d / IDS), np.load(d / LOGITS)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{d / IDS} holds {ids.dtype}{list(ids.shape)}; expected int [N, S]")
    if logits.ndim != 3 or logits.shape[:2] != ids.shape:
        raise InputError(
            f"{d / LOGITS} has shape {list(logits.shape)}; {IDS} is {list(ids.shape)}, so "
            f"expected [{ids.shape[0]}, {ids.shape[1]}, vocab]"
        )
    n, s = ids.shape
    if ids.size == 0:
        raise InputError(f"{d / IDS} is empty ({list(ids.shape)})")
    meta: dict[str, Any] = {}
    if (d / META).exists():
        try:
            meta = json.loads((d / META).read_text())
        except ValueError as e:
            raise InputError(f"{d / META} is not JSON: {e}") from e
    lengths = [int(x) for x in meta.get("lengths", [s] * n)]
    if len(lengths) != n or not all(1 <= x <= s for x in lengths):
        raise InputError(f"{d / META} lengths {lengths} must be {n} values in [1, {s}]")
    prompts = list(meta.get("prompts", [None] * n))
    if len(prompts) != n:
        raise InputError(f"{d / META} has {len(prompts)} prompts for {n} rows of {IDS}")
    dtype = str(meta.get("dtype", "float32"))
    if dtype not in TOLERANCES:
        raise InputError(f"{d / META} dtype {dtype!r} is not one of {', '.join(TOLERANCES)}")
    return Reference(
        ids.astype(np.int32), logits.astype(np.float32), lengths, prompts, dtype, ref_dir
    )


@dataclasses.dataclass(frozen=True)
class RowResult:
    row: int
    prompt: str | None
    positions: int
    max_diff: float
    at: int  # the position of max_diff
    top1: float  # fraction of positions whose argmax agrees
    kl: float  # mean KL(reference || moetext), nats
    passed: bool

    def label(self) -> str:
        text = f" {self.prompt[:40]!r}" if self.prompt is not None else ""
        return f"prompt {self.row}{text} ({self.positions} token{'s' * (self.positions != 1)})"


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    out: np.ndarray = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    return out


def compare_logits(
    got: np.ndarray, ref: Reference, atol: float, min_top1: float
) -> list[RowResult]:
    """Per row, over its first `length` positions: max |diff|, argmax agreement, mean KL."""
    out = []
    for i, n in enumerate(ref.lengths):
        g, r = got[i, :n].astype(np.float64), ref.logits[i, :n].astype(np.float64)
        diff = np.abs(g - r).max(-1)
        at = int(diff.argmax())
        top1 = float((g.argmax(-1) == r.argmax(-1)).mean())
        lr = _log_softmax(r)
        kl = float((np.exp(lr) * (lr - _log_softmax(g))).sum(-1).mean())
        ok = bool(diff[at] <= atol and top1 >= min_top1)  # NaN fails
        out.append(RowResult(i, ref.prompts[i], n, float(diff[at]), at, top1, kl, ok))
    return out


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").exists()


def _kernels_from(overrides: Sequence[str]) -> Any:
    """KernelsConfig from kernels.* overrides (the only ones an HF directory takes)."""
    from moetext import config as config_lib
    from moetext import models  # noqa: F401  (the families' config sections)

    other = [o for o in overrides if not o.startswith("kernels.")]
    if other:
        raise InputError(
            f"a Hugging Face directory takes only kernels.* overrides, got {' '.join(other)}; "
            "convert it (python -m moetext.convert hf-to-orbax) to use a full config"
        )
    return config_lib.load("configs/base.yml", overrides).kernels


def _config_path(ckpt: Path, config: str | None) -> Path:
    """--config, else CKPT/config.yml (a conversion), else RUN_DIR/config.yml (a step dir)."""
    candidates = (
        [Path(config)] if config else [ckpt / "config.yml", ckpt.parent.parent / "config.yml"]
    )
    for c in candidates:
        if c.exists():
            return c
    raise InputError(
        f"no config for {ckpt}: looked for {', '.join(map(str, candidates))}; pass --config"
    )


def moetext_logits(
    checkpoint: str, ref: Reference, config: str | None, overrides: Sequence[str]
) -> np.ndarray:
    """float32 logits [N, S, V] of the reference's ids from CKPT, computed in float32; the
    model's vocabulary is checked against the reference's before any weight is read."""
    ckpt = Path(checkpoint)
    if not ckpt.is_dir():
        raise InputError(f"--checkpoint {checkpoint} is not a directory")
    if _is_hf_dir(ckpt):
        if config:
            raise InputError("--config applies to a moetext checkpoint, not a Hugging Face dir")
        return _hf_dir_logits(ckpt, ref, overrides)
    if not (ckpt / "state").is_dir():
        raise InputError(
            f"--checkpoint {checkpoint} is neither a moetext checkpoint (state/, meta/) nor a "
            "Hugging Face directory (config.json)"
        )
    return _checkpoint_logits(ckpt, ref, _config_path(ckpt, config), overrides)


def _hf_dir_logits(hf_dir: Path, ref: Reference, overrides: Sequence[str]) -> np.ndarray:
    """load_model's float32 model of an HF directory, on one device."""
    import jax
    from flax import nnx

    from moetext.convert.hf import config_from_hf_dir, load_model

    kernels = _kernels_from(overrides)
    check_vocab(config_from_hf_dir(hf_dir).model.vocab_size, str(hf_dir / "config.json"), ref)
    _, model = load_model(hf_dir, dtype="float32", kernels=kernels)
    graphdef, state = nnx.split(model)  # params as arguments, not constants baked into the jit

    def fwd(st: Any, t: jax.Array) -> jax.Array:
        logits: jax.Array = nnx.merge(graphdef, st)(t)[0]
        return logits

    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(fwd)(state, ref.ids))


def _checkpoint_logits(
    ckpt: Path, ref: Reference, config: Path, overrides: Sequence[str]
) -> np.ndarray:
    """A moetext checkpoint's params on the config's preset (as moetext.generate.load loads
    them, unprefused: the training forward), computed in float32."""
    import jax
    from flax import nnx

    from moetext import checkpoint, models, program
    from moetext import config as config_lib
    from moetext.generate import batch_shards
    from moetext.sharding.mesh import initialize_distributed

    cfg = config_lib.load(config, ["model.dtype=float32", *overrides])
    check_vocab(cfg.model.vocab_size, f"{config} with the overrides", ref)
    initialize_distributed(cfg.distributed)  # before anything touches devices
    plan = program.make_plan(cfg)
    params = checkpoint.load_params(str(ckpt), cfg, program.params_target(cfg, plan))
    abstract = nnx.eval_shape(
        lambda: models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=0))
    )
    graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]
    # The batch is split over the preset's batch axes: pad it with copies of row 0, cut after.
    ids = ref.ids
    n, k = ids.shape[0], batch_shards(plan)
    padded = np.concatenate([ids, np.repeat(ids[:1], -n % k, axis=0)])

    def fwd(p: Any, t: jax.Array) -> jax.Array:
        logits: jax.Array = nnx.merge(graphdef, p, rest)(t)[0]
        return logits

    # Replicated out: every process of a multi-host run holds all N x S x V logits.
    with plan.rules(), jax.default_matmul_precision("highest"):
        logits = jax.jit(fwd, out_shardings=plan.replicated)(params, padded)
    return np.asarray(logits)[:n]


def check_vocab(vocab: int, source: str, ref: Reference) -> None:
    """The model's vocabulary (as `source` gives it) is the reference's and holds its ids."""
    if vocab != ref.logits.shape[2]:
        raise InputError(
            f"model.vocab_size={vocab} ({source}) but the reference logits have vocab "
            f"{ref.logits.shape[2]} ({ref.directory})"
        )
    ids = ref.ids
    if ids.min() < 0 or ids.max() >= vocab:
        raise InputError(
            f"{ref.directory}/{IDS} has token ids in [{ids.min()}, {ids.max()}], outside "
            f"[0, {vocab})"
        )


def run_compare(args: argparse.Namespace) -> int:
    ref = read_reference(args.reference)
    atol, min_top1 = TOLERANCES[ref.dtype]
    atol = args.atol if args.atol is not None else atol
    min_top1 = args.min_top1 if args.min_top1 is not None else min_top1
    got = moetext_logits(args.checkpoint, ref, args.config, args.overrides)
    results = compare_logits(got, ref, atol, min_top1)
    for r in results:
        print(
            f"{r.label()}: max |diff| {r.max_diff:.3g} at position {r.at}, top-1 agree "
            f"{r.top1:.3f}, KL {r.kl:.3g}"
        )
    bad = [r for r in results if not r.passed]
    if bad:
        print(
            "FAILED "
            + "; ".join(
                f"{r.label()}: max |diff| {r.max_diff:.3g} at position {r.at} (atol {atol:g}), "
                f"top-1 agree {r.top1:.3f} (min {min_top1:g})"
                for r in bad
            )
        )
        return 1
    print(
        f"ok: {len(results)} prompts within atol {atol:g} with top-1 agreement >= "
        f"{min_top1:g} ({ref.dtype} reference)"
    )
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    split = doc.index("A prompt passes")  # the pass criterion and its defaults: compare --help
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="check_hf_logits.py", description=doc[:split], formatter_class=raw
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("reference", help="transformers' logits (needs torch + transformers)")
    r.add_argument("--hf", required=True, help="Hugging Face directory (config.json, weights)")
    r.add_argument("--out", required=True, help="directory for input_ids.npy, logits.npy, json")
    src = r.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="repeat; default: 4 built-in prompts")
    src.add_argument("--ids", help="int [N, S] .npy of token ids instead of prompts")
    r.add_argument("--max_tokens", type=int, default=32, help="cut each prompt to this")
    r.add_argument(
        "--dtype",
        choices=tuple(TOLERANCES),
        default="float32",
        help="transformers' dtype (bfloat16 halves RAM; compare then defaults to looser bounds)",
    )
    r.add_argument("--device_map", help="passed to from_pretrained, e.g. auto (accelerate)")
    c = sub.add_parser(
        "compare",
        help="moetext's logits against a reference (no torch)",
        description=doc[split:],
        formatter_class=raw,
    )
    c.add_argument("--checkpoint", required=True, help="hf-to-orbax output, a step dir, or HF dir")
    c.add_argument("--reference", required=True, help="the reference step's --out")
    c.add_argument("--config", help="default: CKPT/config.yml, else the run's config.yml")
    c.add_argument(
        "--atol",
        type=float,
        help="max |logit diff| per prompt (default: "
        + ", ".join(f"{a:g} for a {d} reference" for d, (a, _) in TOLERANCES.items())
        + ")",
    )
    c.add_argument(
        "--min_top1",
        type=float,
        help="least fraction of a prompt's positions whose argmax agrees (default: "
        + ", ".join(f"{m:g} for a {d} reference" for d, (_, m) in TOLERANCES.items())
        + ")",
    )
    c.add_argument("overrides", nargs="*", help="section.key=value for the moetext config")
    # Overrides may come between options (`a=b --atol 1 c=d`): argparse leaves later ones over.
    args, extra = p.parse_known_args(argv)
    unknown = [e for e in extra if args.command != "compare" or e.startswith("-") or "=" not in e]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "compare":
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "reference":
            if args.max_tokens < 1:
                raise InputError(f"--max_tokens must be >= 1, got {args.max_tokens}")
            try:
                meta = make_reference(
                    args.hf,
                    args.out,
                    args.prompt,
                    args.ids,
                    args.max_tokens,
                    args.dtype,
                    args.device_map,
                )
            except ImportError as e:  # moetext's venv: no torch, by design
                raise InputError(
                    f"reference needs torch and transformers ({e}); run it with a Python that "
                    "has them (see scripts/make_hf_fixture.py for a side venv)"
                ) from e
            size = (Path(args.out) / LOGITS).stat().st_size
            print(
                f"wrote {args.out}: logits {meta['logits_shape']} ({size / 1e6:.1f} MB, "
                f"{args.dtype} transformers {meta['transformers_version']})"
            )
            return 0
        import logging

        import moetext  # noqa: F401  (quiets libtpu's TPU probing before jax starts)
        from moetext.errors import ConfigError

        logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's routine warnings
        try:
            return run_compare(args)
        except ConfigError as e:
            raise InputError(str(e)) from e
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
