"""Errors the user can act on, importable from every moetext package (it imports nothing).

The CLI prints each as one line (no traceback) and exits 2: the input must change, not the code.
"""


class ConfigError(ValueError):
    """A config that cannot be used: unknown key, wrong type, missing file, impossible value or
    combination, a run directory or dataset that is not there."""
