#!/usr/bin/env bash
# Lint, format check, type check and the whole test suite: what CI runs (.ci/run) after setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src tests scripts
.venv/bin/ruff format --check src tests scripts
.venv/bin/mypy  # src, tests and scripts; --strict on the package (pyproject.toml [tool.mypy])
.venv/bin/python -m pytest -n 2 -q "$@"
