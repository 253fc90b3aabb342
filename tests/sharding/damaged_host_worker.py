"""The train CLI on a host that sees checkpoints damaged: `python -m
tests.sharding.damaged_host_worker META_STEP ARRAYS_STEP config.yml key=value ...`.

Processes of a multi-host run share one checkpoint directory, so damage that only one host sees
(a stale cache, a local read error) cannot be made with files. This process sees two kinds:

- checkpoints/META_STEP/meta/metadata unreadable, through the same check the real damage takes
  (moetext.checkpoint.meta.read_json raising Broken): found by the cheap checks, before any
  array is read;
- the array restore of checkpoints/ARRAYS_STEP failing with an OSError where a failed
  tensorstore read surfaces (orbax's StandardCheckpointHandler.restore, which orbax's own
  Checkpointer.restore calls too, before the barrier it ends with): found only by the restore.

Everything else is the real CLI.
"""

from __future__ import annotations

import sys
from typing import Any

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)

# isort: split
from etils import epath
from orbax.checkpoint import StandardCheckpointHandler

from moetext.checkpoint import manager
from moetext.checkpoint.errors import Broken
from moetext.cli import main


def _damage_meta(step: int) -> None:
    real = getattr(manager, "read_json")  # noqa: B009  (the name manager looks up)

    def read_json(path: epath.Path) -> Any:
        if path.name == "metadata" and path.parent.parent.name == str(step):
            raise Broken("meta/metadata is unreadable: OSError: [Errno 5] Input/output error")
        return real(path)

    setattr(manager, "read_json", read_json)  # noqa: B010


def _damage_arrays(step: int) -> None:
    real = StandardCheckpointHandler.restore

    def restore(self: Any, directory: Any, *args: Any, **kwargs: Any) -> Any:
        if epath.Path(directory).parent.name == str(step):  # checkpoints/<step>/state
            raise OSError(5, "Input/output error")
        return real(self, directory, *args, **kwargs)

    setattr(StandardCheckpointHandler, "restore", restore)  # noqa: B010


if __name__ == "__main__":
    _damage_meta(int(sys.argv[1]))
    _damage_arrays(int(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
