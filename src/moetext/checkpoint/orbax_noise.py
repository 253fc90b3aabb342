"""Quiet orbax's and tensorstore's own reports of a failed checkpoint save or restore.

`moetext.checkpoint` turns such a failure into one line (CheckpointWriteError, or a broken step
reported and skipped). Orbax also logs each failing background thread's traceback (absl),
asyncio logs the futures it left unretrieved, and tensorstore prints 'Event loop is closed' for
every pending callback; `quiet_orbax_failures()` drops exactly those reports, nothing else.
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import re
import sys
import threading
import warnings
from typing import Any


def _from_orbax(exc: BaseException | None) -> bool:
    """Whether an exception was raised in orbax's or tensorstore's checkpoint I/O, or is the
    'Event loop is closed' that tensorstore's completion callbacks hit once orbax has closed
    the event loop of a failed operation."""
    if exc is None:
        return False
    if _closed_loop_callback(exc):
        return True
    if re.match(r"[A-Z_]+: ", str(exc)):  # an absl::Status from tensorstore (C++, no frames)
        return True
    tb = exc.__traceback__
    while tb is not None:
        if "/orbax/" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _closed_loop_callback(exc: BaseException) -> bool:
    """RuntimeError('Event loop is closed') raised straight from asyncio's
    call_soon_threadsafe: a tensorstore completion callback arriving after orbax closed the loop
    of a failed operation (never an exception of the program itself)."""
    tb = exc.__traceback__
    return (
        isinstance(exc, RuntimeError)
        and str(exc) == "Event loop is closed"
        and tb is not None
        and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"
    )


# Orbax's warnings about an item it cannot read the metadata of, logged while it restores a
# damaged step (its array files deleted): the restore then fails and moetext reports the step
# (with the reason) in its own line; a step that restores is whole whatever orbax thought.
_DAMAGED_ITEM_WARNINGS = frozenset(
    {
        "Failed to get item metadata from directory %s. Either it was not present in the "
        "checkpoint, or the handler does not support it.",
    }
)


class _OrbaxFailureNoise(logging.Filter):
    """A failed save or restore surfaces as one CheckpointWriteError / broken-step line; orbax
    also logs each failing background thread's traceback (absl), asyncio logs the futures it
    left unretrieved, and tensorstore prints 'Event loop is closed' per pending callback. This
    drops those records (only records carrying such an exception), keeping the one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in _DAMAGED_ITEM_WARNINGS:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None and record.name == "asyncio" and isinstance(record.args, dict):
            exc = record.args.get("exception")
        from_orbax_thread = "raised an exception" in record.getMessage() and (
            "/orbax/" in record.pathname
        )
        return not (_from_orbax(exc) or from_orbax_thread)


@functools.cache  # once per process
def quiet_orbax_failures() -> None:
    """Installs _OrbaxFailureNoise, excepthooks (the interpreter's, threads' and unraisable
    exceptions') that drop tensorstore's stray 'Event loop is closed' reports, and a warnings
    filter for the orbax coroutine a failed restore leaves unawaited."""
    noise = _OrbaxFailureNoise()
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(noise)
    for handler in logging.getLogger().handlers:
        handler.addFilter(noise)
    previous = sys.excepthook

    def excepthook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        if _closed_loop_callback(value):
            return
        previous(tp, value, tb)

    sys.excepthook = excepthook
    previous_thread_hook = threading.excepthook

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None and _closed_loop_callback(args.exc_value):
            return
        previous_thread_hook(args)

    threading.excepthook = thread_excepthook
    previous_unraisable = sys.unraisablehook

    def unraisablehook(u: Any) -> None:
        if _from_orbax(u.exc_value):
            return
        previous_unraisable(u)

    sys.unraisablehook = unraisablehook
    # A restore that fails part-way can leave orbax's array-metadata coroutine unawaited (held
    # by the swallowed 'Event loop is closed' tracebacks above); Python warns when it is
    # collected. The failure itself has been reported in moetext's own line. The filter does
    # not reach the interpreter's final collection ('sys:1: RuntimeWarning: ...' on stderr), so
    # such garbage is collected at exit while it still applies.
    warnings.filterwarnings(
        "ignore",
        message=r"coroutine 'Store\._get_array_metadatas' was never awaited",
        category=RuntimeWarning,
    )
    atexit.register(gc.collect)


class _AbsentStepMetadata(logging.Filter):
    """Orbax warns 'Metadata file does not exist: <dir>/_CHECKPOINT_METADATA' whenever a
    checkpoint's `state/` is read on its own: that file lives one level up, in the step
    directory (a CheckpointManager step) or nowhere (a conversion). A routine fact, not a
    problem; every other orbax warning stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg == "Metadata file does not exist: %s"
            and isinstance(record.args, tuple)
            and len(record.args) == 1
            and str(record.args[0]).endswith("/_CHECKPOINT_METADATA")
        )


@functools.cache  # once per process
def quiet_absent_step_metadata() -> None:
    """Installs _AbsentStepMetadata on the absl logger (orbax logs through absl)."""
    logging.getLogger("absl").addFilter(_AbsentStepMetadata())
