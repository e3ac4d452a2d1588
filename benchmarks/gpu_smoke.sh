#!/usr/bin/env bash
# GPU smoke check of the production path, vLLM engines compiled with CUDA graphs on (as GPU runs
# take them; nothing here sets rollout.enforce_eager): first the VL engine checks on the GPU
# (below) and the bf16 parity table, then GRPO on vLLM with its assertions
# (tests/integration/test_vllm_gpu.py), then three GRPO steps of a tiny random Qwen2-VL judge on
# images with vLLM rollouts and a DeepSpeed learner, colocated on one GPU (CUDA-IPC weight sync,
# vLLM sleeping while the learner trains), then split over two GPUs (NCCL broadcast), and async
# rollouts against the synchronous loop on two GPUs. Prints each run's per-step table
# (benchmarks/step_table.py): phase timings, the weight-sync time, the learner-vs-rollout
# log-prob differences, which must stay small on every step the learner's own weights sampled.
#
# Every step runs whatever happened to the ones before it, under a time limit of its own; a
# step that fails (or runs past its limit) makes the script exit non-zero, and
# <run_root>/summary.md lists each step's result (benchmarks/steps.sh). Steps that need two
# GPUs are listed as skipped on one.
#
# Needs a CUDA machine with pjray installed with the gpu extra (pip install -e '.[gpu,test]').
# Usage: benchmarks/gpu_smoke.sh [run_root]          (default: runs/gpu_smoke)
#        PYTHON=... picks the interpreter. benchmarks/gpu_day.sh runs these steps too (it
#        sources this file for `smoke_steps`).
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/steps.sh"

# A stale weight, head or encoder cache after a sync shows as a gap far above fp32's.
SMOKE_MAX_DIFF=1e-2
SMOKE_COMMON=(
  model.init=tiny algo.prefilter_zero_std=false model.tiny_arch=qwen2_vl rollout.backend=vllm rollout.device=cuda rollout.max_model_len=2048
  rollout.max_new_tokens=64 data.num_items=4 data.image_size=96 algo.group_size=4
  trainer.prompts_per_step=4 trainer.steps=3 trainer.save_every=0 trainer.export_hf=false
  trainer.resume=disable learner.micro_batch_size=4 learner.lr=1e-4 tracking.wandb=false
)

smoke_train() {  # smoke_train ROOT NAME SECONDS OVERRIDES...: a `pjray train` step, then its table
  local root=$1 name=$2 limit=$3
  shift 3
  local dir="$root/$name"
  rm -rf "$dir"
  step "train $name" "$limit" "$PY" -m pjray train "${SMOKE_COMMON[@]}" "trainer.run_dir=$dir" "$@" &&
    step "gaps $name" 60 "$PY" benchmarks/step_table.py "$dir/metrics.jsonl" --max-diff-max "$SMOKE_MAX_DIFF"
}

smoke_steps() {  # smoke_steps ROOT GPUS: every step of the smoke check, in order
  local root=$1 gpus=$2

  # The vision-language engine checks on the GPU, no Ray or DeepSpeed needed (vLLM's GPU build,
  # Model Runner V2 where Triton is present): per tiny VL arch, sampling on images, served vs
  # learner log-probs, and the stale-encoder-cache check after a sync of every weight (bytes and
  # shared memory).
  step "VL engine checks (CUDA graphs)" 1200 env PJRAY_VLLM_DEVICE=cuda \
    "$PY" -m pytest -q -s -p no:cacheprovider tests/integration/test_vllm_vl_cpu.py -k "not grpo"

  # bf16 parity of vLLM against the learner's forward on the GPU, before and after a sync, with
  # top-k/top-p off, for untied and tied tiny judges; with Model Runner V2 off and on, and with
  # tensor parallelism 2 when two GPUs exist. One markdown table per run, to paste into an issue.
  step "parity V1 runner" 900 env VLLM_USE_V2_MODEL_RUNNER=0 "$PY" benchmarks/gpu_vllm_parity.py
  step "parity V2 runner" 900 env VLLM_USE_V2_MODEL_RUNNER=1 "$PY" benchmarks/gpu_vllm_parity.py
  if [ "$gpus" -ge 2 ]; then
    step "parity TP=2" 900 "$PY" benchmarks/gpu_vllm_parity.py --tp 2
  else
    skip "parity TP=2" "needs 2 GPUs, $gpus visible"
  fi

  # GRPO on vLLM with its assertions: after three steps on the same two images the engine serves
  # the learner's weights, colocated (CUDA IPC, sleep mode) and, on two GPUs, split (NCCL).
  step "GRPO on vLLM (test_vllm_gpu.py)" 1800 "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_vllm_gpu.py

  # One GPU: learner rank and engine share it; vLLM gets a small KV-cache budget and sleeps.
  smoke_train "$root" colocated 900 ray.num_gpus=1 learner.num_ranks=1 rollout.num_workers=1 rollout.colocate=true \
    learner.num_gpus_per_rank=0.5 rollout.num_gpus_per_worker=0.4 rollout.gpu_memory_utilization=0.3 \
    trainer.sync_backend=ipc

  if [ "$gpus" -lt 2 ]; then
    skip "train split" "needs 2 GPUs, $gpus visible"
    skip "async against sync" "needs 2 GPUs, $gpus visible: an engine of its own beside the learner"
    return
  fi
  # Two GPUs: the learner on one, the engine on the other, NCCL broadcast between them.
  smoke_train "$root" split 900 ray.num_gpus=2 learner.num_ranks=1 rollout.num_workers=1 \
    learner.num_gpus_per_rank=1 rollout.num_gpus_per_worker=1 rollout.gpu_memory_utilization=0.5 \
    trainer.sync_backend=nccl

  # Async rollouts against the synchronous loop (benchmarks/bench_async.py's comparison, with
  # vLLM): the engine on a GPU of its own generates step t+1 while the learner trains step t,
  # with TIS. Ten steps each; the table's timing_s/step rows give the steps per second of both.
  # Colocated engines sleep while the learner trains (nothing to overlap), so this needs two GPUs.
  local async=(trainer.steps=10 algo.rollout_is=token ray.num_gpus=2 learner.num_ranks=1 rollout.num_workers=1
               learner.num_gpus_per_rank=1 rollout.num_gpus_per_worker=1 rollout.gpu_memory_utilization=0.5
               trainer.sync_backend=nccl)
  smoke_train "$root" sync-k0 1200 "${async[@]}" trainer.max_staleness=0
  smoke_train "$root" async-k1 1200 "${async[@]}" trainer.max_staleness=1
  step "async against sync" 60 "$PY" - "$root" <<'PYEOF'
import json, sys
from pathlib import Path
rate = {}
for mode in ("sync-k0", "async-k1"):
    rows = [json.loads(l) for l in (Path(sys.argv[1]) / mode / "metrics.jsonl").read_text().splitlines()][1:]
    rate[mode] = len(rows) / sum(r["timing_s/step"] for r in rows)
    print(f"{mode}: {rate[mode]:.3f} steps/s, staleness max {max(r['rollout/staleness_max'] for r in rows):.0f}")
print(f"async speed-up on two GPUs: {rate['async-k1'] / rate['sync-k0']:.2f}x")
PYEOF
}

gpu_count() {  # CUDA GPUs the interpreter sees (0 when torch does not import)
  "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  cd "$(dirname "$0")/.." || exit 1
  ROOT="${1:-runs/gpu_smoke}"
  PY="${PYTHON:-python}"
  export PYTHONUNBUFFERED=1
  GPUS=$(gpu_count)
  if [ "$GPUS" -lt 1 ]; then
    echo "gpu_smoke: no CUDA GPU visible; nothing to check" >&2
    exit 1
  fi
  steps_begin "$ROOT/summary.md" "gpu_smoke ($GPUS GPUs)"
  smoke_steps "$ROOT" "$GPUS"
  steps_end
fi
