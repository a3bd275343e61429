#!/usr/bin/env bash
# GPU runs, named by what they do. From the repository root of a CUDA machine:
#
#   bash bench/run_gpu.sh TARGET [ARGS ...]
#
#   kernels        the CUDA kernel tests (tests/test_kernels.py, tests/test_k3_kda.py), then the kernel timings:
#                  every Triton kernel against its torch reference (bench/gpu_kernels.py, graph-timed), the KDA
#                  verify under every autotune config (kda_sweep), one draft step's Markov loop under each grid size,
#                  V-chunk (markov_sweep), fla's KDA kernels against ours (gpu_k3_kernels.py), MLA attention absorbed
#                  against expanded at the k3-mini and K3 shapes (mla_attention.py: per call, then inside a CUDA graph)
#   tests-cuda     the test suite on the GPU: DSPARK_TEST_DEVICE=cuda python3 -m pytest tests/ (ARGS naming tests/...
#                  run those instead); each failure's report also goes to $OUT/test-failures.txt as it happens
#   train-quickstart  the quickstart pair (recipes/targets/qwen3-tiny.yaml, recipes/quickstart.yaml) on one GPU ->
#                  runs/quickstart/{target,drafter}/final (carry .cache/corpus-stdlib/card.json and
#                  .cache/tokenizer-stdlib-4096 from `make data-sources` + one CPU target run: the packed tokens)
#   train-target   the k3-mini target (recipes/targets/k3-mini.yaml) -> runs/k3-mini/final
#   train-drafter  the k3-mini DSpark drafter (recipes/k3-mini.yaml) on that target, data parallel over NGPU GPUs
#                  (accelerate launch) -> runs/k3-mini-drafter/{final,best}
#   ddp-compare    the drafter recipe on NGPU GPUs, then on one GPU from the same regenerated sequences and the same
#                  global batch; bench/ddp_compare.py compares the two loss curves (NGPU >= 2)
#   pair           AR vs DSpark through dspark.Engine (bench/pair_decode.py): bs=1 per task, then batches of
#                  1, 4, 16, 64
#   timeline       where a decode step's time goes in the engine (bench/step_timeline.py): the host's phases against
#                  the device's busy and idle time, AR / 4 drafts pinned / the k policy, greedy and T = 0.7, batches 1
#                  and 16 -> $OUT/timeline.json; then the engine's Python alone on this machine's CPU
#                  (bench/host_step.py --no-forward --overlap --rows 1 --graph-buckets: AR, then --drafts 3 --accept)
#   floor          bs=1 AR decode through the engine against the HBM floor (bench/floor.py): the Qwen3-8B shape and
#                  the K3 shape; random weights, nothing to train first
#   serve          the server under load (bench/serve_bench.py): concurrency 1, 4, 16, 64 on code and prose prompts,
#                  greedy and at temperature 0.7 -> $OUT/serve.json
#   flex           the drafter's flex-attention block mask against the dense mask (bench/check_flex_cuda.py --diagnose)
#   ablate         drafter-training ablation on the k3-mini target (bench/ablate_drafter.py): the recipe, CE alone,
#                  KL alone, the 1 - TV confidence target, rejection anchors, the DFlash layout, AdamW, same sequences
#                  and budget, each evaluated by python -m eval -> $OUT/ablate/ablation.{json,md};
#                  ARGS go to every row (`max_minutes=3`)
#   peer           ours against speculators' DSpark trainer on one Qwen3 target (bench/peer_speculators.py; carry the
#                  speculators wheels in .whl); PEER_TARGET (default runs/peer-target/final) must exist; ARGS go to the
#                  script
#   train-speed    drafter training speed on random-weight targets (bench/train_speed.py: nothing to train or
#                  regenerate first), the eager step against compile=true: recipes/peer-qwen3-mini.yaml on a
#                  qwen3-mini target, recipes/k3-mini.yaml on a k3-mini target, vocabulary 8192 with the tokenizer of
#                  SPEED_TOKENIZER (default runs/quickstart/target/final, carried) -> $OUT/speed-{peer,k3-mini}/speed.md
#                  and each row's torch.profiler table of steps 2-4 (rows/NAME/profile.txt); ARGS go to both
#                  (`--steps 100`, `--row 'NAME: key=value ...'`)
#   ablate-k3-mini the k3-mini target (TARGET_ARGS), then ablate on it (ARGS), as one detached run (its own OUT;
#                  writes OUT/DONE for `wait`); the CUDA tests run beside the target's training and the regeneration
#                  until the first row's timed training begins (-> $OUT/tests-cuda.txt), REST_TESTS=1 runs the rest
#                  after the ablation
#   peer-qwen3-mini  the Qwen3 peer target (recipes/targets/qwen3-mini.yaml -> runs/peer-target; TARGET_ARGS), then
#                  peer on it from recipes/peer-qwen3-mini.yaml (1000 steps of 16 rows x 256 tokens, 32 anchors a row,
#                  block 8, 2 layers, Markov rank 64; ARGS add to or replace these), as one detached run (its own OUT;
#                  writes OUT/DONE); PEER_RESUME=1 goes on in OUT/peer where a run stopped (its target kept); the
#                  CUDA tests run beside the target's training only (-> $OUT/tests-cuda.txt), REST_TESTS=1 runs the
#                  rest after the bench
#   tau-gap-k3-mini  the k3-mini pair from scratch (TARGET_ARGS, DRAFTER_ARGS; the CUDA tests beside the target's
#                  training, stopped as the regeneration begins), then where its task τ parts from its holdout τ:
#                  bench/tau_gap.py on 32 holdout sequences (with --eager --policy; TAU_GAP_VARIANTS=1 adds its runs
#                  with DSPARK_KERNELS=0 and in fp32) and python -m eval on the same pair (16 prompts x 128
#                  tokens per task) -> $OUT/tau-gap.txt, $OUT/tau-gap-eval/; then (DFLASH=0 skips it) the DFlash
#                  layout (2 Qwen3 layers, block 9) trained from the same sequences for as many steps, through the
#                  same eval -> $OUT/dflash-eval/; then (REGEN_PROFILE=0 skips it) the step timeline of the
#                  regeneration's AR step at 512 rows with 3 steps profiled -> $OUT/regen-profile.json; REST_TESTS=1
#                  then runs the CUDA tests the side run did not reach; one detached run (writes OUT/DONE)
#   k3-mini        the k3-mini pair from scratch, then its measurements: train-target, train-drafter, pair (with a
#                  kernel profile), serve; TARGET_ARGS and DRAFTER_ARGS go to the two trainings (`max_minutes=2.5`)
#   served         every figure of the served path from scratch, as one detached run (its own OUT): the k3-mini pair
#                  trained (train-target, train-drafter) with the CUDA tests beside it until the drafter's timed
#                  training begins (SIDE_STOP names another log to watch for that; one never written keeps them on
#                  through the drafter's training, to pin by max_steps in DRAFTER_ARGS); then, on a quiet GPU, the pair
#                  through python -m serve; the pair through `python -m serve --compile --max-batch-size 1` at
#                  concurrency 1 -> $OUT/serve-compiled.json; the quickstart pair
#                  (runs/quickstart/{target,drafter}/final, carried) through python -m serve ->
#                  $OUT/serve-quickstart.json, and compiled at concurrency 1 -> $OUT/serve-quickstart-compiled.json; the
#                  pair through the engine (pair, with the kernel profile; PAIR=0 skips it), the step timeline of the
#                  quickstart pair if carried, else of the k3-mini pair (timeline; TIMELINE=0 skips it, TIMELINE=first
#                  runs it right after the training, TIMELINE_ARGS replace `--batches 1,16,64 --prompts 64 --kernels
#                  8`), then the CUDA tests the side run did not reach (REST_TESTS=0 skips them). The four serve runs'
#                  time limits: SERVE_S (500), COMPILED_SERVE_S (360), QUICKSTART_SERVE_S (320), QUICKSTART_COMPILED_S
#                  (240); a 0 skips that run; QUICKSTART_FIRST=1 runs the quickstart pair's serve run first, before
#                  the training. SERVE_ARGS go to the first serve run (`--concurrency 1,16`),
#                  QUICKSTART_ARGS to the quickstart pair's; SYNC_SERVE_S (0: skipped) adds that run once more with
#                  `--no-async-scheduling` -> $OUT/serve-sync.json; INPROC_SERVE_S (0: skipped) runs the pair with the
#                  engine in the server's process (`--no-engine-process`; INPROC_ARGS, default `--concurrency 16,64
#                  --temperatures 0`) -> $OUT/serve-inproc.json; PAIR_ARGS replace the pair run's `--prompts 4 --batches
#                  1`
#   quickstart     the quickstart pair's figures on a quiet GPU, as one detached run (its own OUT; carry
#                  runs/quickstart/{target,drafter}/final): the kernel and engine CUDA tests first; the step timeline
#                  (TIMELINE_ARGS replace `--batches 1 --prompts 8 --runs ar,auto --temperatures 0,0.7 --kernels 8`),
#                  with the kernel writing the mailboxes in pinned memory (DSPARK_MAILBOX=direct ->
#                  $OUT/timeline-direct.json) and without mailboxes (DSPARK_MAILBOX=0 -> $OUT/timeline-event.json);
#                  python -m serve (QUICKSTART_SERVE_S, default 320; QUICKSTART_ARGS); EVENT_SERVE_S (default 0:
#                  skipped) runs it once more with DSPARK_MAILBOX=0 at concurrency 1 and 16 ->
#                  $OUT/serve-event.json; where BLOCK8_DIR names a block-8 drafter, its timeline (`--runs k4,k8,auto
#                  --temperatures 0`) -> $OUT/timeline-block8.json and its served run (BLOCK8_SERVE_S, default 150,
#                  `--concurrency 1`) -> $OUT/serve-block8.json; TRAIN_SPEED=1 runs train-speed (TRAIN_SPEED_ARGS);
#                  then the rest of the CUDA suite (REST_TESTS=0 skips it)
#   detach TARGET [ARGS]  TARGET (one that writes OUT/DONE: quickstart, served, ablate-k3-mini, peer-qwen3-mini,
#                  tau-gap-k3-mini) in the background, from a copy of the repository of its own (DETACH_DIR,
#                  default /tmp/dspark-detached; a remote runner copies the working tree again for each command, and
#                  files replaced under a running test suite fail its imports), its output in OUT/main.log, its
#                  results in OUT; follow it with wait
#   wait SECONDS   wait (at most SECONDS) for a detached run in RUN_OUT (default runs/gpu) to write RUN_OUT/DONE, then
#                  pack its logs and results into $OUT/results.tgz and print their tables (a remote runner returns
#                  only what its own OUT holds)
#   regen-speed    the drafter's regeneration under bf16 (as trained) and fp32 (mixed_precision=no): a k3-mini target
#                  (TARGET_ARGS, default max_steps=20), then recipes/k3-mini.yaml for one step with REGEN_N (2048)
#                  sequences under each -> $OUT/regen-speed.txt (the trainer's regenerate lines)
#   exec CMD ...   any command in this environment (the carried wheels, multicast off, the autotune cache)
#
# ARGS go to the command the target runs: recipe overrides for train-* and ddp-compare (`max_minutes=5.5`), flags for
# pair and serve (`--prompts 8`). pair, serve and train-drafter take the pair from TARGET_DIR
# (default runs/k3-mini/final) and DRAFTER_DIR (default runs/k3-mini-drafter/best, else .../final).
#
# Environment: NGPU (GPUs to use; default: every visible one), OUT (where logs and results go; default runs/gpu; a
# run that outlives the shell that started it needs an OUT of its own: a remote runner may empty its OUT between calls).
# Carried inputs, when present: .whl/*.whl (`bash bench/gpu_wheels.sh` downloads them here: fla-core and the other
# packages the machine lacks; installed into .cache/gpu-site, which goes first on PYTHONPATH: without fla-core the KDA
# layers train on the torch fallback, several times slower), .cache/triton-autotune.tgz (Triton autotune picks from an
# earlier run on the same GPU / triton / fla: a fresh machine then compiles only the picked configs; without it the
# picks in bench/triton-autotune-h200.tgz). Every target saves the picks it has to $OUT/triton-autotune.tgz, to carry
# as .cache/triton-autotune.tgz next time (or to keep in bench/ when kernels changed). .cache/corpus-mini (the corpus of
# the k3-mini and qwen3-mini recipes, 50 MB: `python -m dspark.data build --out .cache/corpus-mini --sources
# python_stdlib,go_src,python_docs,shakespeare,kjv_bible,fortunes,gcide --max-bytes-per-source 10000000` on a machine
# that has every source): an image without one of its sources (go_src) reuses the carried corpus; carried as
# .cache/corpus-mini.tgz (`tar czf .cache/corpus-mini.tgz -C .cache corpus-mini`, 14 MB) it is unpacked here first.
set -uo pipefail
cd "$(dirname "$0")/.."
target=${1:-}
[ $# -gt 0 ] && shift
case "$target" in
  kernels|tests-cuda|train-quickstart|train-target|train-drafter|ddp-compare|pair|timeline|floor|serve|flex) ;;
  ablate|peer|train-speed) ;;
  ablate-k3-mini|peer-qwen3-mini|tau-gap-k3-mini|k3-mini|served|quickstart|regen-speed|detach|wait|exec) ;;
  -h|--help|"") awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  *) echo "run_gpu.sh: unknown target '$target' (see: bash bench/run_gpu.sh --help)" >&2; exit 2 ;;
esac
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: save_autotune writes it from Triton's cache dir
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$NGPU" -ge 1 ] 2>/dev/null || { echo "run_gpu.sh: no GPU visible (nvidia-smi -L) and NGPU not set" >&2; exit 2; }
TARGET_DIR=${TARGET_DIR:-runs/k3-mini/final}
best_or_final() { ls -d "$1/best" 2>/dev/null || echo "$1/final"; }  # a drafter run's checkpoint to evaluate
DRAFTER_DIR=${DRAFTER_DIR:-$(best_or_final runs/k3-mini-drafter)}

[ -f .cache/corpus-mini.tgz ] && [ ! -d .cache/corpus-mini ] && tar -xzf .cache/corpus-mini.tgz -C .cache \
  && echo "corpus unpacked from .cache/corpus-mini.tgz"
# the targets that train a mini target (detach's too) stop here, before any GPU time, where its corpus cannot be built
case "$target:${1:-}" in
  train-target:*|served:*|k3-mini:*|ablate-k3-mini:*|peer-qwen3-mini:*|tau-gap-k3-mini:*|regen-speed:*|\
  detach:served|detach:ablate-k3-mini|detach:peer-qwen3-mini|detach:tau-gap-k3-mini)
    if [ ! -d .cache/corpus-mini ] && [ ! -d /usr/share/go-1.19/src ] && [ ! -d /usr/lib/go-1.19/src ]; then
      echo "run_gpu.sh $target: the mini targets' corpus needs go_src, which this machine lacks: carry" \
        ".cache/corpus-mini.tgz (built where go_src is: bash bench/run_gpu.sh --help, Carried inputs)" >&2
      exit 2
    fi ;;
esac
SITE=.cache/gpu-site
if ls .whl/*.whl >/dev/null 2>&1; then
  stamp=$(ls .whl/*.whl | md5sum | cut -c1-12)  # installed once per set of wheels
  if [ "$(cat "$SITE/.stamp" 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      && echo "$stamp" > "$SITE/.stamp"
  fi
  export PYTHONPATH=$PWD/$SITE:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TQDM_MININTERVAL=30  # progress bars at most every 30 s in the logs (tqdm reads TQDM_* defaults)
# NVLink multicast stays off, for this shell and every process it starts (accelerate's workers included)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# Triton autotune picks (fla's and ours) persist in Triton's cache as *.autotune.json
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
# (a carried .cache/triton-autotune.tgz, else the picks kept in the repository for the H200 image)
picks=""; for f in .cache/triton-autotune.tgz bench/triton-autotune-h200.tgz; do [ -f "$f" ] && { picks=$f; break; }; done
if [ -n "$picks" ]; then
  mkdir -p "$TRITON_CACHE" && tar -xzf "$picks" -C "$TRITON_CACHE" \
    && echo "triton autotune picks restored from $picks: $(tar -tzf "$picks" | grep -c autotune.json)"
fi
save_autotune() {
  (cd "$TRITON_CACHE" 2>/dev/null && find . -name "*.autotune.json" | tar -czf "$OUT/triton-autotune.tgz" -T -) \
    && echo "saved $(tar -tzf "$OUT/triton-autotune.tgz" | wc -l) autotune picks to $OUT/triton-autotune.tgz"
}

# log NAME CMD...: run CMD, its output (without tqdm's progress lines) also appended to $OUT/NAME.txt
log() {
  local name=$1; shift
  echo "+ $*" | tee -a "$OUT/$name.txt"
  "$@" 2>&1 | grep --line-buffered -v "it/s\]" | tee -a "$OUT/$name.txt"
  return "${PIPESTATUS[0]}"
}

# same_steps_from SRC DST: DST starts from SRC's regenerated sequences (resume=true without a checkpoint starts at
# step 0 and reads them); prints the steps SRC made, for DST's max_steps
same_steps_from() {
  rm -rf "$2" && mkdir -p "$2" && cp "$1/sequences.pt" "$2/"
  tail -n 1 "$1/train_log.jsonl" | python3 -c "import json, sys; print(json.load(sys.stdin)['step'])"
}
train_cmd() {  # python3 -m train, or accelerate launch over NGPU processes
  if [ "$NGPU" -ge 2 ]; then
    echo python3 -m accelerate.commands.launch --multi_gpu --num_processes "$NGPU" --num_machines 1 \
      --mixed_precision bf16 --dynamo_backend no -m train
  else
    echo python3 -m train
  fi
}

# the drafter recipe's function-body prompts come from the carried tokenizer dir (built where the corpus is);
# without them this machine would need the corpus texts and `datasets`
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
  torch.cuda.get_device_name(), 'x', torch.cuda.device_count())"
python3 -c "import fla; print('fla', getattr(fla, '__version__', '?'))" 2>/dev/null || echo "fla: not installed"
echo "NGPU=$NGPU OUT=$OUT"

# side_tests [GLOB [PATTERN]]: the CUDA suite beside a training (the engine's own tests first), in a process group
# of its own (xdist's workers included), stopped by side_tests_end or, with GLOB, once a file GLOB names has a line
# matching PATTERN (default "trainable params": the drafter's timed training begins, which it must not share;
# "regenerate:" stops them before the regeneration, whose host-bound steps they slow about fourfold)
side_tests() {
  setsid bash "$0" tests-cuda -n 8 --timeout 200 tests/test_mailbox.py tests/test_overlap.py tests/test_runner.py \
    tests/test_policy.py tests/test_engine.py tests/test_serve_engine_proc.py tests/test_serve.py tests/ \
    > "$OUT/side.txt" 2>&1 &
  side_pid=$! side_watcher=""
  [ $# -gt 0 ] || return 0
  # shellcheck disable=SC2086 # GLOB is expanded at every look
  ( until cat $1 2>/dev/null | grep -qs "${2:-trainable params}"; do sleep 5; done
    kill -- -$side_pid 2>/dev/null && echo "CUDA tests stopped at \"${2:-trainable params}\"" ) &
  side_watcher=$!
}
side_tests_end() { [ -n "$side_watcher" ] && kill "$side_watcher" 2>/dev/null; kill -- -$side_pid 2>/dev/null; wait; }
# rest_tests: every test of the CUDA suite the side run did not report
rest_tests() {
  local outcome="PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS" done_ids  # `-v` lines, with xdist or without
  mapfile -t done_ids < <(grep -oE "($outcome) tests/[^ ]+|tests/[^ ]+::[^ ]+ ($outcome)" "$OUT/tests-cuda.txt" \
    | grep -oE "tests/[^ ]+" | sort -u | sed "s/^/--deselect=/")
  echo "${#done_ids[@]} tests done beside the training; the rest now"
  bash "$0" tests-cuda -n 8 --timeout 200 "${done_ids[@]}" > "$OUT/rest.txt" 2>&1
}

rc=0
case "$target" in
  kernels)
    log kernels python3 -m pytest tests/test_kernels.py tests/test_k3_kda.py -q -p no:cacheprovider -p no:warnings \
      --durations=12 "$@" || rc=$?
    log kernels python3 bench/gpu_kernels.py --graph --iters 30 || rc=$?
    log kernels python3 bench/gpu_kernels.py --only kda_sweep,markov_sweep --iters 30 || rc=$?
    log kernels python3 bench/gpu_k3_kernels.py || rc=$?
    log kernels python3 bench/mla_attention.py --device cuda --shape k3-mini || rc=$?
    log kernels python3 bench/mla_attention.py --device cuda --shape k3 --batches 1,64 || rc=$?
    log kernels python3 bench/mla_attention.py --device cuda --shape k3-mini --graph || rc=$?
    log kernels python3 bench/mla_attention.py --device cuda --shape k3 --batches 1,64 --graph || rc=$?
    ;;
  tests-cuda)
    # -vv (the -q in pyproject.toml takes one back): a line per test as it ends, so a stopped run names its failures
    # ARGS that name tests (tests/...) replace the whole suite
    paths=(tests/); for a in "$@"; do [[ $a == tests/* ]] && paths=(); done
    # a module that fails to import (a wheel not carried) is reported as an error; the others still run
    # each failure's report goes to $OUT/test-failures.txt as it happens (tests/conftest.py): a side run stopped
    # before pytest's summary still says why a test failed
    DSPARK_TEST_DEVICE=cuda DSPARK_FAILURE_LOG="$OUT/test-failures.txt" log tests-cuda python3 -m pytest "${paths[@]}" -vv -rfE --tb=line -p no:cacheprovider \
      -p no:warnings -m "not sources" --continue-on-collection-errors "$@" || rc=$?
    ;;
  train-quickstart)
    CUDA_VISIBLE_DEVICES=0 log train-quickstart python3 -m train recipes/targets/qwen3-tiny.yaml \
      output_dir=runs/quickstart/target log.wandb_mode=disabled "$@" || rc=$?
    CUDA_VISIBLE_DEVICES=0 log train-quickstart python3 -m train recipes/quickstart.yaml \
      target=runs/quickstart/target/final output_dir=runs/quickstart/drafter log.wandb_mode=disabled || rc=$?
    ;;
  train-target)
    log train-target python3 -m train recipes/targets/k3-mini.yaml log.wandb_mode=disabled "$@" || rc=$?
    cp runs/k3-mini/final_metrics.json "$OUT/train-target-metrics.json" 2>/dev/null
    ;;
  train-drafter)
    # shellcheck disable=SC2046 # train_cmd is a word list
    log train-drafter $(train_cmd) recipes/k3-mini.yaml target="$TARGET_DIR" log.wandb_mode=disabled \
      "$@" || rc=$?
    cp runs/k3-mini-drafter/final_metrics.json "$OUT/train-drafter-metrics.json" 2>/dev/null
    cp runs/k3-mini-drafter/profile.txt "$OUT/train-drafter-profile.txt" 2>/dev/null
    ;;
  ddp-compare)
    [ "$NGPU" -ge 2 ] || { echo "run_gpu.sh ddp-compare: needs NGPU >= 2 (NGPU=$NGPU)" >&2; exit 2; }
    many=runs/ddp-${NGPU}gpu one=runs/ddp-1gpu
    rm -rf $many $one
    # shellcheck disable=SC2046
    log ddp-compare $(train_cmd) recipes/k3-mini.yaml target="$TARGET_DIR" output_dir=$many log.wandb_mode=disabled \
      "$@" || exit 1
    steps=$(same_steps_from $many $one)
    # one GPU, the same global batch, the same regenerated sequences and as many steps as the NGPU run made, however
    # long they take
    # shellcheck disable=SC2046
    CUDA_VISIBLE_DEVICES=0 log ddp-compare python3 -m train recipes/k3-mini.yaml target="$TARGET_DIR" \
      output_dir=$one resume=true log.wandb_mode=disabled "$@" max_steps="$steps" max_minutes=null \
      || rc=$?
    log ddp-compare python3 bench/ddp_compare.py $one $many || rc=$?
    cp $one/train_log.jsonl "$OUT/ddp-train-log-1gpu.jsonl"; cp $many/train_log.jsonl "$OUT/ddp-train-log-${NGPU}gpu.jsonl"
    ;;
  pair)
    echo "target $TARGET_DIR, drafter $DRAFTER_DIR"
    CUDA_VISIBLE_DEVICES=0 log pair python3 bench/pair_decode.py --target "$TARGET_DIR" --drafter "$DRAFTER_DIR" \
      --tasks humaneval,creative --prompts 16 --max-tokens 128 --batches 1,4,16,64 --out "$OUT/pair.json" "$@" \
      || rc=$?
    ;;
  timeline)
    echo "target $TARGET_DIR, drafter $DRAFTER_DIR"
    CUDA_VISIBLE_DEVICES=0 log timeline python3 bench/step_timeline.py --target "$TARGET_DIR" --drafter "$DRAFTER_DIR" \
      --out "$OUT/timeline.json" "$@" || rc=$?
    # the engine's Python alone on this machine's CPU (a fixed output for every step, one row, async scheduling, the
    # step keys of graphs): AR, then 3 drafts a step, all accepted
    log timeline python3 bench/host_step.py --rows 1 --prompts 8 --new-tokens 300 --repeats 5 --no-forward --overlap \
      --graph-buckets || rc=$?
    log timeline python3 bench/host_step.py --rows 1 --prompts 8 --new-tokens 300 --repeats 5 --no-forward --overlap \
      --graph-buckets --drafts 3 --accept || rc=$?
    ;;
  floor)
    CUDA_VISIBLE_DEVICES=0 log floor python3 bench/floor.py --shape qwen3-8b --hf --out "$OUT/floor-qwen3-8b.json" \
      || rc=$?
    CUDA_VISIBLE_DEVICES=0 log floor python3 bench/floor.py --shape k3 --out "$OUT/floor-k3.json" || rc=$?
    ;;
  serve)
    echo "target $TARGET_DIR, drafter $DRAFTER_DIR"
    CUDA_VISIBLE_DEVICES=0 log serve python3 bench/serve_bench.py --target "$TARGET_DIR" --drafter "$DRAFTER_DIR" \
      --concurrency 1,4,16,64 --tasks humaneval,creative --temperatures 0,0.7 --out "$OUT/serve.json" "$@" || rc=$?
    ;;
  flex)
    log flex python3 bench/check_flex_cuda.py --diagnose "$@" || rc=$?
    ;;
  ablate)
    # shellcheck disable=SC2046 # train_cmd is a word list
    log ablate python3 bench/ablate_drafter.py recipes/k3-mini.yaml --target "$TARGET_DIR" --out "$OUT/ablate" \
      --train-cmd "$(train_cmd)" --num-prompts 16 --max-tokens 128 --set "$@" || rc=$?
    ;;
  peer)
    log peer python3 bench/peer_speculators.py --target "${PEER_TARGET:-runs/peer-target/final}" --out "$OUT/peer" \
      "$@" || rc=$?
    ;;
  train-speed)
    for r in peer:qwen3-mini:peer-qwen3-mini k3-mini:k3-mini:k3-mini; do
      IFS=: read -r name target_recipe recipe <<< "$r"
      log train-speed python3 bench/train_speed.py "recipes/$recipe.yaml" --target-recipe \
        "recipes/targets/$target_recipe.yaml" --tokenizer "${SPEED_TOKENIZER:-runs/quickstart/target/final}" \
        --vocab 8192 --out "$OUT/speed-$name" --set log.profile_steps=3 "$@" || rc=1
    done
    save_autotune
    ;;
  ablate-k3-mini)
    # shellcheck disable=SC2086 # TARGET_ARGS is a word list
    side_tests "$OUT/ablate/rows/*.log"
    { bash "$0" train-target ${TARGET_ARGS:-} && bash "$0" ablate "$@"; } || rc=1
    side_tests_end
    [ "${REST_TESTS:-0}" = 1 ] && { rest_tests || rc=1; }
    echo "ablate-k3-mini: done rc=$rc" | tee "$OUT/DONE"
    ;;
  tau-gap-k3-mini)
    # shellcheck disable=SC2086 # the ARGS variables are word lists
    side_tests "$OUT/train-drafter.txt" "regenerate:"
    { bash "$0" train-target ${TARGET_ARGS:-} && bash "$0" train-drafter ${DRAFTER_ARGS:-}; } || rc=1
    side_tests_end
    drafter=$(best_or_final runs/k3-mini-drafter)
    tasks=(--tasks humaneval,heldout_code,creative,heldout_prose,chat --num-prompts 16 --max-tokens 128
      --max-prompt-tokens 256)
    gap=(python3 bench/tau_gap.py --target "$TARGET_DIR" --drafter "$drafter" --n 32 --device cuda
      --sequences runs/k3-mini-drafter/sequences.pt)
    log tau-gap "${gap[@]}" --eager --policy || rc=1
    if [ "${TAU_GAP_VARIANTS:-0}" = 1 ]; then  # where the engine parts from the walk: kernels, then precision
      echo "DSPARK_KERNELS=0:" >> "$OUT/tau-gap.txt"
      DSPARK_KERNELS=0 log tau-gap "${gap[@]}" || rc=1
      log tau-gap "${gap[@]}" --dtype float32 || rc=1
    fi
    log tau-gap python3 -m eval --target "$TARGET_DIR" --drafter "$drafter" --name k3-mini --out "$OUT/tau-gap-eval" \
      "${tasks[@]}" || rc=1
    if [ "${DFLASH:-1}" = 1 ] && [ -f runs/k3-mini-drafter/train_log.jsonl ]; then
      # the DFlash layout (2 Qwen3 layers, block 9 = 8 drafts, no Markov or confidence head) from the same
      # regenerated sequences for as many steps as the DSpark drafter made, through the same eval
      steps=$(same_steps_from runs/k3-mini-drafter runs/k3-mini-dflash)
      # shellcheck disable=SC2046,SC2086 # train_cmd and DRAFTER_ARGS are word lists
      log train-dflash $(train_cmd) recipes/k3-mini.yaml target="$TARGET_DIR" output_dir=runs/k3-mini-dflash \
        resume=true log.wandb_mode=disabled ${DRAFTER_ARGS:-} max_steps="$steps" max_minutes=null \
        drafter.backbone=qwen3 drafter.mode=dflash drafter.block_size=9 || rc=1
      log tau-gap python3 -m eval --target "$TARGET_DIR" --name dflash --out "$OUT/dflash-eval" "${tasks[@]}" \
        --drafter "$(best_or_final runs/k3-mini-dflash)" || rc=1
    fi
    if [ "${REGEN_PROFILE:-1}" = 1 ] && [ -d "$drafter" ]; then
      # the regeneration's decode step (512 rows, AR, greedy) under the profiler: its kernels and the host's share
      log regen-profile python3 bench/step_timeline.py --target "$TARGET_DIR" --drafter "$drafter" --runs ar \
        --temperatures 0 --batches 512 --prompts 512 --max-tokens 24 --kernels 3 --kernels-batch 512 \
        --out "$OUT/regen-profile.json" || rc=1
    fi
    [ "${REST_TESTS:-0}" = 1 ] && { rest_tests || rc=1; }
    echo "tau-gap-k3-mini: done rc=$rc" | tee "$OUT/DONE"
    ;;
  peer-qwen3-mini)
    # shellcheck disable=SC2086 # TARGET_ARGS is a word list
    if [ "${PEER_RESUME:-0}" = 1 ] && [ -d runs/peer-target/final ]; then
      set -- --resume "$@"  # the target and the bench's finished phases stay
    else
      # the CUDA tests beside the target's training only (the bench's timed phases must not share the GPU)
      side_tests
      log peer python3 -m train recipes/targets/qwen3-mini.yaml log.wandb_mode=disabled ${TARGET_ARGS:-} || rc=1
      side_tests_end
    fi
    [ "$rc" = 0 ] && { PEER_TARGET=runs/peer-target/final bash "$0" peer --recipe recipes/peer-qwen3-mini.yaml \
      --steps 1000 --batch-size 16 --anchors 32 --layers 2 --markov-rank 64 --warmup 40 --regen-sequences 4096 \
      --holdout 64 --prompt-tokens 64 --new-tokens 192 \
      --eval-tasks humaneval,heldout_code,creative,chat,heldout_prose "$@" || rc=1; }
    [ "${REST_TESTS:-0}" = 1 ] && [ -f "$OUT/tests-cuda.txt" ] && { rest_tests || rc=1; }
    echo "peer-qwen3-mini: done rc=$rc" | tee "$OUT/DONE"
    ;;
  k3-mini)
    # shellcheck disable=SC2086 # the ARGS variables are word lists
    bash "$0" train-target ${TARGET_ARGS:-} && bash "$0" train-drafter ${DRAFTER_ARGS:-} \
      && { bash "$0" pair --profile "$OUT/profile.txt" || rc=$?; bash "$0" serve || rc=$?; } || rc=$?
    ;;
  served)
    # shellcheck disable=SC2086 # the ARGS variables are word lists
    quickstart=(env TARGET_DIR=runs/quickstart/target/final DRAFTER_DIR=runs/quickstart/drafter/final)
    s1=${SERVE_S:-500} s2=${QUICKSTART_SERVE_S:-320} s3=${COMPILED_SERVE_S:-360} s4=${QUICKSTART_COMPILED_S:-240}
    # shellcheck disable=SC2086 # QUICKSTART_ARGS is a word list
    [ "$s2" != 0 ] && [ "${QUICKSTART_FIRST:-0}" = 1 ] && { "${quickstart[@]}" bash "$0" serve --time-limit "$s2" \
      ${QUICKSTART_ARGS:-} --out "$OUT/serve-quickstart.json" || rc=$?; s2=0; }
    side_tests "${SIDE_STOP:-$OUT/train-drafter.txt}"
    trained=0
    bash "$0" train-target ${TARGET_ARGS:-} && bash "$0" train-drafter ${DRAFTER_ARGS:-} && trained=1 || rc=1
    side_tests_end
    tl_pair=(); [ -d runs/quickstart/drafter/final ] && tl_pair=("${quickstart[@]}")
    # shellcheck disable=SC2086 # TIMELINE_ARGS is a word list
    [ "${TIMELINE:-1}" = first ] && { "${tl_pair[@]}" bash "$0" timeline ${TIMELINE_ARGS:---batches 1,16,64 \
      --prompts 64 --kernels 8} || rc=$?; }
    # the compiled servers at concurrency 1, code, greedy, with one batch slot (the graphs of one row only)
    compiled=(--concurrency 1 --tasks humaneval --temperatures 0)
    # shellcheck disable=SC2086 # SERVE_ARGS is a word list
    [ $trained = 1 ] && [ "$s1" != 0 ] && { bash "$0" serve --time-limit "$s1" ${SERVE_ARGS:-} || rc=$?; }
    # shellcheck disable=SC2086 # SERVE_ARGS is a word list
    [ $trained = 1 ] && [ "${SYNC_SERVE_S:-0}" != 0 ] && { bash "$0" serve --time-limit "$SYNC_SERVE_S" \
      ${SERVE_ARGS:-} --out "$OUT/serve-sync.json" -- --no-async-scheduling || rc=$?; }
    # shellcheck disable=SC2086 # INPROC_ARGS is a word list
    [ $trained = 1 ] && [ "${INPROC_SERVE_S:-0}" != 0 ] && { bash "$0" serve --time-limit "$INPROC_SERVE_S" \
      ${INPROC_ARGS:---concurrency 16,64 --temperatures 0} --out "$OUT/serve-inproc.json" -- --no-engine-process \
      || rc=$?; }
    [ $trained = 1 ] && [ "$s3" != 0 ] && { bash "$0" serve "${compiled[@]}" --time-limit "$s3" \
      --out "$OUT/serve-compiled.json" -- --compile --max-batch-size 1 || rc=$?; }
    # shellcheck disable=SC2086 # QUICKSTART_ARGS is a word list
    [ "$s2" != 0 ] && { "${quickstart[@]}" bash "$0" serve --time-limit "$s2" ${QUICKSTART_ARGS:-} \
      --out "$OUT/serve-quickstart.json" || rc=$?; }
    [ "$s4" != 0 ] && { "${quickstart[@]}" bash "$0" serve "${compiled[@]}" --time-limit "$s4" \
      --out "$OUT/serve-quickstart-compiled.json" -- --compile --max-batch-size 1 || rc=$?; }
    # shellcheck disable=SC2086 # PAIR_ARGS is a word list
    [ $trained = 1 ] && [ "${PAIR:-1}" != 0 ] && { bash "$0" pair ${PAIR_ARGS:---prompts 4 --batches 1} \
      --profile "$OUT/profile.txt" || rc=$?; }
    # the step timeline of the quickstart pair where it was carried (the shortest steps), else the k3-mini pair's
    # shellcheck disable=SC2086 # TIMELINE_ARGS is a word list
    [ "${TIMELINE:-1}" = 1 ] && { "${tl_pair[@]}" bash "$0" timeline ${TIMELINE_ARGS:---batches 1,16,64 \
      --prompts 64 --kernels 8} || rc=$?; }
    [ "${REST_TESTS:-1}" = 1 ] && { rest_tests || rc=$?; }
    echo "served: done rc=$rc" | tee "$OUT/DONE"
    ;;
  quickstart)
    qs=(env TARGET_DIR=runs/quickstart/target/final DRAFTER_DIR=runs/quickstart/drafter/final)
    bash "$0" tests-cuda -n 8 --timeout 200 tests/test_mailbox.py tests/test_kernels.py tests/test_sampled_kernels.py \
      tests/test_runner.py tests/test_policy.py tests/test_engine.py > "$OUT/first.txt" 2>&1 || rc=1
    # shellcheck disable=SC2086 # TIMELINE_ARGS and QUICKSTART_ARGS are word lists
    "${qs[@]}" bash "$0" timeline ${TIMELINE_ARGS:---batches 1 --prompts 8 --runs ar,auto --temperatures 0,0.7 \
      --kernels 8} || rc=1
    # the same steps with the publish kernel writing the mailbox in pinned memory (no copy in the graph), and with
    # each captured step's output through a queued copy and an event (no mailbox)
    "${qs[@]}" DSPARK_MAILBOX=direct bash "$0" timeline --batches 1 --prompts 8 --runs ar,auto --temperatures 0,0.7 \
      --out "$OUT/timeline-direct.json" || rc=1
    "${qs[@]}" DSPARK_MAILBOX=0 bash "$0" timeline --batches 1 --prompts 8 --runs ar,auto --temperatures 0,0.7 \
      --out "$OUT/timeline-event.json" || rc=1
    # shellcheck disable=SC2086
    "${qs[@]}" bash "$0" serve --time-limit "${QUICKSTART_SERVE_S:-320}" ${QUICKSTART_ARGS:-} \
      --out "$OUT/serve-quickstart.json" || rc=1
    # the same server with each captured step's output through a queued copy and an event (no mailbox)
    # shellcheck disable=SC2086
    [ "${EVENT_SERVE_S:-0}" != 0 ] && { "${qs[@]}" DSPARK_MAILBOX=0 bash "$0" serve --time-limit "$EVENT_SERVE_S" \
      --concurrency 1,16 ${QUICKSTART_ARGS:-} --out "$OUT/serve-event.json" || rc=1; }
    if [ -n "${BLOCK8_DIR:-}" ]; then
      b8=(env TARGET_DIR=runs/quickstart/target/final DRAFTER_DIR="$BLOCK8_DIR")
      "${b8[@]}" bash "$0" timeline --batches 1 --prompts 8 --runs k4,k8,auto --temperatures 0 --kernels 8 \
        --out "$OUT/timeline-block8.json" || rc=1
      "${b8[@]}" bash "$0" serve --time-limit "${BLOCK8_SERVE_S:-150}" --concurrency 1 \
        --out "$OUT/serve-block8.json" || rc=1
    fi
    # shellcheck disable=SC2086 # TRAIN_SPEED_ARGS is a word list
    [ "${TRAIN_SPEED:-0}" = 1 ] && { bash "$0" train-speed ${TRAIN_SPEED_ARGS:-} || rc=1; }
    [ "${REST_TESTS:-1}" = 1 ] && { rest_tests || rc=1; }
    echo "quickstart: done rc=$rc" | tee "$OUT/DONE"
    ;;
  detach)
    case "${1:-}" in
      quickstart|served|ablate-k3-mini|peer-qwen3-mini|tau-gap-k3-mini) ;;
      *) echo "run_gpu.sh detach: give a target that writes OUT/DONE (quickstart, served, ablate-k3-mini," \
           "peer-qwen3-mini, tau-gap-k3-mini), not '${1:-}'" >&2; exit 2 ;;
    esac
    priv=${DETACH_DIR:-/tmp/dspark-detached}
    rm -rf "$priv" && mkdir -p "$priv" && cp -a . "$priv"/ || exit 1
    rm -f "$OUT/DONE"
    (cd "$priv" && OUT="$OUT" setsid nohup bash bench/run_gpu.sh "$@" > "$OUT/main.log" 2>&1 < /dev/null &)
    echo "detached: bash bench/run_gpu.sh $* in $priv; log $OUT/main.log (follow with RUN_OUT=$OUT ... wait)"
    exit 0
    ;;
  wait)
    run_out=${RUN_OUT:-runs/gpu}
    end=$((SECONDS + ${1:-60}))
    # logs and tables only: no checkpoints, sequences or speculators' feature files; archived every 30 s too, so a
    # call cut short by its time limit (the device time left can be less than asked) still brings back the last one
    archive() {
      tar -czf "$OUT/results.tgz.part" -C "$run_out" --exclude="*.tgz" --exclude="*.safetensors" --exclude="*.pt" \
        --exclude="*.arrow" --exclude="*.bin" . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"
    }
    last=$SECONDS
    while [ ! -f "$run_out/DONE" ] && [ $SECONDS -lt $end ]; do
      sleep 5
      [ $((SECONDS - last)) -ge 30 ] && { archive; last=$SECONDS; }
    done
    archive && ls -la "$run_out"
    tail -n 4 "$run_out"/first.txt "$run_out"/side.txt "$run_out"/rest.txt "$run_out"/train-*.txt "$run_out"/peer.txt \
      "$run_out"/tau-gap.txt 2>/dev/null
    head -n 60 "$run_out"/test-failures.txt 2>/dev/null
    cat "$run_out"/peer/peer.md "$run_out"/ablate/ablation.md "$run_out"/speed-*/speed.md 2>/dev/null
    grep -h "^|" "$run_out"/serve.txt "$run_out"/pair.txt "$run_out"/timeline.txt 2>/dev/null | tail -n 80
    cat "$run_out/DONE" 2>/dev/null || echo "not done yet"
    ;;
  regen-speed)
    # shellcheck disable=SC2086 # TARGET_ARGS is a word list
    log train-target python3 -m train recipes/targets/k3-mini.yaml log.wandb_mode=disabled \
      ${TARGET_ARGS:-max_steps=20} || rc=$?
    for mp in bf16 no; do
      python3 -m train recipes/k3-mini.yaml target=runs/k3-mini/final output_dir="runs/regen-$mp" \
        mixed_precision=$mp max_steps=1 log.wandb_mode=disabled \
        data.regenerate.num_sequences="${REGEN_N:-2048}" 2>&1 | grep "regenerate:" | tee -a "$OUT/regen-speed.txt"
    done
    ;;
  exec)
    [ $# -gt 0 ] || { echo "run_gpu.sh exec: give the command to run" >&2; exit 2; }
    "$@" || rc=$?
    ;;
esac
save_autotune
# a file over the 16 MiB the device tool brings back (a serve_bench JSON of many levels holds every request's times)
# comes back gzipped
find "$OUT" -maxdepth 1 -name "*.json" -size +15M -exec gzip -f {} \; -exec echo "gzipped {}: over 15 MiB" \;
exit $rc
