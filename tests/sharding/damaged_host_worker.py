"""The train CLI on a host that sees one checkpoint damaged: `python -m
tests.sharding.damaged_host_worker STEP config.yml key=value ...`.

Processes of a multi-host run share one checkpoint directory, so damage that only one host sees
(a stale cache, a local read error) cannot be made with files. This process reads
checkpoints/STEP/meta/metadata as unreadable, through the same check the real damage takes
(moetext.checkpoint.meta.read_json raising Broken); everything else is the real CLI.
"""

from __future__ import annotations

import sys
from typing import Any

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)

# isort: split
from etils import epath

from moetext.checkpoint import manager
from moetext.checkpoint.errors import Broken
from moetext.cli import main


def _damage(step: int) -> None:
    real = getattr(manager, "read_json")  # noqa: B009  (the name manager looks up)

    def read_json(path: epath.Path) -> Any:
        if path.name == "metadata" and path.parent.parent.name == str(step):
            raise Broken("meta/metadata is unreadable: OSError: [Errno 5] Input/output error")
        return real(path)

    setattr(manager, "read_json", read_json)  # noqa: B010


if __name__ == "__main__":
    _damage(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
