#!/usr/bin/env bash
# Everything that needs a GPU, in one go, on a machine with one: set up (no network needed where the
# image has the dependencies), the `cuda` tests, then `qwire bench codecs --device cuda`, which writes
# docs/results/gpu.json and gpu.md (codec throughput against a device copy, the codecs' share of a GPT2-XL
# stage's step). Logs and a copy of the results go to the folder given (default runs/gpu-check).
# Each part has a time limit, so the whole takes at most about 10 minutes after the set-up.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu-check}"
mkdir -p "$out"

if ! bash scripts/setup.sh > "$out/setup.log" 2>&1; then
  cat "$out/setup.log"
  echo "gpu_check: the set-up failed (log above, also in $out/setup.log)"
  exit 1
fi
if ! .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check: torch sees no CUDA device here; run this on a GPU machine"
  exit 2
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  .venv/bin/python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'triton', triton.__version__)"
} | tee "$out/versions.txt"

status=0
echo "gpu_check: the cuda tests (at most 5 minutes)"
timeout 300 .venv/bin/python -m pytest -m cuda -q -p no:cacheprovider --timeout 240 2>&1 | tee "$out/pytest-cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_check: qwire bench codecs --device cuda (at most 4 minutes)"
timeout 240 .venv/bin/qwire bench codecs --device cuda 2>&1 | tee "$out/bench-codecs-cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cp -f docs/results/gpu.json docs/results/gpu.md "$out/" 2>/dev/null
echo "gpu_check: done (exit $status); logs and results in $out"
exit "$status"
