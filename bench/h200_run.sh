#!/usr/bin/env bash
# One H200 session of the device tool (see ../.library/device/README.md); run from the repo root there:
#   bash bench/h200_run.sh kernels   # CUDA kernel tests + fla KDA tests + kernel benchmark
#   bash bench/h200_run.sh k3-mini   # train the k3-mini target (recipes/targets/k3-mini.yaml), ~6 min
#   bash bench/h200_run.sh drafter   # train + evaluate the k3-mini DSpark drafter (recipes/k3-mini.yaml)
# On nvidia-h200-x2 (four calls in a row, each while the machine is still warm: runs/ lives only there):
#   bash bench/h200_run.sh x2-target   # GPU0: k3-mini target (4.5 min); GPU1 meanwhile: flex check, CUDA tests
#   bash bench/h200_run.sh x2-drafter  # k3-mini drafter data-parallel on 2 GPUs (accelerate launch), < 8 min
#   bash bench/h200_run.sh x2-compare  # the same recipe on 1 GPU (GPU0, same global batch, same sequences) while
#                                      #   GPU1 evaluates the 2-GPU drafter; bench/ddp_compare.py compares the curves
#   bash bench/h200_run.sh x2-bench    # GPU0: the engine as-is on the k3-mini pair (bs=1 step profile, throughput vs
#                                      #   batch); GPU1: the 8B-shape AR decode vs the HBM floor (bench/ar_floor.py)
# After a k3-mini target + drafter exist on the machine (x2-target + x2-drafter, or k3-mini + drafter):
#   bash bench/h200_run.sh pair        # CUDA-graph static path: graph == eager tests, then bs=1 AR vs DSpark per task
# One nvidia-h200, two calls in a row while the machine is warm (runs/ lives only there):
#   bash bench/h200_run.sh one-train   # k3-mini target (3.5 min) with the CUDA tests beside it, then its drafter
#   bash bench/h200_run.sh one-bench   # pair_decode (graphs, bs=1 per task + throughput vs batch), ar_floor (8B
#                                      #   shape vs the HBM floor, fused decode kernels), engine_gpu (eager, bf16)
#   bash bench/h200_run.sh k3-floor    # K3-shape hybrid AR decode vs the HBM floor (random weights, ~2 min)
# Session 4, three calls in a row on one warm nvidia-h200:
#   bash bench/h200_run.sh s4-train    # target (3 min), drafter on 4096 regenerated sequences (static path, 3.6 min)
#   bash bench/h200_run.sh s4-bench    # pair_decode graphed, then graphed + torch.compile with a kernel profile
#   bash bench/h200_run.sh s4-tests    # the CUDA tests, then bench/engine_gpu.py in bf16
# Session 5 (bench/RESULTS.md):
#   bash bench/h200_run.sh s5-a        # CUDA tests beside the target (timed out on a fresh machine), then the drafter
#   bash bench/h200_run.sh s5-kernels  # split KDA + dense MoE timings (graph), k3_floor, ar_floor (deadline)
# Session 6 (bench/RESULTS.md): s6-a (fresh machine: the target's first step compiled for 256 s, 1 step done),
#   s6-b2 (the target again, then drafters A and B side by side), s6-c and s6-c2 (both pairs timed, compiled).
# Session 7 plan, three calls in a row on one warm nvidia-h200-x2 (one GPU: the side jobs are skipped):
#   bash bench/h200_run.sh s7-a   # GPU0 target (first step excluded from max_minutes); GPU1 warms the compiles
#   bash bench/h200_run.sh s7-b   # the drafter (prompts of five lengths), data parallel over both GPUs; if s7-a's
#                                 #   warm-up failed (warm.txt), DRAFTER_MIN=4.5: regeneration + flex compile first
#   bash bench/h200_run.sh s7-c   # GPU0 the pair compiled + profiled + batch sweep, then the CUDA tests; GPU1 the
#                                 #   kernels (KDA loop vs chunk form), the pair with the chunk form, flex (the chunk
#                                 #   form took 41 us against the loop's 28 and has been removed since)
# Session 8 plan, the same way: s8-a (= s7-a), s8-b (= s7-b: the recipe now regenerates 32768 sequences, split over
# the processes, keeps the best holdout tau in runs/k3-mini-drafter/best, and profiles 5 steps), then
#   bash bench/h200_run.sh s8-c   # GPU0 the pair compiled + profiled + batch sweep, then engine_gpu bf16 (eager host
#                                 #   overhead); GPU1 the kernel tests (per-test durations), the kernel timings, flex
#   bash bench/h200_run.sh s8-d   # the pair re-timed plainly (best and final, 8 prompts; best, 16 prompts)
# Carry: .whl (fla-core wheel), .cache/tokenizer-mini-8192 and .cache/corpus-mini/card.json (pre-packed tokens), and
# .cache/triton-autotune.tgz once a lease has saved one (save_autotune: s7-a, s7-c).
# Run every GPU command through this script: it installs the fla wheel and puts it on PYTHONPATH. A bare
# `python3 -m train ...` on the device trains KDA on the torch fallback, 7x slower (session 4: 63 target steps in 3 min).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off (the device tool's KINDS.md): set here too, for the processes accelerate starts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# fla's autotune picks (FLA_CACHE_RESULTS, on by default) persist in Triton's cache as *.autotune.json; a fresh machine
# spent 256 s in the target's first step compiling and timing every config. A carried .cache/triton-autotune.tgz
# (saved by save_autotune from an earlier lease, same GPU / triton / fla) leaves only the picked configs to compile.
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -f .cache/triton-autotune.tgz ]; then
  mkdir -p "$TRITON_CACHE" && tar -xzf .cache/triton-autotune.tgz -C "$TRITON_CACHE" \
    && echo "triton autotune picks restored: $(tar -tzf .cache/triton-autotune.tgz | grep -c autotune.json)"
fi
save_autotune() {  # -> $OUT/triton-autotune.tgz, to carry as .cache/triton-autotune.tgz next time
  (cd "$TRITON_CACHE" 2>/dev/null && find . -name "*.autotune.json" | tar -czf "$OUT/triton-autotune.tgz" -T -) \
    && echo "saved $(tar -tzf "$OUT/triton-autotune.tgz" | wc -l) autotune picks"
}
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
  x2-target)
    nvidia-smi --query-gpu=name,memory.total --format=csv
    CUDA_VISIBLE_DEVICES=0 python3 -m train recipes/targets/k3-mini.yaml log.wandb_mode=disabled max_minutes=4.5 \
      > /tmp/k3_mini_train.log 2>&1 &
    train_pid=$!
    export CUDA_VISIBLE_DEVICES=1
    python3 bench/check_flex_cuda.py 2>&1 | tee "$OUT/flex.txt"
    python3 -m pytest $(ls tests/test_kernels.py tests/test_k3_kda.py tests/test_static_decode.py 2>/dev/null) -q \
      -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
    wait $train_pid
    grep -v "it/s\]" /tmp/k3_mini_train.log | tail -25 | tee "$OUT/k3_mini_train.txt"
    cp runs/k3-mini/final_metrics.json "$OUT/k3_mini_final_metrics.json" 2>/dev/null
    ;;
  x2-drafter)
    python3 -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision bf16 \
      --dynamo_backend no -m train recipes/k3-mini.yaml output_dir=runs/k3-mini-drafter-2gpu max_steps=600 \
      max_minutes=3 log.wandb_mode=disabled 2>&1 | grep -v "it/s\]" | tail -40 | tee "$OUT/drafter_2gpu.txt"
    ;;
  x2-compare)
    rm -rf runs/k3-mini-drafter-1gpu && mkdir -p runs/k3-mini-drafter-1gpu
    cp runs/k3-mini-drafter-2gpu/sequences.pt runs/k3-mini-drafter-1gpu/
    # resume=true with no checkpoint: starts at step 0 but reuses the 2-GPU run's regenerated sequences
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m train recipes/k3-mini.yaml output_dir=runs/k3-mini-drafter-1gpu \
      max_steps=600 max_minutes=1.6 resume=true log.wandb_mode=disabled > /tmp/drafter_1gpu.log 2>&1 &
    one_pid=$!
    CUDA_VISIBLE_DEVICES=1 timeout 330 python3 -m eval --target runs/k3-mini/final \
      --drafter runs/k3-mini-drafter-2gpu/final --name dspark --tasks humaneval,creative --num-prompts 8 \
      --max-tokens 96 --out "$OUT/eval" 2>&1 | tail -14
    wait $one_pid
    grep -v "it/s\]" /tmp/drafter_1gpu.log | tail -6
    python3 bench/ddp_compare.py runs/k3-mini-drafter-1gpu runs/k3-mini-drafter-2gpu 2>&1 | tee "$OUT/ddp.txt"
    cp runs/k3-mini-drafter-2gpu/train_log.jsonl "$OUT/train_log_2gpu.jsonl"
    cp runs/k3-mini-drafter-1gpu/train_log.jsonl "$OUT/train_log_1gpu.jsonl"
    ;;
  x2-bench)
    if [ -f bench/ar_floor.py ]; then
      CUDA_VISIBLE_DEVICES=1 python3 bench/ar_floor.py > "$OUT/ar_floor.txt" 2>&1 &
    fi
    CUDA_VISIBLE_DEVICES=0 python3 bench/engine_gpu.py --target runs/k3-mini/final \
      --drafter runs/k3-mini-drafter-2gpu/final --dtype "${DTYPE:-bfloat16}" 2>&1 | grep -v "^USDT\|profiler_st" | tee "$OUT/engine_gpu.txt"
    wait
    cat "$OUT/ar_floor.txt" 2>/dev/null
    ;;
  pair)
    python3 -m pytest tests/test_static_spec.py tests/test_static_decode.py -q -p no:cacheprovider 2>&1 | tail -5 \
      | tee "$OUT/static_tests.txt"
    drafter=$(ls -d runs/k3-mini-drafter-2gpu/final runs/k3-mini-drafter/final 2>/dev/null | head -1)
    python3 bench/pair_decode.py --target runs/k3-mini/final --drafter "$drafter" --tasks humaneval,creative \
      --prompts 8 --max-tokens 128 --batches 1,4,16,64 --append "$OUT/pair_decode.md" 2>&1 | tee "$OUT/pair_decode.txt"
    python3 -m eval --target runs/k3-mini/final --drafter "$drafter" --engine static --dtype bfloat16 \
      --tasks humaneval,creative --num-prompts 8 --max-tokens 128 --out "$OUT/eval_static" 2>&1 | tail -8
    ;;
  one-train)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -m train recipes/targets/k3-mini.yaml log.wandb_mode=disabled max_minutes="${TARGET_MIN:-3.5}" \
      > /tmp/k3_mini_train.log 2>&1 &
    train_pid=$!
    if [ -z "${NO_TESTS:-}" ]; then
      python3 -m pytest tests/test_kernels.py tests/test_k3_kda.py tests/test_static_decode.py \
        tests/test_static_spec.py -q -p no:cacheprovider 2>&1 | grep -v "Warning\|warn" | tail -25 | tee "$OUT/gpu_tests.txt"
    fi
    wait $train_pid
    grep -v "it/s\]" /tmp/k3_mini_train.log | grep -v "^ " | tail -30 | tee "$OUT/k3_mini_train.txt"
    python3 -m train recipes/k3-mini.yaml log.wandb_mode=disabled max_minutes="${DRAFTER_MIN:-2.2}" ${DRAFTER_ARGS:-} 2>&1 \
      | grep -v "it/s\]" | tail -15 | tee "$OUT/k3_mini_drafter.txt"
    ;;
  s4-train)
    # session 4: the target, then a drafter on 4096 static-path regenerated sequences (bench/RESULTS.md)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    timeout 270 python3 -m train recipes/targets/k3-mini.yaml log.wandb_mode=disabled max_minutes="${TARGET_MIN:-2.9}" \
      2>&1 | grep -v "it/s\]" | grep -v "^ " | tail -12 | tee "$OUT/k3_mini_train.txt"
    timeout 310 python3 -m train recipes/k3-mini.yaml log.wandb_mode=disabled max_minutes="${DRAFTER_MIN:-3.6}" \
      ${DRAFTER_ARGS:-} 2>&1 \
      | grep -v "it/s\]" | tail -15 | tee "$OUT/k3_mini_drafter.txt"
    ;;
  s4-bench)
    # bs=1 AR vs DSpark on the graphed static path, plain then torch.compile'd (+ a kernel profile per step)
    timeout 150 python3 bench/pair_decode.py --target runs/k3-mini/final --drafter runs/k3-mini-drafter/final \
      --tasks humaneval,creative --prompts 8 --max-tokens 128 --batches 1,4,16,64 --append "$OUT/pair_decode.md" \
      2>&1 | tee "$OUT/pair_decode.txt"
    timeout 420 python3 bench/pair_decode.py --target runs/k3-mini/final --drafter runs/k3-mini-drafter/final \
      --tasks humaneval,creative --prompts 8 --max-tokens 128 --compile --profile --agree 1 \
      --append "$OUT/pair_decode_compiled.md" 2>&1 | tee "$OUT/pair_decode_compiled.txt"
    ;;
  s4-tests)
    python3 -m pytest tests/test_kernels.py tests/test_k3_kda.py tests/test_static_decode.py \
      tests/test_static_spec.py -q -p no:cacheprovider 2>&1 | grep -v "Warning:\|warnings.warn" | tail -15 \
      | tee "$OUT/gpu_tests.txt"
    timeout 200 python3 bench/engine_gpu.py --target runs/k3-mini/final --drafter runs/k3-mini-drafter/final \
      --dtype bfloat16 2>&1 | grep -v "^USDT\|profiler_st" | tee "$OUT/engine_gpu.txt"
    ;;
  s5-a)
    # one call: the CUDA tests in the background while the target (3 min) and then its drafter (3.3 min) train
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -m pytest tests/test_kernels.py tests/test_k3_kda.py tests/test_static_decode.py \
      tests/test_static_spec.py -q -p no:cacheprovider > /tmp/gpu_tests.log 2>&1 &
    tests_pid=$!
    timeout 250 python3 -m train recipes/targets/k3-mini.yaml log.wandb_mode=disabled max_minutes=3 2>&1 \
      | grep -v "it/s\]" | grep -v "^ " | tail -8 | tee "$OUT/k3_mini_train.txt"
    timeout 270 python3 -m train recipes/k3-mini.yaml log.wandb_mode=disabled max_minutes=3.3 2>&1 \
      | grep -v "it/s\]" | tail -12 | tee "$OUT/k3_mini_drafter.txt"
    wait $tests_pid
    grep -v "Warning:\|warnings.warn" /tmp/gpu_tests.log | tail -20 | tee "$OUT/gpu_tests.txt"
    ;;
  s5-kernels)
    # the V-split KDA kernel and the two-matmul dense MoE (graph-timed), then the K3-shape and 8B-shape floors
    # (grouped / multi-row matvec) as far as the deadline (seconds, DEADLINE, default 300) allows
    end=$((SECONDS + ${DEADLINE:-300}))
    left() { echo $(( end - SECONDS > 5 ? end - SECONDS : 5 )); }
    timeout $(left) python3 bench/gpu_kernels.py --only kda,moe --graph --iters 30 2>&1 | tee "$OUT/gpu_kernels.txt"
    timeout $(left) python3 bench/k3_floor.py --append "$OUT/k3_floor.md" 2>&1 | tail -14 | tee "$OUT/k3_floor.txt"
    timeout $(left) python3 bench/ar_floor.py --no-compile --append "$OUT/ar_floor.md" 2>&1 | tee "$OUT/ar_floor.txt"
    ;;
  s6-a)
    # fresh machine: the target alone on GPU0 (300 s: fla compiles first); GPU1 (if any) meanwhile runs the CUDA
    # tests and the graph-timed kernel benchmark (autotuned KDA slices, dense MoE); on one GPU they run after it
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ngpu=$(nvidia-smi -L | wc -l)
    side() {  # two GPUs: every CUDA test file; one GPU (after the target, inside the call's 600 s): the kernel tests
      if [ "$ngpu" -ge 2 ]; then tests="tests/test_kernels.py tests/test_k3_kda.py tests/test_static_decode.py
        tests/test_static_spec.py"; limit=240; else tests="tests/test_kernels.py"; limit=120; fi
      timeout $limit python3 -m pytest $tests -q -p no:cacheprovider -p no:warnings > /tmp/gpu_tests.log 2>&1
      timeout 90 python3 bench/gpu_kernels.py --only kda,moe --graph --iters 30 > "$OUT/gpu_kernels.txt" 2>&1
      if [ "$ngpu" -ge 2 ]; then  # the fp32 flex-gradient mismatch of MLA (bench/RESULTS.md "Flex-attention")
        timeout 120 python3 bench/check_flex_cuda.py --diagnose > "$OUT/flex_diagnose.txt" 2>&1
      fi
    }
    if [ "$ngpu" -ge 2 ]; then CUDA_VISIBLE_DEVICES=1 side & fi
    CUDA_VISIBLE_DEVICES=0 timeout 320 python3 -m train recipes/targets/k3-mini.yaml log.wandb_mode=disabled \
      max_minutes=3.3 2>&1 | grep -v "it/s\]" | grep -v "^ " | tail -8 | tee "$OUT/k3_mini_train.txt"
    if [ "$ngpu" -ge 2 ]; then wait; else side; fi
    tail -3 /tmp/gpu_tests.log | tee "$OUT/gpu_tests.txt"; cat "$OUT/gpu_kernels.txt" "$OUT/flex_diagnose.txt" 2>/dev/null
    ;;
  s6-b2)
    # after s6-a on a fresh machine (its target got 1 step: fla's first training step compiled for 256 s): GPU0 trains
    # the target again (compiled kernels cached now), GPU1 meanwhile warms the drafter's regeneration and flex
    # compiles on s6-a's 1-step target; then the drafter A on GPU0 and the session-4 recipe B on GPU1, same minutes
    end=$((SECONDS + ${DEADLINE:-585}))
    cp -r runs/k3-mini/final runs/k3-step1
    (CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m train recipes/k3-mini.yaml log.wandb_mode=disabled \
      target=runs/k3-step1 output_dir=runs/warm max_minutes=0.1 data.regenerate.num_sequences=1024 \
      > /tmp/warm.log 2>&1; echo "warm-up rc $?") &
    CUDA_VISIBLE_DEVICES=0 timeout 230 python3 -m train recipes/targets/k3-mini.yaml log.wandb_mode=disabled \
      max_minutes=${TARGET_MIN:-2.8} 2>&1 | grep -v "it/s\]" | grep -v "^ " | tail -8 | tee "$OUT/k3_mini_train.txt"
    wait
    left=$(( end - SECONDS )); mins=$(python3 -c "print(round(($left - 160) / 60, 2))")
    echo "drafters: ${left} s left, max_minutes=$mins"
    CUDA_VISIBLE_DEVICES=1 timeout $((left - 5)) python3 -m train recipes/k3-mini.yaml log.wandb_mode=disabled \
      output_dir=runs/k3-mini-drafter-b32 optim.batch_size=32 optim.lr=6.0e-4 data.regenerate.num_sequences=4096 \
      data.regenerate.new_tokens=256 data.seq_len=384 max_minutes=$mins > /tmp/drafter_b32.log 2>&1 &
    CUDA_VISIBLE_DEVICES=0 timeout $((left - 5)) python3 -m train recipes/k3-mini.yaml log.wandb_mode=disabled \
      max_minutes=$mins 2>&1 | grep -v "it/s" | tail -14 | tee "$OUT/k3_mini_drafter.txt"
    wait
    grep -v "it/s" /tmp/drafter_b32.log | tail -14 | tee "$OUT/k3_mini_drafter_b32.txt"; tail -3 /tmp/warm.log
    ;;
  s6-c)
    # bs=1 AR vs DSpark, compiled + graphed, with the kernel profile: drafter A (recipes/k3-mini.yaml) on GPU0 with
    # the batch sweep; with two GPUs, the A/B drafter (session-4 recipe) the same way on GPU1 at the same time, then
    # engine_gpu bf16 there (one GPU: engine_gpu after A). Each pair process runs alone on its GPU.
    ngpu=$(nvidia-smi -L | wc -l)
    pair() {  # $1 drafter dir, $2 out name, $3 extra args
      timeout 360 python3 bench/pair_decode.py --target runs/k3-mini/final --drafter "$1" --tasks humaneval,creative \
        --prompts 8 --max-tokens 128 --compile --profile --agree 1 ${3:-} --append "$OUT/$2.md" > "$OUT/$2.txt" 2>&1
    }
    engine() {
      timeout 180 python3 bench/engine_gpu.py --target runs/k3-mini/final --drafter runs/k3-mini-drafter/final \
        --dtype bfloat16 2>&1 | grep -v "^USDT\|profiler_st" > "$OUT/engine_gpu.txt"
    }
    if [ "$ngpu" -ge 2 ] && [ -d runs/k3-mini-drafter-b32/final ]; then
      (export CUDA_VISIBLE_DEVICES=1; pair runs/k3-mini-drafter-b32/final pair_b32; engine) &
    fi
    CUDA_VISIBLE_DEVICES=0 pair runs/k3-mini-drafter/final pair_a "--batches 1,4,16,64"
    if [ "$ngpu" -ge 2 ]; then wait; else CUDA_VISIBLE_DEVICES=0 engine; fi
    grep -v "^\s*$" "$OUT/pair_a.txt" | tail -80; grep "^|" "$OUT/pair_b32.txt" 2>/dev/null; cat "$OUT/engine_gpu.txt"
    ;;
  s6-c2)
    # the rest of s6-c after its `$3` slip: drafter B compiled on GPU0, engine_gpu bf16 on GPU1 at the same time
    (CUDA_VISIBLE_DEVICES=1 timeout 250 python3 bench/engine_gpu.py --target runs/k3-mini/final \
      --drafter runs/k3-mini-drafter/final --dtype bfloat16 2>&1 | grep -v "^USDT\|profiler_st" > "$OUT/engine_gpu.txt") &
    CUDA_VISIBLE_DEVICES=0 timeout 280 python3 bench/pair_decode.py --target runs/k3-mini/final \
      --drafter runs/k3-mini-drafter-b32/final --tasks humaneval,creative --prompts 8 --max-tokens 128 --compile \
      --profile --agree 1 --append "$OUT/pair_b32.md" > "$OUT/pair_b32.txt" 2>&1
    wait; grep "^|" "$OUT/pair_b32.txt" | head -12; cat "$OUT/engine_gpu.txt"
    ;;
  s7-a|s8-a)
    # fresh machine. GPU0: the target; max_minutes counts from the end of its first step, which compiles fla's
    # kernels (256 s on session 6's fresh machine). GPU1 meanwhile: a 1-step target, then the drafter recipe on it
    # for 3 steps, so that the regeneration (every prompt length at 512 rows), flex and the drafter step are compiled
    # before s7-b; s8-a then runs the kernel tests there until about 440 s. One GPU: the target alone.
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ngpu=$(nvidia-smi -L | wc -l)
    warm() {
      timeout 330 python3 -m train recipes/targets/k3-mini.yaml log.wandb_mode=disabled output_dir=runs/k3-step1 \
        max_steps=1 > /tmp/warm_target.log 2>&1
      code=""; ls .cache/tokenizer-mini-8192/code-prompts-*.pt >/dev/null 2>&1 || code="data.regenerate.code_prompts=0"
      timeout 220 python3 -m train recipes/k3-mini.yaml log.wandb_mode=disabled target=runs/k3-step1/final \
        output_dir=runs/warm max_steps=3 data.regenerate.num_sequences=2560 data.holdout_sequences=8 $code \
        > /tmp/warm.log 2>&1
      echo "warm-up drafter rc $?"; grep -h "first step took\|regenerate" /tmp/warm_target.log /tmp/warm.log | head
      left=$((440 - SECONDS))  # s8-a: the kernel tests in what is left of the target's time (GPU0 ended at ~420 s)
      if [ "$1" = s8-a ] && [ $left -gt 30 ]; then
        timeout $left python3 -m pytest tests/test_kernels.py tests/test_k3_kda.py -q -p no:cacheprovider \
          -p no:warnings --durations=12 > "$OUT/gpu_tests_a.txt" 2>&1; echo "kernel tests rc $? ($left s)"
      fi
    }
    if [ "$ngpu" -ge 2 ]; then CUDA_VISIBLE_DEVICES=1 warm "$1" > "$OUT/warm.txt" 2>&1 & fi
    CUDA_VISIBLE_DEVICES=0 timeout 560 python3 -m train recipes/targets/k3-mini.yaml log.wandb_mode=disabled \
      max_minutes=${TARGET_MIN:-2.8} 2>&1 | grep -v "it/s\]" | grep -v "^ " | tail -6 | tee "$OUT/k3_mini_train.txt"
    cp runs/k3-mini/final_metrics.json "$OUT/k3_mini_final_metrics.json"
    wait; cat "$OUT/warm.txt" 2>/dev/null; tail -16 "$OUT/gpu_tests_a.txt" 2>/dev/null
    grep -A4 '"final"' "$OUT/k3_mini_final_metrics.json" | head -6
    save_autotune
    ;;
  s7-b|s8-b)
    # the drafter (recipes/k3-mini.yaml: prompts of five lengths, global batch 128) data parallel over the GPUs
    # (accelerate launch; rank 0 regenerates, the others wait for its sequences): twice the blocks per minute on two
    ngpu=$(nvidia-smi -L | wc -l)
    if [ "$ngpu" -ge 2 ]; then
      run_train="python3 -m accelerate.commands.launch --multi_gpu --num_processes $ngpu --num_machines 1 \
        --mixed_precision bf16 --dynamo_backend no -m train"
    else
      run_train="python3 -m train"
    fi
    # the recipe's function-body prompts come from the carried tokenizer dir (built where the corpus is); without
    # them the box would need the corpus texts and `datasets`
    code=""; ls .cache/tokenizer-mini-8192/code-prompts-*.pt >/dev/null 2>&1 || code="data.regenerate.code_prompts=0"
    timeout 570 $run_train recipes/k3-mini.yaml log.wandb_mode=disabled max_minutes=${DRAFTER_MIN:-5.5} \
      log.profile_steps=${PROFILE_STEPS:-5} $code 2>&1 | grep -v "it/s" | grep "INFO\|step \|tau\|acc\|rror" | tail -24 \
      | tee "$OUT/drafter.txt"
    cp runs/k3-mini-drafter/final_metrics.json "$OUT/drafter_final_metrics.json"
    cp runs/k3-mini-drafter/profile.txt "$OUT/drafter_profile.txt" 2>/dev/null  # where a 222 ms step goes (s7)
    ;;
  s7-c)
    # GPU0: bs=1 AR vs DSpark compiled + graphed, kernel profile, batch sweep; then the CUDA tests. GPU1 meanwhile:
    # the graph-timed KDA kernels (loop vs chunk form, autotune picks) and MoE, the same pair with the chunk-form KDA
    # verify (DSPARK_KDA_CHUNK_MIN_T=2; τ is the same, the step time is what differs), then the flex diagnosis
    ngpu=$(nvidia-smi -L | wc -l)
    pair() {  # $1 out name, $2 extra args
      timeout 330 python3 bench/pair_decode.py --target runs/k3-mini/final --drafter runs/k3-mini-drafter/final \
        --tasks humaneval,creative --prompts 8 --max-tokens 128 --compile --profile $2 --append "$OUT/$1.md" \
        > "$OUT/$1.txt" 2>&1
    }
    side() {
      timeout 90 python3 bench/gpu_kernels.py --only kda,moe --graph --iters 30 > "$OUT/gpu_kernels.txt" 2>&1
      DSPARK_KDA_CHUNK_MIN_T=2 pair pair_chunk "--agree 0"
      timeout 100 python3 bench/check_flex_cuda.py --diagnose > "$OUT/flex_diagnose.txt" 2>&1
    }
    if [ "$ngpu" -ge 2 ]; then CUDA_VISIBLE_DEVICES=1 side & fi
    export CUDA_VISIBLE_DEVICES=0
    pair pair "--agree 1 --batches 1,4,16,64"
    timeout 230 python3 -m pytest tests/test_kernels.py tests/test_k3_kda.py tests/test_static_decode.py \
      tests/test_static_spec.py -q -p no:cacheprovider -p no:warnings > "$OUT/gpu_tests.txt" 2>&1
    wait
    grep "^|" "$OUT/pair.txt" | head -14; grep "^|" "$OUT/pair_chunk.txt" 2>/dev/null | head -4
    grep "kernels per step" "$OUT/pair.txt" "$OUT/pair_chunk.txt" 2>/dev/null
    tail -3 "$OUT/gpu_tests.txt"; cat "$OUT/gpu_kernels.txt" "$OUT/flex_diagnose.txt" 2>/dev/null
    save_autotune
    ;;
  s8-c)
    # GPU0: bs=1 AR vs DSpark compiled + graphed with the kernel profile and the batch sweep, then the eager engine's
    # bf16 step profile (host overhead). GPU1 meanwhile: the k3-mini KDA verify under every config (why it took 28 us
    # in session 7's step against 21 in session 6's), the kernel tests (test_kernels + test_k3_kda, every one timed),
    # the graph-timed MoE, the flex diagnosis. One GPU: the side jobs after the pair.
    ngpu=$(nvidia-smi -L | wc -l)
    side() {
      timeout 60 python3 bench/gpu_kernels.py --only kda_sweep --iters 30 > "$OUT/gpu_kernels.txt" 2>&1
      timeout 300 python3 -m pytest tests/test_kernels.py tests/test_k3_kda.py -q -p no:cacheprovider -p no:warnings \
        --durations=12 > "$OUT/gpu_tests.txt" 2>&1
      timeout 60 python3 bench/gpu_kernels.py --only moe --graph --iters 30 >> "$OUT/gpu_kernels.txt" 2>&1
      timeout 100 python3 bench/check_flex_cuda.py --diagnose > "$OUT/flex_diagnose.txt" 2>&1
    }
    if [ "$ngpu" -ge 2 ]; then CUDA_VISIBLE_DEVICES=1 side & fi
    export CUDA_VISIBLE_DEVICES=0
    drafter=$(ls -d runs/k3-mini-drafter/best 2>/dev/null || echo runs/k3-mini-drafter/final)  # log.keep_best: tau
    echo "drafter: $drafter"
    timeout 380 python3 bench/pair_decode.py --target runs/k3-mini/final --drafter "$drafter" \
      --tasks humaneval,creative --prompts 8 --max-tokens 128 --compile --profile --agree 1 --batches 1,4,16,64 \
      --append "$OUT/pair.md" > "$OUT/pair.txt" 2>&1
    timeout 130 python3 bench/engine_gpu.py --target runs/k3-mini/final --drafter "$drafter" \
      --dtype bfloat16 --batches 1 --steps 30 2>&1 | grep -v "^USDT\|profiler_st" > "$OUT/engine_gpu.txt"
    if [ "$ngpu" -ge 2 ]; then wait; else side; fi
    grep "^|" "$OUT/pair.txt" | head -14; grep "kernels per step" "$OUT/pair.txt"; cat "$OUT/engine_gpu.txt"
    tail -16 "$OUT/gpu_tests.txt"; cat "$OUT/gpu_kernels.txt" "$OUT/flex_diagnose.txt" 2>/dev/null
    save_autotune
    ;;
  s8-d)
    # the pair timed again without the profiler, agreement check or batch sweep (session 8, after s8-c), each GPU one
    # process: `best` (GPU0) and `final` (GPU1) on 8 prompts per task, then `best` on 16 prompts (code on GPU0, prose
    # on GPU1). s8-b's best holdout tau was its last evaluation, so best and final are the same weights
    pair() {  # $1 GPU, $2 drafter, $3 tasks, $4 prompts, $5 out name
      CUDA_VISIBLE_DEVICES=$1 timeout 250 python3 bench/pair_decode.py --target runs/k3-mini/final \
        --drafter "runs/k3-mini-drafter/$2" --tasks "$3" --prompts "$4" --max-tokens 128 --compile --agree 0 \
        > "$OUT/$5.txt" 2>&1
    }
    pair 1 final humaneval,creative 8 pair_final & pair 0 best humaneval,creative 8 pair_best2; wait
    pair 1 best creative 16 pair16_prose & pair 0 best humaneval 16 pair16_code; wait
    grep -h "^| [hc]" "$OUT"/pair_best2.txt "$OUT"/pair_final.txt "$OUT"/pair16_*.txt | sort -u
    ;;
  k3-floor)
    timeout 420 python3 bench/k3_floor.py --append "$OUT/k3_floor.md" 2>&1 | tee "$OUT/k3_floor.txt"
    ;;
  one-bench)
    timeout 330 python3 bench/pair_decode.py --target runs/k3-mini/final --drafter runs/k3-mini-drafter/final \
      --tasks humaneval,creative --prompts 8 --max-tokens 128 --batches 1,4,16,64 --append "$OUT/pair_decode.md" \
      2>&1 | tee "$OUT/pair_decode.txt"
    timeout 200 python3 bench/ar_floor.py --no-compile --append "$OUT/ar_floor.md" 2>&1 | tee "$OUT/ar_floor.txt"
    timeout 60 python3 bench/engine_gpu.py --target runs/k3-mini/final --drafter runs/k3-mini-drafter/final \
      --dtype bfloat16 2>&1 | grep -v "^USDT\|profiler_st" | tee "$OUT/engine_gpu.txt"
    ;;
esac
