#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU (the session's `device` tool): the CUDA path's parity tests,
# then the step and fused-loss benchmarks, bf16 and fp32. Results land in $OUT (or ./gpu_results).
# Needs torch with CUDA and liger-kernel on that machine; carry their wheels if it has no network.
set -uo pipefail
out=${OUT:-gpu_results}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 1)" || exit 1
python -m pytest -q -s tests/ops/test_cuda_backend.py tests/ops/test_elementwise_ops.py 2>&1 | tee "$out/parity.log"
python benchmarks/bench_step.py --device cuda --dtype bf16 --model-type qwen3 --vocab 151936 --hidden 1024 \
  --layers 8 --heads 16 --batch 4 --seq 2048 --steps 6 --out "$out/step_cuda_bf16.md" 2>&1 | tee "$out/step.log"
python benchmarks/bench_step.py --device cuda --dtype fp32 --model-type qwen3 --vocab 151936 --hidden 512 \
  --layers 4 --heads 8 --batch 2 --seq 1024 --steps 4 --out "$out/step_cuda_fp32.md" 2>&1 | tee -a "$out/step.log"
