"""Orbax checkpoints of the whole train state, with automatic resume.

Layout: <run_dir>/checkpoints/<step>/{state, meta, data}. `state` holds params, optimizer
state, step and RNG (sharded arrays, restored straight onto the run's shardings); `meta` holds
the step (written by process 0); `data` holds each process's input position as
`process_<i>-of-<n>.json` (grain's orbax handler), since each process reads only its own rows.
Orbax writes into a temporary directory and renames it on completion, so `latest_step()` only
ever sees complete checkpoints.
"""

from __future__ import annotations

import json
import os
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from moetext.config import CheckpointConfig


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: str | os.PathLike):
        self.cfg = cfg
        self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def latest_path(self) -> str | None:
        step = self.latest_step()
        return None if step is None else os.path.join(self.directory, str(step))

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def save(
        self,
        step: int,
        state: Any,
        meta: dict[str, Any],
        data_state: dict[str, Any],
        *,
        force: bool = False,
    ) -> bool:
        """Saves (async by config); data_state is this process's input position after `step`."""
        return self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(meta),
                data=grain.checkpoint.CheckpointSave(_JsonState(data_state)),
            ),
            force=force,
        )

    def restore(
        self, step: int, abstract_state: Any
    ) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
        """(state, meta, every process's data state); state lands on `abstract_state`'s
        shardings and dtypes (ShapeDtypeStructs). All processes' data states come back (not
        only this process's) so a run can resume with another number of processes."""
        restored = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        data_dir = epath.Path(self.directory) / str(step) / "data"
        files = sorted(data_dir.glob("process_*-of-*.json")) if data_dir.exists() else []
        if not files:
            raise FileNotFoundError(
                f"checkpoint {data_dir.parent} has no data position in {data_dir}"
            )
        data_states = [json.loads(f.read_text()) for f in files]
        return restored.state, dict(restored.meta), data_states

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs carrying each array's sharding: the restore target."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree,
    )


class _JsonState:
    """What grain's checkpoint handler saves: a snapshot taken at save time (the live iterator
    has read ahead by then, and an async save writes later)."""

    def __init__(self, value: dict[str, Any]):
        self.value = value
        self._bytes = json.dumps(value).encode()

    def get_state(self) -> bytes:
        return self._bytes

    def set_state(self, state: bytes) -> None:  # part of the handler's protocol; unused
        self.value = json.loads(state)
