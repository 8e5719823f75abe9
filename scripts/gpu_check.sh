#!/usr/bin/env bash
# The whole GPU check in one command, for a machine with NVIDIA GPUs and PyTorch installed
# (it installs nothing): the CUDA tests, then `bench gpu` eager, compiled, and compiled in
# float8 where the GPU has float8 matmuls, and last the MFU target run: GPT-2 small's
# shape, compiled, 96 sequences per step (52 GiB of GPU memory), DDP. Each stage has its
# own time limit and a failed stage does not stop the next; the exit status is the number
# of stages that failed. The limits add up to 9.5 minutes (the stages took about 7 on one
# H100), so the check fits one 10-minute session on a rented GPU.
#
#   scripts/gpu_check.sh [OUT_DIR]      # default: ./gpu-check
#
# OUT_DIR receives env.txt (device, driver, torch, CUDA), tests.log, and one bench-*.log
# per benchmark, whose last line is the benchmark's JSON record.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=0

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log to OUT/NAME.log
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/stages.txt"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  echo "commit: ${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", ".".join(map(str, torch.cuda.nccl.version())), "gpus", torch.cuda.device_count(),
"capability", torch.cuda.get_device_capability())'
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 60 steps: the first 10-step window is warm-up (and compilation), five are measured.
BENCH=("$PY" -m reference_impl.bench gpu --max-steps 60 --nproc "$("$PY" -c 'import torch; print(torch.cuda.device_count())')")
stage bench-eager 90 "${BENCH[@]}" --rounds 2
stage tests 150 "$PY" -m pytest -q -n 4 -p no:cacheprovider tests/test_gpu.py \
  "tests/test_counterexamples.py::test_host_timer_measures_launch_not_device_time"
stage bench-compile 120 "${BENCH[@]}" --rounds 1 --compile
if "$PY" -c 'import sys, torch; sys.exit(torch.cuda.get_device_capability() < (8, 9))'; then
  stage bench-compile-fp8 120 "${BENCH[@]}" --rounds 1 --compile --fp8
fi
stage bench-gpt2-small 90 "${BENCH[@]}" --rounds 1 --compile --strategies ddp --micro-batch-size 96 \
  --d-model 768 --n-layers 12 --n-heads 12 --hidden-dim 3072 --vocab-size 50304 --seq-len 1024
cat "$OUT/stages.txt"
exit "$failed"
