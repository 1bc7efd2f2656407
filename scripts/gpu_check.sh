#!/usr/bin/env bash
# The GPU check in one command, on a machine with CUDA: the suite's CUDA tests (pytest -m cuda), a
# short bf16 GPT-2-small training run printing tokens/s and MFU (eager and compiled on one GPU, then
# FSDP2 over every GPU present, eager and compiled), and bf16 decoding tokens/s beside transformers on
# the same weights. Without a CUDA device it says so and fails, running nothing.
#   bash scripts/gpu_check.sh                 (PYTHON=path/to/python to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device (torch $("$PYTHON" -c 'import torch; print(torch.__version__)') sees none); nothing was run" >&2
    exit 1
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
"$PYTHON" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(), "x", torch.cuda.device_count(), "torch", torch.__version__)'
"$PYTHON" -m pytest -q -m cuda tests
"$PYTHON" benchmarks/bench_gpu_train.py
"$PYTHON" benchmarks/bench_gpu_train.py --compile
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" benchmarks/bench_gpu_train.py --fsdp
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" benchmarks/bench_gpu_train.py --fsdp --compile
"$PYTHON" benchmarks/bench_gpu_decode.py
