"""Entry point: `python -m train config.yml key=value ...` (see moetext.cli)."""

import sys

import moetext  # noqa: F401  (platform defaults before jax is imported)
from moetext.cli import main

if __name__ == "__main__":
    sys.exit(main())
