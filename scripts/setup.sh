#!/usr/bin/env bash
# Create .venv and install qwire into it (idempotent; fast when already done).
# Keeps a torch that is already installed (a GPU machine has its own build);
# otherwise installs torch==2.13.0. Never installs an unpinned torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

# pip, with one harmless warning some pip configurations repeat for every package filtered out;
# pip's own exit status is kept.
pip_quiet() {
  set +e
  .venv/bin/python -m pip "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory"
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: using the torch already installed for $PY ($("$PY" -c 'import torch; print(torch.__version__)'))"
    if "$PY" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)"; then
      # $PY runs in a virtual environment of its own (as on many GPU images): --system-site-packages would
      # reach its base interpreter, not the packages installed in it. A .pth file adds those, its pip and
      # setuptools included (no copies of older ones in .venv to shadow them).
      "$PY" -m venv --without-pip .venv
      "$PY" -c "import site; print('\n'.join(site.getsitepackages()))" \
        > "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/qwire-base-env.pth"
    else
      "$PY" -m venv --system-site-packages .venv
    fi
  else
    "$PY" -m venv .venv
  fi
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch==2.13.0"
  pip_quiet install -q "torch==2.13.0"
fi
stamp=.venv/.qwire-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  if .venv/bin/python scripts/have_deps.py; then
    # every dependency is installed already, at a version pyproject.toml accepts (a GPU machine's image,
    # which may have no package index to reach): install qwire alone, without touching the network
    echo "setup: installing qwire into .venv (its dependencies are installed already)"
    pip_quiet install -q --no-deps --no-build-isolation -e .
  else
    echo "setup: installing qwire and its dependencies into .venv"
    pip_quiet install -q --upgrade pip >/dev/null || true
    pip_quiet install -q -e ".[dev]"
  fi
  .venv/bin/python -c "import qwire, torch, transformers, tokenizers"
  touch "$stamp"
fi
# compile the CPU codec kernels into numba's disk cache (about a minute once; a second afterwards)
.venv/bin/python -m qwire.codecs.kernels.warm
