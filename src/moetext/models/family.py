"""Model families by name: one folder each under `moetext/models/`, registered in one line.

A `ModelFamily` is everything the rest of moetext needs to know about an architecture:

    build            (model_cfg, moe_cfg, kernels_cfg, rngs) -> a `CausalLM` nnx.Module
    moe_layers       which of its layers hold an MoE block (labels metrics' expert_load rows)
    count_params     analytic total / active / embedding parameter counts
    flops_per_token  training FLOPs per token (the trainer's MFU, the AOT report)
    logical_axes     every logical axis name its params and activations use; the trainer checks
                     the sharding preset covers them before anything is built
    stack_layers /   (optional) param tree unscanned <-> scan_layers layout, so a checkpoint of
    unstack_layers   one layout loads into a run of the other; stacked_path places one unscanned
    stacked_path     param in the stacked layout (conversion reads one stacked leaf at a time)
    hf               (optional) its Hugging Face adapter (models/hf.py: model_types, config.json
                     both ways, the tensor map, weight preprocessing)
    decode_cache     (optional) what its decode cache holds, as CacheArray leaves (shape, dtype,
                     logical axes): GQA keys and values per layer, a compressed latent for MLA

The family's folder holds its module tree, its counts and (with checkpoint conversion) its
Hugging Face adapter; `register_family(FAMILY)` at the end of its `__init__.py` and one import
line in `moetext/models/__init__.py` make `model.family: <name>` build it. A family may also be
registered from outside the package (tests/models/test_family.py trains one defined in a test).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any, Protocol, TypedDict, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from moetext.config.families import as_family_class, register_family_config
from moetext.config.schema import KernelsConfig, ModelConfig, MoEConfig
from moetext.errors import ConfigError
from moetext.models.hf import HfAdapter, ParamPath
from moetext.models.layers import scan
from moetext.models.moe.routers import get_router


class ParamCounts(TypedDict):
    total: int
    """Every parameter (a tied embedding/LM head counted once)."""
    active: int
    """Parameters a token's forward pass touches (K of E routed experts)."""
    embedding: int
    """The token embedding table."""


EXTRA_LOSS_KEY = "extra_loss"
"""aux key of a model's weighted loss terms beyond moe_loss (DeepSeek-V3: mtp_loss_weight x
mtp_loss), a float32 scalar the trainer adds to the loss like moe_loss; absent means 0."""


def added_loss(aux: dict[str, jax.Array]) -> jax.Array:
    """What the trainer adds to the CE from a model's aux: moe_loss + extra_loss (if any), both
    already weighted by the model, so the trainer never reads a model's loss weights."""
    moe_loss = aux["moe_loss"]
    return moe_loss + aux[EXTRA_LOSS_KEY] if EXTRA_LOSS_KEY in aux else moe_loss


class CausalLM(Protocol):
    """What a family's `build` returns: the trainer, evaluation and decoding call only this.

    logits_BSV float32; aux holds float32 scalars moe_loss (weighted, added to the loss),
    load_balance_loss, router_z_loss, dropped_fraction and, with MoE layers, expert_load
    [num_moe_layers, E] (see models/moe/block.py: AUX_KEYS, LOAD_KEY). A model with more loss
    terms adds them, weighted, as aux[EXTRA_LOSS_KEY] ("extra_loss"), and their unweighted
    values under their own names for logging (mtp_loss): the trainer's loss (train and eval) is
    ce + `added_loss(aux)` = ce + moe_loss + extra_loss. Every scalar of aux is a metric (JSONL,
    TensorBoard); with gradient accumulation each is the mean over the micro-batches."""

    def __call__(
        self,
        tokens_BS: jax.Array,
        *,
        positions_BS: jax.Array | None = None,
        segment_ids_BS: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]: ...


@runtime_checkable
class HiddenStatesLM(CausalLM, Protocol):
    """A CausalLM whose training loss may skip the [B, S, V] logits (optional; the trainer falls
    back to `__call__`'s logits for a model without it, or with loss_chunk_size 0).

    hidden_states returns (x_BSD, aux): `__call__` before its LM head, so the logits are
    x_BSD @ head_VD().T (x_BSD in the compute dtype, head_VD() [V, D] in any float dtype);
    loss_chunk_size is the most vocab rows per chunk of the fused loss (program/loss.py), 0 to
    compute the loss from the logits; loss_chunks how it chunks (auto, vocab, tokens)."""

    @property
    def loss_chunk_size(self) -> int: ...

    @property
    def loss_chunks(self) -> str: ...

    def hidden_states(
        self,
        tokens_BS: jax.Array,
        *,
        positions_BS: jax.Array | None = None,
        segment_ids_BS: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]: ...

    def head_VD(self) -> jax.Array: ...


# (h_BSD in the compute dtype, head_VD, targets_BS, mask_BS) -> (nll_sum, count), float32.
NllFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class LossTargets:
    """What the trainer's loss hands a `TargetsLM`'s training forward: the batch's next-token
    targets, which targets count, and the trainer's LM-head loss to score more heads with."""

    targets_BS: jax.Array
    """int32 [B, S]: the token after each input position (the batch's tokens[:, 1:])."""
    mask_BS: jax.Array
    """bool [B, S]: the targets the CE counts (data.batch.target_mask: not padding, same
    document as their input token, marked in a chat batch's loss_mask)."""
    nll: NllFn
    """The trainer's masked NLL of hidden states under an LM head: the fused, vocab-chunked
    loss (program/loss.py) when the model's loss_chunk_size > 0, else through the logits."""
    step_mask_BS: jax.Array | None = None
    """bool [N * B, S]: mask_BS of the whole step when this batch is one of its N micro-batches
    (gradient accumulation, an eval batch in micro-batches); None when the batch is the step."""
    step_segment_ids_BS: jax.Array | None = None
    """int32 [N * B, S]: the whole step's input segment ids, with step_mask_BS."""

    @property
    def micro_batches(self) -> int:
        """N: how many micro-batches of this batch's size the step has (1 without a step)."""
        if self.step_mask_BS is None:
            return 1
        return self.step_mask_BS.shape[0] // self.mask_BS.shape[0]


@runtime_checkable
class TargetsLM(CausalLM, Protocol):
    """A CausalLM whose training loss needs the targets beyond the main next-token CE (optional;
    DeepSeek-V3's multi-token prediction).

    When reads_targets is True, the trainer's loss (train and eval steps) calls `__call__` or
    `hidden_states` with the keyword `targets=LossTargets(...)`; the model then adds its extra
    terms to aux (EXTRA_LOSS_KEY weighted, their unweighted values by name, listed in
    loss_terms: the eval step reports each as eval_<name>). Without targets (decoding, logits
    for tests) it runs as a plain CausalLM.

    The trainer takes the mean over micro-batches of every aux term, so a term that is a mean
    over counted targets stays exact under gradient accumulation when the model divides each
    micro-batch's sum by the step's count over N (LossTargets.step_mask_BS, micro_batches):
    the N means then average to the sum over the step / the step's count, as without
    accumulation (the main CE is normalised the same way: by the step's count of targets)."""

    @property
    def reads_targets(self) -> bool: ...

    @property
    def loss_terms(self) -> tuple[str, ...]:
        """The aux names of the unweighted extra loss terms (empty when it adds none)."""
        ...


@runtime_checkable
class ModelStateLM(CausalLM, Protocol):
    """A CausalLM holding `ModelState` variables (models/layers/params.py) that change outside the
    gradient (optional; a model without it keeps its ModelState as built).

    The train step calls update_model_state(aux) once per optimizer step, after the update,
    inside the jitted step, on the model merged from the new params and the current model
    state: aux is the dict its forward returned for the step's batch (with gradient accumulation
    each entry is the mean over the micro-batches). It assigns its ModelState variables' new
    values (`var[...] = ...`, traced: no host sync); a step skipped as non-finite keeps the old
    ones.

    A model may also define accumulate_model_state(aux): with gradient accumulation it is
    called after each micro-batch with that micro-batch's aux, and the next micro-batch runs on
    the state it leaves (e.g. a global-batch load buffer, which update_model_state resets)."""

    def update_model_state(self, aux: dict[str, jax.Array]) -> None: ...


Builder = Callable[[ModelConfig, MoEConfig, KernelsConfig, nnx.Rngs], nnx.Module]


@dataclasses.dataclass(frozen=True)
class CacheArray:
    """One array of a decode cache, before it exists: `ModelFamily.decode_cache` returns a
    pytree of these (the structure the model's `init_cache` and `cached` use), so that decoding
    allocates it and ahead-of-time compiles shard it by its logical axes without knowing what
    the family caches."""

    shape: tuple[int, ...]
    dtype: str
    names: tuple[str | None, ...]
    """Logical axis names, one per dim (sharding.logical rules map them to mesh axes)."""


def is_cache_array(x: Any) -> bool:
    return isinstance(x, CacheArray)


def zeros_cache(spec: Any) -> Any:
    """The cache of `spec` (a pytree of CacheArray) as zero arrays."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), spec, is_leaf=is_cache_array)


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    """The `model.family` value that selects it."""
    description: str
    """One line for docs and error messages."""
    build: Builder
    """(model_cfg, moe_cfg, kernels_cfg, rngs) -> nnx.Module following `CausalLM`; params drawn
    from rngs' "params" stream, each carrying its logical axis names."""
    moe_layers: Callable[[ModelConfig], tuple[bool, ...]]
    """Per layer, True where it holds an MoE block, in the order of aux["expert_load"] rows.
    Rows past its MoE layers (DeepSeek-V3's MTP layers, run after the stack in training) are
    labelled num_layers, num_layers + 1, ... in metrics."""
    count_params: Callable[[ModelConfig, MoEConfig], ParamCounts]
    flops_per_token: Callable[[ModelConfig, MoEConfig, int], float]
    """(model_cfg, moe_cfg, seq_len) -> training FLOPs per token (see models/flops.py)."""
    logical_axes: frozenset[str]
    """Every logical axis name of its params and activation constraints (tests check this is
    exactly what the built model uses)."""
    stack_layers: Callable[[dict[str, Any], ModelConfig], dict[str, Any]] | None = None
    """Params as nested dicts (nnx pure dict), unscanned -> the scan_layers layout; None when
    the family has one layout. Lets a checkpoint load into a run of the other layout."""
    unstack_layers: Callable[[dict[str, Any], ModelConfig], dict[str, Any]] | None = None
    """The inverse of stack_layers."""
    stacked_path: Callable[[ModelConfig, ParamPath], tuple[ParamPath, int | None]] | None = None
    """An unscanned param path -> (its path in the scan_layers layout, its index along the
    stacked axis, None for params outside the stack); None when the family has one layout."""
    hf: HfAdapter | None = None
    """The Hugging Face adapter; None: the family does not convert to or from HF."""
    model_config: type[ModelConfig] = ModelConfig
    """Its `model:` section class: ModelConfig, or a subclass with the family's own fields
    (config/families.py; the loader decodes `model:` into it)."""
    moe_config: type[MoEConfig] = MoEConfig
    """Its `moe:` section class, likewise."""
    decode_cache: Callable[[ModelConfig, int, int], Any] | None = None
    """(model_cfg, batch, length) -> the decode cache as a pytree of CacheArray (what the
    model's init_cache returns, zeroed); None: the family does not decode."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"model family name {self.name!r} must be a Python identifier")


def typed_family[M: ModelConfig, E: MoEConfig](
    name: str,
    description: str,
    *,
    model_config: type[M],
    moe_config: type[E],
    build: Callable[[M, E, KernelsConfig, nnx.Rngs], nnx.Module],
    moe_layers: Callable[[M], tuple[bool, ...]],
    count_params: Callable[[M, E], ParamCounts],
    flops_per_token: Callable[[M, E, int], float],
    logical_axes: frozenset[str],
    decode_cache: Callable[[M, int, int], Any] | None = None,
    hf: HfAdapter | None = None,
) -> ModelFamily:
    """A ModelFamily whose functions take its own section classes (the sections as
    config.families.as_family_class gives them: a base-class section built in code gets the
    family's fields at their defaults), with both layer layouts, unscanned and scan_layers
    (layers/scan.py), following moe_layers."""

    def model(m: ModelConfig) -> M:
        return as_family_class(m, model_config, "model", m.family)

    def sections(m: ModelConfig, moe: MoEConfig) -> tuple[M, E]:
        return model(m), as_family_class(moe, moe_config, "moe", m.family)

    def layers(m: ModelConfig) -> tuple[bool, ...]:
        return moe_layers(model(m))

    cache = decode_cache
    return ModelFamily(
        name=name,
        description=description,
        build=lambda m, moe, k, rngs: build(*sections(m, moe), k, rngs),
        moe_layers=layers,
        count_params=lambda m, moe: count_params(*sections(m, moe)),
        flops_per_token=lambda m, moe, seq_len: flops_per_token(*sections(m, moe), seq_len),
        logical_axes=logical_axes,
        stack_layers=lambda p, m: scan.stack_layers(p, layers(m)),
        unstack_layers=lambda p, m: scan.unstack_layers(p, layers(m)),
        stacked_path=lambda m, path: scan.stacked_path(path, layers(m)),
        hf=hf,
        model_config=model_config,
        moe_config=moe_config,
        decode_cache=None if cache is None else lambda m, b, n: cache(model(m), b, n),
    )


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Makes `model.family: <family.name>` build it; a second family of one name is an error
    unless replace=True. Returns the family (so a module can `FAMILY = register_family(...)`)."""
    old = _FAMILIES.get(family.name)
    if old is not None and old is not family and not replace:
        raise ValueError(
            f"model family {family.name!r} is already registered ({old.description}); pass "
            "replace=True to replace it"
        )
    register_family_config(
        family.name, family.model_config, family.moe_config, replace=replace or old is family
    )
    _FAMILIES[family.name] = family
    return family


def available_families() -> list[str]:
    return sorted(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The registered family `name`; a ConfigError with the valid names (and the nearest) if
    there is none."""
    if name not in _FAMILIES:
        near = difflib.get_close_matches(name, _FAMILIES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(
            f"model.family={name!r} is not a registered model family{hint}; valid names: "
            f"{', '.join(available_families())}"
        )
    return _FAMILIES[name]


def family_for_hf(config_json: dict[str, Any]) -> ModelFamily:
    """The registered family whose HF adapter reads config.json's model_type (the first
    registered, when several do); a ConfigError listing the supported model types otherwise."""
    kind = config_json.get("model_type")
    # A model_type belongs to the first family registered that reads it (the built-in one): a
    # family registered later with the same adapter (a variant, a test's) does not take it.
    readers: dict[str, ModelFamily] = {}
    for f in _FAMILIES.values():
        for t in f.hf.model_types if f.hf else ():
            readers.setdefault(t, f)
    if kind not in readers:
        supported = ", ".join(f"{t} ({f.name})" for t, f in sorted(readers.items()))
        raise ConfigError(
            f"config.json has model_type={kind!r}, which no model family reads; supported: "
            f"{supported}"
        )
    return readers[kind]


def hf_adapter(name: str) -> HfAdapter:
    """The HF adapter of family `name`; a ConfigError naming the families that convert."""
    family = get_family(name)
    if family.hf is None:
        convertible = [f.name for f in _FAMILIES.values() if f.hf]
        raise ConfigError(
            f"model.family={name!r} has no Hugging Face mapping; families that convert: "
            f"{', '.join(sorted(convertible))}"
        )
    return family.hf


def check_names(model_cfg: ModelConfig, moe_cfg: MoEConfig) -> None:
    """Every registry name the config uses exists (model.family, moe.router): one ConfigError
    naming the valid ones, before data or a model is built."""
    get_family(model_cfg.family)
    get_router(moe_cfg.router)


def build(
    model_cfg: ModelConfig, moe_cfg: MoEConfig, kernels_cfg: KernelsConfig, *, rngs: nnx.Rngs
) -> nnx.Module:
    """The model of `model_cfg.family`, with params initialised from `rngs` (stream "params")."""
    return get_family(model_cfg.family).build(model_cfg, moe_cfg, kernels_cfg, rngs)


def initial_model_state(
    model_cfg: ModelConfig,
    moe_cfg: MoEConfig,
    kernels_cfg: KernelsConfig,
    *,
    seed: int = 0,
    out_shardings: Any = None,
) -> nnx.State[Any, Any]:
    """The models.ModelState variables a new model of these configs starts with (e.g. the
    router's moe.initial_bias), computed without allocating the params (jit drops their
    initialisation); out_shardings as for jax.jit (None: default placement)."""
    from moetext.models.layers.params import ModelState

    def state() -> nnx.State[Any, Any]:
        model = build(model_cfg, moe_cfg, kernels_cfg, rngs=nnx.Rngs(params=seed))
        return nnx.state(model, ModelState)

    out: nnx.State[Any, Any] = jax.jit(state, out_shardings=out_shardings)()
    return out
