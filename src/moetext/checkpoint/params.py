"""Params-only reads of a checkpoint: a new run's params, already sharded (`load_params`:
checkpoint.load_params_from, decoding), or one leaf at a time as NumPy (`LeafReader`:
conversion to Hugging Face).

The source is any moetext checkpoint directory (a run's `checkpoints/<step>/` or a converted
checkpoint); only one item of its `state/` is read, by orbax partial restore: `params` here.
`load_model_state` reads the `model_state` item likewise (a router's selection bias: decoding
and a new run from a checkpoint need it as much as the params).
`read_item(directory, name, abstract)` restores any named item of the saved train state the
same way, each array straight onto the caller's sharding and dtype.

What the run's params look like is the caller's to say (`ParamsTarget`: it knows the model
family and the sharding plan, this package neither; `ParamsTarget.of_model` traces them from a
model builder and a plan's `shardings_for`). When the source was saved in the other
layer layout (scan_layers on vs off), the params are restored in the saved layout with the
shardings the run's rules give that layout, then restacked (or unstacked) by the family's
`stack_layers`/`unstack_layers` under jit, onto the run's shardings.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from moetext.checkpoint.config_check import shape_mismatches
from moetext.checkpoint.meta import STATE, read_meta_config
from moetext.checkpoint.orbax_noise import quiet_absent_step_metadata
from moetext.config import Config, ModelConfig
from moetext.errors import ConfigError

Params = nnx.State[Any, Any]
# Pure-dict params (nnx.to_pure_dict) of one layer layout -> the other, for a model config.
Relayout = Callable[[dict[str, Any], ModelConfig], dict[str, Any]]
PARAMS = "params"  # the train state's item holding the model's nnx.Param state
MODEL_STATE = "model_state"  # ... and the one holding its models.ModelState variables


@dataclasses.dataclass(frozen=True)
class ParamsTarget:
    """The params a run wants, described by its caller (train, generate and the tools build it
    from the model family and the sharding plan)."""

    abstract: Callable[[bool], Params]
    """scan_layers -> the model's nnx.Param state in that layer layout, as ShapeDtypeStructs
    carrying the run's shardings and param dtypes."""
    stack_layers: Relayout | None = None
    """The family's unscanned -> scan_layers conversion; None when it has one layout."""
    unstack_layers: Relayout | None = None
    """Its inverse."""

    @classmethod
    def of_model(
        cls,
        cfg: Config,
        build_model: Callable[[Config], nnx.Module],
        shardings_for: Callable[[Any], Any],
        *,
        stack_layers: Relayout | None = None,
        unstack_layers: Relayout | None = None,
        kind: Any = nnx.Param,
    ) -> ParamsTarget:
        """The `kind` state (nnx.Param; models.ModelState for the model state) of the module
        `build_model(cfg)` returns (traced, never allocated; cfg's model.scan_layers set to
        each layout asked for), each leaf with the sharding `shardings_for` (a sharding plan's)
        gives it."""

        def abstract(scan_layers: bool) -> Params:
            c = cfg.replace(model=dataclasses.replace(cfg.model, scan_layers=scan_layers))
            params = jax.eval_shape(lambda: nnx.state(build_model(c), kind))
            out: Params = jax.tree.map(
                # jax: ShapeDtypeStruct.__init__ is unannotated.
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),  # type: ignore[no-untyped-call]
                params,
                shardings_for(params),
            )
            return out

        return cls(abstract, stack_layers, unstack_layers)


def _absolute(directory: epath.PathLike) -> epath.Path:
    """A local path made absolute (orbax finds no tree metadata under a relative one: a run's
    `runs/...` checkpoint would look empty); a remote one (gs://...) as given."""
    text = os.fspath(directory)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def saved_items(directory: epath.PathLike) -> dict[str, Any]:
    """The item tree of a checkpoint's `state/` (item name -> its tree of array metadata),
    read without reading any array."""
    quiet_absent_step_metadata()
    meta = ocp.PyTreeCheckpointer().metadata(_absolute(directory) / STATE).item_metadata
    tree: dict[str, Any] = meta.tree if hasattr(meta, "tree") else meta
    return tree


def read_item(directory: epath.PathLike, name: str, abstract: Any) -> Any:
    """Item `name` of a checkpoint's saved state (e.g. "params"), restored onto `abstract`
    (its tree of ShapeDtypeStructs, each carrying the sharding and dtype to restore to); the
    other items are not read."""
    quiet_absent_step_metadata()
    restored = ocp.PyTreeCheckpointer().restore(
        _absolute(directory) / STATE,
        args=ocp.args.PyTreeRestore(
            item={name: abstract},
            restore_args={name: ocp.checkpoint_utils.construct_restore_args(abstract)},
            partial_restore=True,
        ),
    )
    return restored[name]


def load_params(directory: str, cfg: Config, target: ParamsTarget) -> Params:
    """The params of checkpoint `directory` for a run of `cfg` (sharded, in param_dtype, as
    `target.abstract` says). ConfigError when the directory is missing, is not a checkpoint,
    holds no params or was saved for another model (`shape_mismatches`)."""
    d = epath.Path(directory)
    where = f"checkpoint.load_params_from={directory}"
    if not d.exists():
        raise ConfigError(f"{where}: the directory does not exist")
    saved = read_meta_config(d)
    bad = shape_mismatches(saved, cfg, "the checkpoint", "this run")
    if bad:
        raise ConfigError(f"{where} does not fit this run's model: " + "; ".join(bad))
    tree = saved_items(d)
    if PARAMS not in tree:
        raise ConfigError(f"{where}: {d / STATE} holds no params")
    return _load_item(d, cfg, target, PARAMS, "stacks" in tree[PARAMS], where)


def load_model_state(directory: str, cfg: Config, target: ParamsTarget) -> Params | None:
    """The model state (models.ModelState variables, item `model_state`: e.g. a router's
    selection bias) of checkpoint `directory` for a run of cfg, laid out and sharded as
    `target` (made with kind=ModelState) says; None when the checkpoint holds none (a model
    without model state, or a conversion that wrote params only). Call after `load_params`,
    which checks the directory."""
    d = epath.Path(directory)
    tree = saved_items(d)
    if MODEL_STATE not in tree or not jax.tree.leaves(target.abstract(cfg.model.scan_layers)):
        return None
    saved_scanned = "stacks" in tree[MODEL_STATE]
    where = f"the model state of {directory}"
    return _load_item(d, cfg, target, MODEL_STATE, saved_scanned, where)


def _load_item(
    d: epath.Path, cfg: Config, target: ParamsTarget, item: str, saved_scanned: bool, where: str
) -> Params:
    """Item `item` of checkpoint d onto target's layout, relaid out from the saved one."""
    abstract = target.abstract(cfg.model.scan_layers)
    if saved_scanned == cfg.model.scan_layers:
        params: Params = read_item(d, item, abstract)
        return params
    relayout = target.stack_layers if cfg.model.scan_layers else target.unstack_layers
    if relayout is None:
        raise ConfigError(
            f"{where} was saved with scan_layers={saved_scanned}; model family "
            f"{cfg.model.family!r} cannot change the layer layout: set model.scan_layers="
            f"{str(saved_scanned).lower()}"
        )
    restored = read_item(d, item, target.abstract(saved_scanned))
    out_shardings = nnx.to_pure_dict(jax.tree.map(lambda x: x.sharding, abstract))

    def convert(pure: dict[str, Any]) -> dict[str, Any]:
        return relayout(pure, cfg.model)

    pure = jax.jit(convert, out_shardings=out_shardings)(nnx.to_pure_dict(restored))
    nnx.replace_by_pure_dict(abstract, pure)
    return abstract


class LeafReader:
    """One array at a time of a checkpoint's saved item (params by default), as NumPy: memory
    for one leaf, whatever the model's size."""

    def __init__(self, directory: epath.PathLike, item: str = PARAMS):
        self.dir = _absolute(directory) / STATE
        self.item = item
        self.tree: dict[str, Any] = saved_items(directory)[item]
        """The item's tree of array metadata (`.shape`, `.dtype` per leaf)."""
        self._ckptr = ocp.PyTreeCheckpointer()

    def get(self, path: tuple[str | int, ...]) -> np.ndarray:
        """The leaf at `path` (an nnx.Param's path; its array is the "value" under it)."""
        node: Any = {"value": 0}
        for key in reversed(path):
            node = {str(key): node}
        args = {self.item: _map_leaf(node, ocp.RestoreArgs(restore_type=np.ndarray))}
        restored = self._ckptr.restore(
            self.dir,
            args=ocp.args.PyTreeRestore(
                item={self.item: node}, restore_args=args, partial_restore=True
            ),
        )
        leaf: Any = restored[self.item]
        for key in path:
            leaf = leaf[str(key)]
        return np.asarray(leaf["value"])


def _map_leaf(node: Any, value: Any) -> Any:
    return {k: _map_leaf(v, value) for k, v in node.items()} if isinstance(node, dict) else value
