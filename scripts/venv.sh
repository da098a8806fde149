#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 (jax 0.11.2 needs it) and installs the project with the
# extras given as the first argument, e.g. `bash scripts/venv.sh test,train`.
# VENV names the venv (default .venv) and CONSTRAINTS the pins (default constraints.txt, the GPU
# machine's versions); the newest versions the ranges allow (JAX 0.12):
#   CONSTRAINTS=constraints-latest.txt VENV=.venv-latest bash scripts/venv.sh test,train
# Finds python3.12 / python3.13 / python3 on the PATH, else a pyenv 3.12 (the CPU machines
# default to 3.11 and carry 3.12.1 in pyenv, whose bare shim cannot run without PYENV_VERSION).
set -euo pipefail
extras=${1:-train}
venv=${VENV:-.venv}
constraints=${CONSTRAINTS:-constraints.txt}
if [ ! -f "$constraints" ]; then
  echo "CONSTRAINTS=$constraints: no such file (run from the repository root)" >&2
  exit 2
fi

find_python() {
  for candidate in python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$candidate"; return
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for version in $(pyenv versions --bare | grep -E '^3\.12\.' | sort -rV); do
      echo "env PYENV_VERSION=$version python3.12"; return
    done
  fi
  echo "no Python >= 3.12 found (jax 0.11.2 needs it)" >&2
  exit 1
}

python=$(find_python)
echo "creating $venv ($constraints) with $($python --version) ($python)"
$python -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# Exact versions from $constraints (constraints.txt: those of the GPU machine, so that CPU and GPU
# run the same code).
# PYTHONWARNINGS=ignore quiets setuptools' boxed "editable installation" notice, which every
# editable mode prints and no option turns off; pip's own errors still show.
PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install -q -c "$constraints" -e ".[$extras]"
