#!/usr/bin/env bash
# One H200 session of the device tool (see ../.library/device/README.md); run from the repo root there:
#   bash bench/h200_run.sh kernels   # CUDA kernel tests + fla KDA tests + kernel benchmark
#   bash bench/h200_run.sh k3-mini   # train the k3-mini target (recipes/targets/k3-mini.yaml), ~6 min
#   bash bench/h200_run.sh drafter   # train + evaluate the k3-mini DSpark drafter (recipes/k3-mini.yaml)
# Carry: .whl (fla-core wheel), .cache/tokenizer-mini-8192 and .cache/corpus-mini/card.json (pre-packed tokens).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
python3 -c "import fla; print('fla', getattr(fla, '__version__', '?'))" || true
case "${1:-kernels}" in
  kernels)
    python3 -m pytest tests/test_kernels.py tests/test_k3_kda.py -q -p no:cacheprovider 2>&1 | tee "$OUT/kernel_tests.txt"
    python3 bench/gpu_kernels.py --iters 50 2>&1 | tee "$OUT/gpu_kernels.txt"
    ;;
  k3-mini)
    python3 -m train recipes/targets/k3-mini.yaml log.wandb_mode=disabled 2>&1 | grep -v "it/s\]" | tee "$OUT/k3_mini_train.txt"
    cp runs/k3-mini/final_metrics.json "$OUT/k3_mini_final_metrics.json" 2>/dev/null
    ;;
  drafter)
    python3 -m train recipes/k3-mini.yaml log.wandb_mode=disabled 2>&1 | grep -v "it/s\]" | tee "$OUT/k3_mini_drafter.txt"
    cp runs/k3-mini-drafter/final_metrics.json "$OUT/k3_mini_drafter_final_metrics.json" 2>/dev/null
    python3 -m eval --target runs/k3-mini/final --drafter runs/k3-mini-drafter/final --name dspark \
      --tasks humaneval,creative,chat,translation --num-prompts 16 --max-tokens 128 --out "$OUT/eval" 2>&1 | tail -20
    ;;
esac
