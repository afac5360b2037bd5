#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU (an H200, say), under 8 minutes including installs:
#   1. installs what is missing, only where a GPU is: torch with CUDA (PyPI) if torch sees none, liger-kernel
#      (from the wheels in $WHEELS, default .whl, if any: for machines without network; else from PyPI);
#   2. the CUDA parity tests (tests/ops/test_cuda_backend.py: mindspeed_hf's CUDA kernels against plain HF);
#   3. Qwen3-0.6B-shaped and Qwen3-MoE-shaped models (random weights, bf16, sequence 4096, packed): tokens/s and
#      peak memory of plain HF, HF + Liger and mindspeed_hf, as ratios, in $OUT/gpu_table.md (the README quotes it);
#   4. benchmarks/bench_offload.py --device cuda (activation offload, $OUT/offload.md), where that script exists.
# Each step has a time limit: liger-kernel 60 s, tests 120, models 220, offload 120, so with CUDA torch already
# there (as on this project's H200 image) it ends within 8 minutes; a torch download (200 s limit) comes on top.
# Without a CUDA device it says so, skips steps 2-4, dry-runs step 3's code on the CPU with tiny shapes
# ($OUT/gpu_table_dryrun.md) and exits 0:   OUT=/tmp/gpu bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_results}; mkdir -p "$out"
py=${PYTHON:-python3}; command -v "$py" >/dev/null || py=python
wheels=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$SECONDS
step() { echo "== [gpu_check +$((SECONDS - start))s] $*"; }

has_cuda() { "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
has_liger() { "$py" -c "import liger_kernel.transformers" 2>/dev/null; }

step "installs"
if ! has_cuda && command -v nvidia-smi >/dev/null 2>&1; then
  timeout 200 "$py" -m pip install -q --retries 1 --timeout 15 torch \
    || echo "gpu_check: could not install torch with CUDA from PyPI"
fi
if has_cuda && ! has_liger; then  # nothing is installed on a machine without a GPU
  if compgen -G "$wheels/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --target /tmp/gpu_check_site "$wheels"/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/gpu_check_site
  else
    timeout 60 "$py" -m pip install -q --retries 1 --timeout 15 "liger-kernel>=0.6" \
      || echo "gpu_check: liger-kernel not installed (no network?)"
  fi
fi
"$py" -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(),
      '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" | tee "$out/env.txt"

if ! has_cuda; then
  step "no CUDA device here: skipping the CUDA parity tests, the GPU benchmark and the offload benchmark"
  step "dry run of the benchmark code on the CPU (tiny shapes)"
  "$py" benchmarks/bench_gpu_models.py --device cpu --dtype fp32 --tiny --seq 128 --steps 1 --warmup 1 \
    --workdir /tmp/gpu_check_dryrun --out "$out/gpu_table_dryrun.md" 2>&1 | tee "$out/models.log"
  status=${PIPESTATUS[0]}
  step "dry run done (exit $status)"
  exit "$status"
fi

step "CUDA parity tests"
timeout 120 "$py" -m pytest -q -p no:cacheprovider tests/ops/test_cuda_backend.py 2>&1 | tee "$out/parity.log"

step "plain HF vs HF + Liger vs mindspeed_hf (bf16, 1 x 4096 packed)"
timeout 220 "$py" benchmarks/bench_gpu_models.py --device cuda --dtype bf16 --seq 4096 --steps 8 --warmup 3 \
  --out "$out/gpu_table.md" 2>&1 | tee "$out/models.log"

if [ -f benchmarks/bench_offload.py ]; then
  step "activation offload"
  timeout 120 "$py" benchmarks/bench_offload.py --device cuda --dtype bf16 --layers 8 --seq 4096 \
    --out "$out/offload.md" 2>&1 | tee "$out/offload.log"
fi
step "done: $out/gpu_table.md"
