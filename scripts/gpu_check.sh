#!/usr/bin/env bash
# What needs a GPU, on a machine with one:
#   bash scripts/gpu_check.sh [OUTDIR] [PARTS]
# sets up (no network needed where the image has the dependencies), then runs PARTS (comma-separated,
# default tests,codecs), each with a time limit:
#   tests     the `cuda` tests (at most 5 minutes)
#   kernels   the Triton kernel tests (tests/test_kernels_{triton,fit,packing,deferred}.py) on CUDA tensors: every codec
#             configuration they cover, byte for byte against the reference (at most 5 minutes; 296 tests, of which
#             about 250 ran in 215 s on an H200)
#   bytes     python scripts/payload_hash.py --each on the CPU and with --device cuda: a digest of each of 120 payloads and
#             decodes; the two lists must be equal, the lines that differ are printed (at most 2 minutes)
#   codecs    qwire bench codecs --device cuda: docs/results/gpu.json and gpu.md (codec throughput against a
#             device copy, the codecs' share of a GPT2-XL stage's step; at most 4 minutes)
#   pipeline  qwire bench pipeline --device cuda at the paper's shape (GPT2-XL, sequence 1024, 4 stages
#             sharing the GPU, micro-batch 1): tokens/s of FP32, TAH-Quant and AQ-SGD without a link and
#             over the paper's 100 Mbps, into OUTDIR/pipeline (at most 8 minutes)
#   pipeline-graphs  the same with QWIRE_CODEC_GRAPHS=1 (the codecs' kernels in CUDA graphs, docs/kernels.md),
#             into OUTDIR/pipeline-graphs (at most 8 minutes)
#   profile   python scripts/gpu_profile.py: per codec at 16 MB, host time, kernel time, launches and host syncs
#             per encode + decode, without and with CUDA graphs, and per Triton kernel the bandwidth its bytes
#             (by the model of docs/results/traffic.json) make of its time, against a device copy's, and the
#             rate its instructions (by the model of docs/results/issue.json) make of it, against the GPU's
#             peak; the profiler's tables into OUTDIR/profile (at most 2 minutes)
#   convergence  qwire bench pipeline --device cuda --only convergence: validation loss of FP32 and TAH-Quant
#             after a fixed budget (GPT-2 medium, sequence 1024, 4 stages sharing the GPU, 150 steps of
#             4 sequences, seeds 0 and 1), into OUTDIR/convergence (at most 8 minutes; runs it finished are
#             kept in its pipeline.json if the limit stops it)
# Logs and a copy of the results go to OUTDIR (default runs/gpu-check). A test part stopped at its limit is
# interrupted (SIGINT, then killed 20 s later), so that pytest still lists the tests that failed so far.
# The whole call stays within GPU_CHECK_BUDGET seconds (default 570, for machines that run a command at most
# 10 minutes): a part gets the time left, up to its own limit, and one that would get less than a minute is
# skipped with the command that runs it next.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu-check}"
parts=",${2:-tests,codecs},"
budget="${GPU_CHECK_BUDGET:-570}"
start=$SECONDS
if [[ ! "$budget" =~ ^[0-9]+$ ]]; then
  echo "gpu_check: GPU_CHECK_BUDGET must be a whole number of seconds, got '$budget'"
  exit 2
fi
if [ -z "${parts//,/}" ]; then
  echo "gpu_check: no part given; choose from tests, kernels, bytes, codecs, profile, pipeline, pipeline-graphs," \
       "convergence (comma-separated)"
  exit 2
fi
for p in ${parts//,/ }; do
  case "$p" in
    tests|kernels|bytes|codecs|profile|pipeline|pipeline-graphs|convergence) ;;
    *) echo "gpu_check: unknown part '$p'; choose from tests, kernels, bytes, codecs, profile, pipeline," \
         "pipeline-graphs, convergence (comma-separated)"
       exit 2 ;;
  esac
done
mkdir -p "$out"

# run_part PART SECONDS: whether PART was asked for and has a minute or more; sets t to the seconds it may run
# (its own limit, or the time left of the budget)
skipped=0
run_part() {
  [[ "$parts" == *,$1,* ]] || return 1
  local left=$((budget - (SECONDS - start) - 30))  # a test run stopped at its limit has 20 s to report
  t=$(( $2 < left ? $2 : left ))
  if [ "$t" -lt 60 ]; then
    echo "gpu_check: skipping $1, ${left}s left of GPU_CHECK_BUDGET=${budget}s; run it next: bash scripts/gpu_check.sh $out $1"
    skipped=1
    return 1
  fi
}

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
# the parts' tests run one at a time in one process (-p no:xdist): they share the one GPU
if run_part tests 300; then
  echo "gpu_check: the cuda tests (at most ${t}s)"
  timeout -s INT -k 20 "$t" .venv/bin/python -m pytest -m cuda -q -rfE -p no:cacheprovider -p no:xdist --timeout 240 2>&1 \
    | tee "$out/pytest-cuda.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if run_part kernels 300; then
  echo "gpu_check: the Triton kernel tests on CUDA tensors (at most ${t}s)"
  timeout -s INT -k 20 "$t" .venv/bin/python -m pytest -q -rfE -p no:cacheprovider -p no:xdist --timeout 200 \
    tests/test_kernels_triton.py tests/test_kernels_fit.py tests/test_kernels_packing.py tests/test_kernels_deferred.py \
    2>&1 | tee "$out/pytest-kernels.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if run_part bytes 120; then
  echo "gpu_check: python scripts/payload_hash.py on the CPU and on CUDA (at most ${t}s)"
  timeout $((t / 2)) .venv/bin/python scripts/payload_hash.py --each > "$out/payload-hash-cpu.txt" 2>&1
  timeout $((t / 2)) .venv/bin/python scripts/payload_hash.py --each --device cuda > "$out/payload-hash-cuda.txt" 2>&1
  printf 'cpu  %s\ncuda %s\n' "$(tail -n 1 "$out/payload-hash-cpu.txt")" "$(tail -n 1 "$out/payload-hash-cuda.txt")" \
    | tee "$out/payload-hash.txt"
  if cmp -s "$out/payload-hash-cpu.txt" "$out/payload-hash-cuda.txt"; then
    echo "gpu_check: the same bytes on the CPU and on CUDA"
  else
    echo "gpu_check: the payloads or decodes differ between the CPU and CUDA (< cpu, > cuda):"
    diff "$out/payload-hash-cpu.txt" "$out/payload-hash-cuda.txt" | grep '^[<>]' | tee -a "$out/payload-hash.txt"
    status=1
  fi
fi
if run_part codecs 240; then
  echo "gpu_check: qwire bench codecs --device cuda (at most ${t}s)"
  timeout "$t" .venv/bin/qwire bench codecs --device cuda 2>&1 | tee "$out/bench-codecs-cuda.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  cp -f docs/results/gpu.json docs/results/gpu.md "$out/" 2>/dev/null
fi
if run_part profile 120; then
  echo "gpu_check: python scripts/gpu_profile.py (at most ${t}s)"
  timeout "$t" .venv/bin/python scripts/gpu_profile.py --out "$out/profile" 2>&1 | tee "$out/gpu-profile.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# bench_pipeline NAME: qwire bench pipeline --device cuda at GPT2-XL's shape into OUTDIR/NAME
bench_pipeline() {
  timeout "$t" .venv/bin/qwire bench pipeline --device cuda --model gpt2-xl --seq-len 1024 --batch-size 4 \
    --microbatches 4 --stages 4 --methods fp32,tahquant,aqsgd --rates none,paper:100mbps --steps 6 --skip 2 \
    --skip-convergence --skip-robustness --out "$out/$1" --runs "$out/$1-runs" 2>&1 | tee "$out/bench-$1-cuda.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
if run_part pipeline 480; then
  echo "gpu_check: qwire bench pipeline --device cuda at GPT2-XL's shape (at most ${t}s)"
  bench_pipeline pipeline
fi
if run_part pipeline-graphs 480; then
  echo "gpu_check: the same with the codecs' kernels in CUDA graphs (at most ${t}s)"
  QWIRE_CODEC_GRAPHS=1 bench_pipeline pipeline-graphs
fi
if run_part convergence 480; then
  echo "gpu_check: FP32 and TAH-Quant validation loss after a fixed budget, GPT-2 medium (at most ${t}s)"
  timeout "$t" .venv/bin/qwire bench pipeline --device cuda --model gpt2-medium --seq-len 1024 --batch-size 4 \
    --microbatches 4 --stages 4 --only convergence --conv-methods fp32,tahquant --seeds 0,1 --conv-steps 150 \
    --epochs 2 --out "$out/convergence" --runs "$out/convergence-runs" 2>&1 | tee "$out/bench-convergence-cuda.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
[ "$skipped" -eq 0 ] || status=1
echo "gpu_check: done in $((SECONDS - start))s (exit $status); logs and results in $out"
exit "$status"
