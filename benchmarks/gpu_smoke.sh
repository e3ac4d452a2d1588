#!/usr/bin/env bash
# GPU smoke check of the production path: first the VL engine checks on the GPU (below) and the
# bf16 parity table, then three GRPO steps of a tiny random Qwen2-VL judge on images with
# vLLM rollouts and a DeepSpeed learner, colocated on one GPU (CUDA-IPC weight sync, vLLM
# sleeping while the learner trains), then split over two GPUs (NCCL broadcast) when there are
# two. Prints each mode's per-step table (benchmarks/step_table.py): phase timings, the
# weight-sync time, the learner-vs-rollout log-prob differences.
#
# Needs a CUDA machine with pjray installed with the gpu extra (pip install -e '.[gpu,test]').
# Usage: benchmarks/gpu_smoke.sh [run_root]          (default: runs/gpu_smoke)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${1:-runs/gpu_smoke}"
PY="${PYTHON:-python}"

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 1 ]; then
  echo "gpu_smoke: no CUDA GPU visible; nothing to check" >&2
  exit 1
fi

# The vision-language engine checks on the GPU, no Ray or DeepSpeed needed (vLLM's GPU build, Model
# Runner V2 where Triton is present): per tiny VL arch, sampling on images, served vs learner
# log-probs, and the stale-encoder-cache check after a sync of every weight (bytes and shared
# memory). One line per check with its figure.
echo "== VL engine checks (tests/integration/test_vllm_vl_cpu.py on cuda)"
PJRAY_VLLM_DEVICE=cuda "$PY" -m pytest -q -s -p no:cacheprovider tests/integration/test_vllm_vl_cpu.py -k "not grpo" 2>&1 \
  | grep -E "d logprob|after the bytes sync|passed|failed|Error" || true

# bf16 parity of vLLM against the learner's forward on the GPU, before and after a sync, with
# top-k/top-p off, for untied and tied tiny judges; with Model Runner V2 off and on, and with
# tensor parallelism 2 when two GPUs exist. One markdown table per run, to paste into an issue.
echo "== bf16 parity (benchmarks/gpu_vllm_parity.py)"
VLLM_USE_V2_MODEL_RUNNER=0 "$PY" benchmarks/gpu_vllm_parity.py || true
VLLM_USE_V2_MODEL_RUNNER=1 "$PY" benchmarks/gpu_vllm_parity.py || true
if [ "$GPUS" -ge 2 ]; then
  "$PY" benchmarks/gpu_vllm_parity.py --tp 2 || true
fi

COMMON=(
  model.init=tiny model.tiny_arch=qwen2_vl rollout.backend=vllm rollout.device=cuda rollout.max_model_len=2048
  rollout.max_new_tokens=64 data.num_items=4 data.image_size=96 algo.group_size=4
  trainer.prompts_per_step=4 trainer.steps=3 trainer.save_every=0 trainer.export_hf=false
  trainer.resume=disable learner.micro_batch_size=4 learner.lr=1e-4 tracking.wandb=false
)

run_mode() {
  local mode=$1; shift
  local dir="$ROOT/$mode"
  rm -rf "$dir"
  echo "== $mode: $*"
  local start=$SECONDS
  "$PY" -m pjray train "${COMMON[@]}" "trainer.run_dir=$dir" "$@"
  echo "== $mode: $((SECONDS - start)) s wall (setup included)"
  # Per step: the phases' wall times (sync among them) and the rollout-vs-learner log-prob
  # differences (the same 4 images every step: a stale encoder cache after a sync shows there).
  "$PY" benchmarks/step_table.py "$dir/metrics.jsonl"
}

# One GPU: learner rank and engine share it; vLLM gets a small KV-cache budget and sleeps.
run_mode colocated ray.num_gpus=1 learner.num_ranks=1 rollout.num_workers=1 rollout.colocate=true \
  learner.num_gpus_per_rank=0.5 rollout.num_gpus_per_worker=0.4 rollout.gpu_memory_utilization=0.3 \
  trainer.sync_backend=ipc

if [ "$GPUS" -ge 2 ]; then
  # Two GPUs: the learner on one, the engine on the other, NCCL broadcast between them.
  run_mode split ray.num_gpus=2 learner.num_ranks=1 rollout.num_workers=1 \
    learner.num_gpus_per_rank=1 rollout.num_gpus_per_worker=1 rollout.gpu_memory_utilization=0.5 \
    trainer.sync_backend=nccl
else
  echo "== split: skipped ($GPUS GPU visible, needs 2)"
fi

# Async rollouts against the synchronous loop (benchmarks/bench_async.py's comparison, with vLLM):
# the engine on a GPU of its own generates step t+1 while the learner trains step t, with TIS.
# Ten steps each; the table's timing_s/step rows give the steps per second of both. An engine
# needs a whole GPU of its own unless colocated, and colocated engines sleep while the learner
# trains (nothing to overlap), so this needs two GPUs.
if [ "$GPUS" -ge 2 ]; then
  ASYNC=(trainer.steps=10 algo.rollout_is=token ray.num_gpus=2 learner.num_ranks=1 rollout.num_workers=1
         learner.num_gpus_per_rank=1 rollout.num_gpus_per_worker=1 rollout.gpu_memory_utilization=0.5
         trainer.sync_backend=nccl)
  run_mode sync-k0 "${ASYNC[@]}" trainer.max_staleness=0
  run_mode async-k1 "${ASYNC[@]}" trainer.max_staleness=1
  "$PY" - "$ROOT" <<'PYEOF'
import json, sys
from pathlib import Path
rate = {}
for mode in ("sync-k0", "async-k1"):
    rows = [json.loads(l) for l in (Path(sys.argv[1]) / mode / "metrics.jsonl").read_text().splitlines()][1:]
    rate[mode] = len(rows) / sum(r["timing_s/step"] for r in rows)
    print(f"{mode}: {rate[mode]:.3f} steps/s, staleness max {max(r['rollout/staleness_max'] for r in rows):.0f}")
print(f"async speed-up on two GPUs: {rate['async-k1'] / rate['sync-k0']:.2f}x")
PYEOF
else
  echo "== async: skipped ($GPUS GPU visible, needs 2: an engine of its own beside the learner)"
fi
