"""Every process resumes from the same checkpoint: verdicts exchanged through a collective.

With several processes, a step's files may look different from one host to another (a stale
cache, a local read error), and a process that restored step n while another fell back to
n - 2 would train a different model and hang at the next collective. So each process judges a
step on its own, the verdicts are all-gathered (jax.experimental.multihost_utils, a real
collective over the processes' devices), and every process acts on the same verdict: a step
any process cannot use is unusable for all. With one process nothing is exchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

OK, BROKEN, REFUSED = 0, 1, 2  # a process's verdict on one step
_MSG_BYTES = 400  # how much of each process's reason travels with its verdict


def verdicts(code: int, reason: str) -> list[tuple[int, str]]:
    """(code, reason) of every process, in process order, for this process's (code, reason)."""
    if jax.process_count() == 1:
        return [(code, reason)]
    from jax.experimental import multihost_utils

    raw = reason.encode()[:_MSG_BYTES]
    row_M = np.zeros(_MSG_BYTES + 2, np.int32)
    row_M[0], row_M[1] = code, len(raw)
    row_M[2 : 2 + len(raw)] = np.frombuffer(raw, np.uint8)
    rows_PM = np.asarray(multihost_utils.process_allgather(row_M)).reshape(-1, _MSG_BYTES + 2)
    return [
        (int(r[0]), bytes(r[2 : 2 + int(r[1])].astype(np.uint8)).decode(errors="replace"))
        for r in rows_PM
    ]


def union(steps: Sequence[int]) -> list[int]:
    """The steps any process sees, sorted: a step missing on one host is judged, not skipped."""
    if jax.process_count() == 1:
        return sorted(steps)
    from jax.experimental import multihost_utils

    counts = np.asarray(multihost_utils.process_allgather(np.int32(len(steps))))
    longest = int(counts.max())
    if longest == 0:
        return []
    padded = np.full(longest, -1, np.int32)
    padded[: len(steps)] = steps
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1)
    return sorted({int(s) for s in every if s >= 0})
