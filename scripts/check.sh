#!/usr/bin/env bash
# Lint, format check, type check and the whole test suite: what CI runs (.ci/run) after setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src tests scripts end_to_end
.venv/bin/ruff format --check src tests scripts end_to_end
.venv/bin/mypy  # src, tests, scripts and end_to_end; --strict on the package (pyproject.toml [tool.mypy])
.venv/bin/python -m pytest -n 2 -q --durations=15 "$@"  # the slowest 15: where the suite's time goes
