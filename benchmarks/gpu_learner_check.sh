#!/usr/bin/env bash
# GPU check of what runs without vLLM (benchmarks/gpu_smoke.sh checks the vLLM paths):
#   1. the colocated sync's CUDA IPC hand-off between two processes, from a DeepSpeed learner rank
#      on the GPU, across optimizer steps (benchmarks/gpu_ipc_check.py), fp32 and bf16;
#   2. three GRPO steps of the shipped base judge through `pjray train` on a Ray cluster: the
#      DeepSpeed learner (bf16) and an HF rollout engine sharing one GPU, shared-memory sync;
#      per-step timings and |learner - rollout| log-prob differences;
#   3. three steps of a tiny Qwen2-VL judge with the hybrid engine (the learner rank generates
#      with the weights it trains);
#   4. the learner tests (tests/integration/test_learner.py, not the slow ones), whose ranks
#      train on the GPU when one is visible.
# Each part has its own time limit and the script goes on after a failure; the last line sums up.
#
# Needs a CUDA machine with pjray installed (pip install -e '.[test]'); vLLM is not needed.
# Usage: [PARTS="ipc hf hybrid tests"] benchmarks/gpu_learner_check.sh [run_root]
#        (default: every part, runs under runs/gpu_learner_check)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="${1:-runs/gpu_learner_check}"
PY="${PYTHON:-python}"
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_learner_check: no CUDA GPU visible; nothing to check" >&2
  exit 1
fi
"$PY" -c "import torch, transformers, deepspeed, ray; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__, '| ray', ray.__version__, \
'|', torch.cuda.get_device_name(0))"

failed=()
wanted() { [[ " ${PARTS:-ipc hf hybrid tests} " == *" $1 "* ]]; }
part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local start=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "== $name: rc $rc, $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

if wanted ipc; then
  part "ipc fp32" 90 "$PY" benchmarks/gpu_ipc_check.py --syncs 3
  part "ipc bf16" 90 "$PY" benchmarks/gpu_ipc_check.py --syncs 3 --bf16
fi

COMMON=(
  model.dtype=bfloat16 learner.bf16=true
  data.num_items=8 algo.group_size=4 rollout.max_new_tokens=48
  trainer.prompts_per_step=4 trainer.steps=3 trainer.save_every=0 trainer.export_hf=false
  trainer.resume=disable learner.micro_batch_size=4 learner.lr=1e-4 tracking.wandb=false
  ray.num_gpus=1 learner.num_ranks=1
)

train_mode() {  # train_mode NAME OVERRIDES...
  local name=$1; shift
  local dir="$ROOT/$name"
  rm -rf "$dir"
  part "train $name" 150 "$PY" -m pjray train "${COMMON[@]}" "trainer.run_dir=$dir" "$@"
  [ -f "$dir/metrics.jsonl" ] && "$PY" benchmarks/step_table.py "$dir/metrics.jsonl"
}

wanted hf && train_mode hf rollout.backend=hf rollout.device=cuda rollout.num_workers=1 \
  learner.num_gpus_per_rank=0.5 rollout.num_gpus_per_worker=0.5
wanted hybrid && train_mode hybrid model.init=tiny algo.prefilter_zero_std=false model.tiny_arch=qwen2_vl data.image_size=96 \
  rollout.backend=hybrid learner.num_gpus_per_rank=1
wanted tests && part "learner tests" 300 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/integration/test_learner.py

if [ "${#failed[@]}" -eq 0 ]; then
  echo "gpu_learner_check: all parts passed"
else
  echo "gpu_learner_check: failed: ${failed[*]}"
  exit 1
fi
