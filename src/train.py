"""Entry point: `python -m train config.yml key=value ...` (see moetext.cli)."""

import sys

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from moetext.cli import main

if __name__ == "__main__":
    sys.exit(main())
