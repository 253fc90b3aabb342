"""Orbax checkpoints of the whole train state, with automatic resume.

Layout: <run_dir>/checkpoints/<step>/{state, meta, data}. `state` holds params, optimizer
state, step and RNG (sharded arrays, restored straight onto the run's shardings); `meta` holds
the step and the run's resolved config (`config.to_dict`, written by process 0); `data` holds
each process's input position as `process_<i>-of-<n>.json` (grain's orbax handler), since each
process reads only its own rows. Orbax writes into `<step>.orbax-checkpoint-tmp` and renames it
on completion, after writing `commit_success.txt`.

Resume (`Checkpointer.restore_latest`) tries the steps newest to oldest. A step that is not
usable (no commit marker, an item missing, unreadable meta/data JSON, array files deleted or
truncated so that orbax/tensorstore fail to restore it, a step number that disagrees) is
reported on stderr with its path and why, moved aside to <run_dir>/checkpoints.broken/ (so the
resumed run can save that step again), and the previous one is tried. Half-written orbax
temporary directories newer than the step used are reported and left for orbax to replace.
When checkpoints exist but none is usable, resume stops with `CheckpointError` (a ConfigError:
the CLI prints one line and exits 2) rather than silently starting from scratch over them.

Before a step's arrays are restored, the caller's `check_meta` sees its meta (the training
loop compares the saved config with the run's: `config_check.check_config`).

With several processes they all resume from the same step: the candidate steps are those any
process sees, and each step's verdict (files and config, then the array restore) is agreed
through a collective (module agree), so a step damaged as one host sees it is skipped by all.
A restore that fails on one host only is agreed on too: the arrays are read through orbax's
handler, without the barrier orbax's Checkpointer ends a restore with (which a failed host
never reaches), and the verdict exchange after the restore is the one point all hosts meet.

The state restores onto the caller's shardings, whatever mesh, preset, device or process count
wrote it (orbax reads each shard's slice of the saved arrays): a run moves between slices.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from moetext.checkpoint import agree
from moetext.checkpoint.errors import Broken, CheckpointError, CheckpointWriteError
from moetext.checkpoint.meta import META, STATE, read_json
from moetext.checkpoint.orbax_noise import quiet_orbax_failures
from moetext.config import CheckpointConfig

ITEMS = (STATE, META, "data")
COMMIT_FILE = "commit_success.txt"  # orbax writes it last, into the step and each item
TMP_MARKER = ".orbax-checkpoint-tmp"  # orbax's half-written step directories


class Checkpointer:
    """<run_dir>/checkpoints through one orbax CheckpointManager: save (async by config),
    resume-time checks and restore (see the module docstring)."""

    def __init__(self, cfg: CheckpointConfig, run_dir: epath.PathLike):
        self.cfg = cfg
        run_dir = epath.Path(run_dir)
        self.directory = (run_dir if "://" in os.fspath(run_dir) else run_dir.absolute()) / (
            "checkpoints"
        )
        self._pending: int | None = None  # the step whose async save may still be running
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options)
        # Restores read the state item through its handler: see _restore_state.
        self._state_handler = ocp.StandardCheckpointHandler()
        quiet_orbax_failures()

    def latest_step(self) -> int | None:
        step: int | None = self._mngr.latest_step()  # (orbax is untyped: Any)
        return step

    def latest_path(self) -> str | None:
        step = self.latest_step()
        return None if step is None else os.fspath(self.directory / str(step))

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
        """Saves (async by config); data_state is this process's input position after `step`.
        CheckpointWriteError when this save, or the previous async one, failed to write."""
        try:
            saved = self._mngr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    meta=ocp.args.JsonSave(meta),
                    data=grain.checkpoint.CheckpointSave(_JsonState(data_state)),
                ),
                force=force,
            )
        except Exception as e:  # the storage's own error types (OSError, tensorstore, ...)
            raise self._write_error(e, step) from None
        if saved:
            self._pending = step
        return bool(saved)

    def _write_error(self, e: Exception, step: int) -> CheckpointWriteError:
        # An async save reports its failure at the next save (or wait): name the one pending.
        failed = self._pending if self._pending is not None else step
        self._pending = None
        complete = [s for s in self._scan()[0] if (self.directory / str(s) / COMMIT_FILE).exists()]
        kept = [s for s in complete if s != failed]
        previous = (
            f"the previous checkpoint {self.directory / str(max(kept))} is complete and kept"
            if kept
            else "no earlier checkpoint exists"
        )
        msg = " ".join(str(e).split()).split(" [tensorstore_spec=")[0]
        if len(msg) > 400:  # tensorstore's messages end with the OS's reason
            msg = f"{msg[:150]} ... {msg[-240:]}"
        return CheckpointWriteError(
            f"writing checkpoint {self.directory / str(failed)} failed ({type(e).__name__}: "
            f"{msg}); {previous}. Free space or fix the storage, then re-run the same command "
            f"to resume"
        )

    def restore(
        self, step: int, abstract_state: Any
    ) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
        """(state, meta, every process's data state) of one step, checked as restore_latest
        checks it; state lands on `abstract_state`'s shardings and dtypes (ShapeDtypeStructs).
        All processes' data states come back so a run can resume with another process count.
        CheckpointError when that step is unusable."""
        try:
            meta, data_states = self._check_structure(step)
            return self._restore_state(step, abstract_state), meta, data_states
        except Broken as e:
            path = self.directory / str(step)
            raise CheckpointError(f"{path}: unusable checkpoint ({e})") from None

    def restore_latest(
        self, abstract_state: Any, check_meta: Callable[[int, dict[str, Any]], None] | None = None
    ) -> tuple[int, Any, dict[str, Any], list[dict[str, Any]]] | None:
        """The newest usable checkpoint as (step, state, meta, data states), or None when there
        is none at all. Broken steps are reported on stderr and moved aside (newest to oldest);
        `check_meta(step, meta)` runs before a step's arrays are restored and may raise (a
        config mismatch stops the run instead of falling back). CheckpointError when
        checkpoints exist but none is usable."""
        local_steps, tmp_steps = self._scan()
        steps = agree.union(local_steps)  # every process walks the same candidates
        if not steps:  # at most a first save that never finished: nothing to resume
            for tmp in sorted(p for paths in tmp_steps.values() for p in paths):
                _report(f"{tmp}: half-written (an orbax temporary directory), ignored")
            return None
        broken: list[tuple[int, str]] = []
        for step in sorted(set(steps) | set(tmp_steps), reverse=True):
            for tmp in tmp_steps.get(step, []):
                _report(f"{tmp}: half-written (an orbax temporary directory), ignored")
            if step not in steps:
                continue
            path = self.directory / str(step)
            try:
                meta, data_states, state = self._try_step(step, abstract_state, check_meta)
            except Broken as e:
                _report(f"{path}: unusable checkpoint ({e}); trying the previous one")
                broken.append((step, str(e)))
                continue
            self._set_aside([s for s, _ in broken])
            return step, state, meta, data_states
        why = "; ".join(f"step {s}: {w}" for s, w in broken)
        raise CheckpointError(
            f"no usable checkpoint in {self.directory} ({why}). Fix or move that directory "
            f"to resume, or set checkpoint.resume=false / another train.run_dir to start over"
        )

    def _try_step(
        self,
        step: int,
        abstract_state: Any,
        check_meta: Callable[[int, dict[str, Any]], None] | None,
    ) -> tuple[dict[str, Any], list[dict[str, Any]], Any]:
        """(meta, data states, state) of `step` when every process can use it. The processes
        agree twice (module agree): on the files and config before any array is read, then on
        the restore. Broken when any process found it broken (naming that process), its own
        CheckpointError when `check_meta` refused it anywhere."""
        meta: dict[str, Any] = {}
        data_states: list[dict[str, Any]] = []
        failure: Exception | None = None
        try:
            meta, data_states = self._check_structure(step)
            if check_meta is not None:
                check_meta(step, meta)
        except (Broken, CheckpointError) as e:
            failure = e
        _agreed(failure)
        state = None
        try:
            state = self._restore_state(step, abstract_state)
        except Broken as e:
            failure = e
        _agreed(failure)
        return meta, data_states, state

    def _scan(self) -> tuple[list[int], dict[int, list[str]]]:
        """Numbered step directories, and orbax temporary directories by their step."""
        steps = set(self.all_steps())
        tmp: dict[int, list[str]] = {}
        for full in self.directory.iterdir() if self.directory.exists() else []:
            name = full.name
            if name.isdigit() and full.is_dir():
                steps.add(int(name))
            elif TMP_MARKER in name and name.split(".", 1)[0].isdigit():
                tmp.setdefault(int(name.split(".", 1)[0]), []).append(os.fspath(full))
        return sorted(steps), tmp

    def _check_structure(self, step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Cheap checks before any array is read: commit markers, items, meta and data JSON."""
        root = self.directory / str(step)
        if not (root / COMMIT_FILE).is_file():
            raise Broken(f"no {COMMIT_FILE}: the save never completed")
        for item in ITEMS:
            if not (root / item).is_dir():
                raise Broken(f"item {item!r} is missing")
            if not (root / item / COMMIT_FILE).is_file():
                raise Broken(f"item {item!r} has no {COMMIT_FILE}")
        if not (root / "state" / "_METADATA").is_file():
            raise Broken("state/_METADATA is missing")
        meta = read_json(root / "meta" / "metadata")
        if not isinstance(meta, dict) or meta.get("step") != step:
            raise Broken(f"meta/metadata does not name step {step}: {str(meta)[:200]}")
        files = sorted((root / "data").glob("process_*-of-*.json"))
        if not files:
            raise Broken("data/ holds no process_*-of-*.json input position")
        return meta, [read_json(f) for f in files]

    def _restore_state(self, step: int, abstract_state: Any) -> Any:
        # Through the state item's handler, not CheckpointManager.restore: orbax's Checkpointer
        # ends a restore with a barrier (a collective) that a host whose read failed never
        # reaches, so with damage only one host meets, the hosts would enter different
        # collectives (on CPU gloo aborts both: "collective mismatch"). The verdict exchange
        # after it (_agreed) is the barrier instead: every host reaches it, restored or not.
        try:
            state = self._state_handler.restore(
                self.directory / str(step) / STATE, args=ocp.args.StandardRestore(abstract_state)
            )
            got = int(state.step)  # reads the value: a damaged array fails here at the latest
        except Exception as e:  # orbax and tensorstore raise many types (ValueError, OSError..)
            msg = " ".join(str(e).split()).split(" See full TensorStore details")[0]
            raise Broken(f"restoring its arrays failed: {type(e).__name__}: {msg[:300]}") from None
        if got != step:
            raise Broken(f"its state.step is {got}")
        return state

    def _set_aside(self, steps: list[int]) -> None:
        """Moves broken step directories to <run_dir>/checkpoints.broken/ (process 0), so that
        the resumed run can save those steps again; orbax forgets them."""
        if not steps:
            return
        from jax.experimental import multihost_utils

        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("moetext_checkpoint_set_aside:pre")
        if jax.process_index() == 0:
            dest_root = self.directory.parent / (self.directory.name + ".broken")
            dest_root.mkdir(parents=True, exist_ok=True)
            for step in steps:
                dest, n = dest_root / str(step), 1
                while dest.exists():
                    dest, n = dest_root / f"{step}.{n}", n + 1
                (self.directory / str(step)).rename(dest)
                _report(f"moved {self.directory / str(step)} to {dest}")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("moetext_checkpoint_set_aside:post")
        self._mngr.reload()

    def wait(self) -> None:
        """Blocks until the pending async save is on storage; CheckpointWriteError if it
        failed."""
        try:
            self._mngr.wait_until_finished()
        except Exception as e:
            raise self._write_error(e, self._pending or 0) from None
        self._pending = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._state_handler.close()
            self._mngr.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs carrying each array's sharding: the restore target."""

    def abstract(x: Any) -> jax.ShapeDtypeStruct:
        sharding = getattr(x, "sharding", None)
        # jax: ShapeDtypeStruct.__init__ is unannotated.
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # type: ignore[no-untyped-call]

    return jax.tree.map(abstract, tree)


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


def _agreed(failure: Exception | None) -> None:
    """Returns when every process found the step usable so far; else raises the same verdict
    on every process: this process's own error, or one naming the processes that failed."""
    code = agree.OK if failure is None else agree.REFUSED
    if isinstance(failure, Broken):
        code = agree.BROKEN
    every = agree.verdicts(code, "" if failure is None else str(failure))
    worst = max(c for c, _ in every)
    if worst == agree.OK:
        return
    if failure is not None and code == worst:
        raise failure
    others = "; ".join(f"process {i}: {why}" for i, (c, why) in enumerate(every) if c == worst)
    if worst == agree.REFUSED:
        raise CheckpointError(others)
    raise Broken(others)


def _report(line: str) -> None:
    if jax.process_index() == 0:
        print(f"checkpoint: {line}", file=sys.stderr, flush=True)
