"""What a checkpoint read or write raises."""

from __future__ import annotations

from moetext.errors import ConfigError


class CheckpointError(ConfigError):
    """Checkpoints that cannot be resumed: none usable, or saved with an incompatible config."""


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (disk full, permissions, a storage error); the
    complete checkpoints before it are untouched."""


class Broken(Exception):
    """One step that cannot be used (internal: resume falls back to the previous step)."""
