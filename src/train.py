"""Entry point: `python -m train config.yml key=value ...` (see moetext.cli)."""

import sys

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from moetext import host_memory

# Before XLA's threads exist: its per-step host buffers are then reused instead of mapped and
# faulted in anew every step (moetext/host_memory.py; MOETEXT_REUSE_HOST_MEMORY=0 turns it off).
try:
    host_memory.reuse_freed_memory()
except ValueError as e:  # a bad MOETEXT_REUSE_HOST_MEMORY: one line, as the CLI's config errors
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)

from moetext.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(compilation_cache=True))
