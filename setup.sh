#!/usr/bin/env bash
# Sets up moetext in ./.venv: finds Python >= 3.12, installs the pinned requirements and the
# package (editable). Idempotent: a second run only checks that nothing changed.
set -euo pipefail
cd "$(dirname "$0")"

find_python() {
  local cand v
  local cands=(python3.14 python3.13 python3.12 python3 python)
  for cand in "${cands[@]}"; do
    command -v "$cand" >/dev/null 2>&1 && echo "$(command -v "$cand")"
  done
  local roots=()
  command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)/versions")
  roots+=("$HOME/.pyenv/versions" /root/.pyenv/versions /usr/local/bin /opt/python /usr/bin)
  for r in "${roots[@]}"; do
    for cand in "$r"/3.1[2-9]*/bin/python3.1[2-9] "$r"/python3.1[2-9]; do
      [ -x "$cand" ] && echo "$cand"
    done
  done
}

PY=""
while read -r cand; do
  [ -n "$cand" ] || continue
  # A pyenv shim may exist for a version that is not selected: ask the interpreter itself.
  if v=$("$cand" -c 'import sys; print("%d.%d" % sys.version_info[:2]); assert sys.version_info >= (3, 12)' 2>/dev/null); then
    PY="$cand"; break
  fi
done < <(find_python)
if [ -z "$PY" ]; then
  echo "setup.sh: no Python >= 3.12 found (looked on PATH and under pyenv versions)." >&2
  echo "setup.sh: JAX 0.12 needs Python 3.12+; install one (e.g. 'pyenv install 3.12') and re-run." >&2
  exit 1
fi

stamp=.venv/.moetext-setup
want="$("$PY" --version 2>&1) $(sha256sum requirements.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup.sh: .venv is up to date ($want)"
  exit 0
fi
echo "setup.sh: using $PY ($("$PY" --version 2>&1))"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q --no-deps -e .
echo "$want" > "$stamp"
echo "setup.sh: done. Activate with 'source .venv/bin/activate' or call .venv/bin/python."
