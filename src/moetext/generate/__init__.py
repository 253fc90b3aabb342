"""Text generation from any moetext checkpoint: `python -m moetext.generate` (see docs/generate.md).

`load(config, checkpoint)` gives (cfg, model, tokenizer); `decode.generate_ids` continues token
ids with a KV cache; `generate_text` does both ends with the tokenizer.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flax import nnx

from moetext import checkpoint as checkpoint_lib
from moetext import config as config_lib
from moetext import models
from moetext.config import Config
from moetext.data.tokenizer import Tokenizer, load_tokenizer
from moetext.errors import ConfigError
from moetext.generate.decode import Generated, generate_ids
from moetext.generate.sampling import Sampling
from moetext.models.moe.decode import prefuse_all
from moetext.program import initial_model_state, make_plan, model_state_target, params_target
from moetext.sharding.plan import Plan


def batch_shards(plan: Plan) -> int:
    """How many ways the preset splits the batch (its "batch" rule's mesh axes)."""
    axes = plan.spec(("batch",))[0]
    names = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(plan.mesh.shape[a] for a in names if a is not None)


def find_tokenizer_for(checkpoint: str, cfg: Config) -> str:
    """The tokenizer a checkpoint was trained with: CHECKPOINT/tokenizer (a conversion), the
    run's RUN_DIR/tokenizer (a step directory), else the config's data.tokenizer."""
    ckpt = Path(checkpoint)
    candidates = [ckpt / "tokenizer", ckpt.parent.parent / "tokenizer"]
    if cfg.data.tokenizer:
        candidates.append(Path(cfg.data.tokenizer))
    for c in candidates:
        if c.exists():
            return os.fspath(c)
    raise ConfigError(
        f"no tokenizer found for {checkpoint} (looked in {', '.join(map(str, candidates))}); "
        "pass --tokenizer PATH (a tokenizer.json, a sentencepiece .model or a directory)"
    )


def load(
    config_path: str | os.PathLike[str],
    checkpoint: str,
    overrides: Sequence[str] = (),
    tokenizer: str | None = None,
) -> tuple[Config, Any, Tokenizer]:
    """(config, model with the checkpoint's params and model state, tokenizer). The model is
    built unscanned (decoding's layout; a scanned checkpoint is unstacked on load) and its
    experts prefused
    (models/moe/decode.py): it decodes, it does not train."""
    cfg = config_lib.load(config_path, overrides)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=False))
    path = tokenizer or find_tokenizer_for(checkpoint, cfg)
    try:
        tok = load_tokenizer(path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from e
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"tokenizer {path} has {tok.vocab_size} tokens, more than model.vocab_size="
            f"{cfg.model.vocab_size}"
        )
    plan = make_plan(cfg)
    params = checkpoint_lib.load_params(checkpoint, cfg, params_target(cfg, plan))
    # The model state (a router's selection bias) routes tokens as much as the params do: the
    # checkpoint's, else the one a new model starts with.
    model_state = checkpoint_lib.load_model_state(checkpoint, cfg, model_state_target(cfg, plan))
    if model_state is None:
        model_state = initial_model_state(cfg, plan)
    abstract = nnx.eval_shape(
        lambda: models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=0))
    )
    graphdef, _, _, rest = nnx.split(abstract, nnx.Param, models.ModelState, ...)  # type: ignore[misc]
    model = nnx.merge(graphdef, params, model_state, rest)
    # Decoding's expert layout: one [E, D, 2F] gate|up weight per layer, on kernels.decode_moe.
    prefuse_all(model, cfg.kernels.decode_moe)
    return cfg, model, tok


def generate_text(
    model: Any,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    seed: int = 0,
    max_len: int | None = None,
    batch_multiple: int = 1,
) -> tuple[list[str], Generated]:
    """Completions (text after each prompt, up to EOS or max_new_tokens) and the raw result."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    ids = [bos + tokenizer.encode(p) for p in prompts]
    out = generate_ids(
        model,
        ids,
        max_new_tokens=max_new_tokens,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        sampling=sampling,
        seed=seed,
        max_len=max_len,
        batch_multiple=batch_multiple,
    )
    return [tokenizer.decode(t) for t in out.tokens], out


__all__ = ["Generated", "Sampling", "generate_ids", "generate_text", "load"]
