#!/usr/bin/env bash
# Create .venv and install qwire into it (idempotent; fast when already done).
# Keeps a torch that is already installed (a GPU machine has its own build);
# otherwise installs torch==2.13.0. Never installs an unpinned torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: using the torch already installed for $PY ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch==2.13.0"
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
stamp=.venv/.qwire-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing qwire and its dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored: it is neither" || true
  .venv/bin/python -c "import qwire, torch, transformers, tokenizers" 
  touch "$stamp"
fi
