"""The run directory: writable before anything compiles, room for a checkpoint, any filesystem.

Every run-dir path (config.yml, metrics.jsonl, tokenizer/, checkpoints/) goes through
`etils.epath`, as orbax and TFDS do, so a `gs://bucket/run` run dir works where a GCS backend
is installed (on TPU VMs: `pip install gcsfs`, or TensorFlow's tf.io.gfile). The tensorboard/
event files and profiler traces are written by tensorboardX and jax.profiler, which take the
path as a string and use their own filesystem support.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

import jax
from etils import epath

from moetext.errors import ConfigError


class RunDirError(ConfigError):
    """The run directory cannot be created or written (the CLI prints one line, exit 2)."""


def is_local(path: epath.PathLike) -> bool:
    return "://" not in os.fspath(path)


def prepare(run_dir: str) -> epath.Path:
    """Creates run_dir and proves it writable (a probe file written and removed, process 0);
    RunDirError naming the path and the reason otherwise."""
    path = epath.Path(os.path.expanduser(run_dir) if is_local(run_dir) else run_dir)
    if jax.process_index() != 0:
        return path
    probe = path / f".moetext-write-probe-{uuid.uuid4().hex}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except Exception as e:  # OSError locally; remote backends raise their own types
        raise RunDirError(
            f"train.run_dir={run_dir!r} is not writable ({type(e).__name__}: {e}); choose a "
            f"directory this user can create and write (a gs:// run dir needs a GCS backend: "
            f"pip install gcsfs)"
        ) from None
    return path


def state_bytes(tree: Any) -> int:
    """Global bytes of a pytree of arrays / ShapeDtypeStructs: one checkpoint's array data."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def free_space_warning(run_dir: epath.Path, checkpoint_bytes: int, keep: int) -> str | None:
    """A warning line when the run dir's filesystem has less room than one checkpoint (or than
    the `keep` checkpoints plus the one being written); None when it has room or is remote."""
    if not is_local(run_dir):
        return None
    free = shutil.disk_usage(os.fspath(run_dir)).free
    need_all = (keep + 1) * checkpoint_bytes  # orbax deletes the oldest after the new one lands
    if free >= need_all:
        return None

    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB"

    which = "one checkpoint" if free < checkpoint_bytes else f"{keep + 1} checkpoints"
    return (
        f"warning: {run_dir} has {gib(free)} free, less than {which} needs "
        f"({gib(checkpoint_bytes)} each, checkpoint.keep={keep}): saves may fail; free space "
        f"or lower checkpoint.keep"
    )
