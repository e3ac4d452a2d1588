#!/usr/bin/env bash
# A GPU day in one command: the checks the vLLM paths still owe a GPU, in order, with one
# summary at the end (<run_root>/summary.md; each step's log under <run_root>/logs/).
#
#   1. install: pjray on its pinned set (torch first, then '.[gpu,test]', which pins vLLM), and
#      flash-attn (the recipes' packed attention), `pip check`, and the installed versions
#      against pyproject.toml's pins;
#   2. the CUDA GPUs torch sees; on two, the NCCL weight-sync group's GPU-marked tests;
#   3. vLLM with CUDA graphs, parity and GRPO: every step of benchmarks/gpu_smoke.sh (the VL
#      engine checks on the GPU; bf16 log-prob parity on Model Runner V1 and V2 and at TP=2;
#      tests/integration/test_vllm_gpu.py; three GRPO steps colocated (CUDA IPC, sleep mode)
#      and split (NCCL), and async rollouts against the synchronous loop, each with its
#      log-prob gaps checked);
#   4. three steps of the real recipe, configs/qwen3vl_4b.yaml (Qwen3-VL-4B-Thinking from the
#      hub): as shipped on 8 GPUs; on fewer, its split layout on what is there (half the GPUs
#      learner ranks, half engines), or colocated on one. Its data: the PPJD parquet at
#      $RECIPE_DATA when set, else generated scenes. Its table must show a mean log-prob gap
#      under 0.05 (bf16 kernels differ by ~1e-2) on every step;
#   4b. ZeRO-3 and offload during generation: three steps of the same recipe colocated on every
#      GPU (two at least: ZeRO-3 ranks must run the same forwards), ZeRO-3 (the model loaded
#      partitioned), the optimizer's states off the GPU while the engines generate, micro-batches
#      cut by a token budget, dynamic sampling's padding rows and two mini-batches (old
#      log-probs), the hub checkpoint staged to local disk (model.stage_dir), its gaps checked;
#   5. three steps of the judge at work, configs/policy_qwen25vl_7b.yaml (a Qwen2.5-VL-7B policy
#      rewarded by a 7B judge on vLLM engines of its own; the judge jongwooko/Flex-VL-7B from the
#      hub unless $POLICY_JUDGE names another, its rows $POLICY_DATA or the recipe's dataset):
#      8 GPUs as shipped; skipped on fewer.
#
# Every step runs whatever happened to the ones before it, under a time limit of its own; the
# script exits non-zero when any failed (benchmarks/steps.sh). Steps that need two GPUs are
# listed as skipped on one.
#
# Usage: benchmarks/gpu_day.sh [run_root]            (default: runs/gpu_day)
#        PYTHON=...        the interpreter (its environment gets the install)
#        SKIP_INSTALL=1    pjray is installed already: check the pins only
#        RECIPE_DATA=...   a PPJD parquet for the recipe's steps
#        RECIPE_LIMIT=...  seconds for the recipe's steps (default 5400: download, start-up, 3 steps)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
. benchmarks/gpu_smoke.sh  # steps.sh, smoke_steps, gpu_count

ROOT="${1:-runs/gpu_day}"
PY="${PYTHON:-python}"
export PYTHONUNBUFFERED=1

steps_begin "$ROOT/summary.md" "gpu_day" "pjray $(git rev-parse --short HEAD 2>/dev/null || echo "(no git)"), $(nvidia-smi -L 2>/dev/null | wc -l) GPUs listed by nvidia-smi"

# 1. The pinned set. torch goes first: its pin resolves to the CUDA build here, and vLLM pins it too.
TORCH_PIN=$(grep -oE '"torch==[0-9][^"]*"' pyproject.toml | tr -d '"')
if [ -n "${SKIP_INSTALL:-}" ]; then
  skip "install" "SKIP_INSTALL is set"
else
  step "install $TORCH_PIN" 1200 "$PY" -m pip install "$TORCH_PIN"
  step "install pjray[gpu,test]" 1800 "$PY" -m pip install -e '.[gpu,test]'
  # The recipes pack sequences into flash attention's variable-length kernels
  # (model.attn_implementation=flash_attention_2); it builds against the installed torch.
  step "install flash-attn" 3600 "$PY" -m pip install flash-attn --no-build-isolation
fi
step "pip check" 120 "$PY" -m pip check
step "pinned versions" 120 "$PY" - <<'PYEOF'
"""The installed versions of pyproject.toml's exact pins (dependencies and the gpu extra)."""
import re
import sys
from importlib.metadata import PackageNotFoundError, version

text = open("pyproject.toml").read()
try:
    import tomllib

    project = tomllib.loads(text)["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["gpu"]
except ModuleNotFoundError:  # Python 3.10: the two lists read as text
    listed = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S).group(1) + re.search(r"^gpu = \[(.*)\]", text, re.M).group(1)
    requirements = re.findall(r'"([^"]+)"', listed)
pins = {m[1]: m[2] for r in requirements if (m := re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", r))}
wrong = []
for name, pinned in sorted(pins.items()):
    try:
        installed = version(name)
    except PackageNotFoundError:
        installed = "missing"
    # A local build tag (torch's +cu128) is the same release.
    ok = installed.split("+")[0] == pinned
    print(f"{name:24} pinned {pinned:12} installed {installed}{'' if ok else '   <-- differs'}")
    wrong += [] if ok else [name]
sys.exit(f"not the pinned set: {', '.join(wrong)}" if wrong else 0)
PYEOF

# 2. The GPUs.
step "CUDA GPUs" 120 "$PY" -c "import sys, torch; n = torch.cuda.device_count(); \
print(n, 'GPUs:', [torch.cuda.get_device_name(i) for i in range(n)], 'torch', torch.__version__, 'CUDA', torch.version.cuda); \
sys.exit(n == 0)"
GPUS=$(gpu_count)

# 2b. The GPU-marked tests of the weight-sync group: NCCL forming, naming a member that never
# joins, and a receive whose sender never sends.
if [ "$GPUS" -ge 2 ]; then
  step "NCCL sync group (GPU-marked tests)" 600 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_sync_group.py
else
  skip "NCCL sync group (GPU-marked tests)" "needs 2 GPUs, $GPUS here"
fi

# 3. vLLM with CUDA graphs, parity on both model runners and TP=2, colocated, split and async.
smoke_steps "$ROOT/smoke" "$GPUS"

# 4. The real recipe, three steps.
RECIPE=(trainer.steps=3 trainer.save_every=0 trainer.export_hf=false trainer.resume=disable tracking.wandb=false
        "trainer.run_dir=$ROOT/recipe")
if [ -n "${RECIPE_DATA:-}" ]; then
  RECIPE+=("data.path=$RECIPE_DATA")
else
  RECIPE+=(data.source=scenes "data.path=''" data.num_items=512)
fi
if [ "$GPUS" -ge 8 ]; then
  LAYOUT="as shipped: 4 learner + 4 engine GPUs, NCCL"
elif [ "$GPUS" -ge 2 ]; then
  half=$((GPUS / 2))
  LAYOUT="split: $half learner + $half engine GPUs, NCCL"
  RECIPE+=("ray.num_gpus=$((2 * half))" "learner.num_ranks=$half" "rollout.num_workers=$half"
           "trainer.prompts_per_step=$((32 * half))")
else
  LAYOUT="colocated on 1 GPU, CUDA IPC"
  RECIPE+=(ray.num_gpus=1 learner.num_ranks=1 rollout.num_workers=1 rollout.colocate=true learner.num_gpus_per_rank=0.5
           rollout.num_gpus_per_worker=0.4 rollout.gpu_memory_utilization=0.35 trainer.sync_backend=ipc
           trainer.prompts_per_step=16)
fi
rm -rf "$ROOT/recipe"
step "recipe qwen3vl_4b, 3 steps ($LAYOUT)" "${RECIPE_LIMIT:-5400}" \
  "$PY" -m pjray train --config configs/qwen3vl_4b.yaml "${RECIPE[@]}" &&
  step "recipe gaps" 60 "$PY" benchmarks/step_table.py "$ROOT/recipe/metrics.jsonl" --max-diff-mean 0.05

# 4b. ZeRO-3 and offload during generation, three steps.
if [ "$GPUS" -ge 2 ]; then
  rm -rf "$ROOT/zero3"
  ZERO3=(trainer.steps=3 trainer.save_every=0 trainer.export_hf=false trainer.resume=disable tracking.wandb=false
         "trainer.run_dir=$ROOT/zero3" "model.stage_dir=$ROOT/stage" data.source=scenes "data.path=''" data.num_items=512
         "ray.num_gpus=$GPUS" "learner.num_ranks=$GPUS" "rollout.num_workers=$GPUS" rollout.colocate=true
         learner.num_gpus_per_rank=0.5 rollout.num_gpus_per_worker=0.4 rollout.gpu_memory_utilization=0.35
         trainer.sync_backend=ipc learner.zero_stage=3 learner.offload_during_generation=true
         learner.micro_batch_tokens=16384 algo.filter_zero_std=true algo.ppo_mini_batches=2
         "trainer.prompts_per_step=$((16 * GPUS))")
  step "recipe qwen3vl_4b, ZeRO-3 and offload during generation, 3 steps (colocated on $GPUS GPUs)" \
    "${RECIPE_LIMIT:-5400}" "$PY" -m pjray train --config configs/qwen3vl_4b.yaml "${ZERO3[@]}" &&
    step "ZeRO-3 gaps" 60 "$PY" benchmarks/step_table.py "$ROOT/zero3/metrics.jsonl" --max-diff-mean 0.05
else
  skip "recipe qwen3vl_4b, ZeRO-3 and offload during generation, 3 steps" "needs 2 GPUs, $GPUS here"
fi

# 5. The judge at work, three steps.
POLICY=(trainer.steps=3 trainer.save_every=0 trainer.export_hf=false trainer.resume=disable tracking.wandb=false
        "trainer.run_dir=$ROOT/policy" "reward.judge.model=${POLICY_JUDGE:-jongwooko/Flex-VL-7B}")
if [ -n "${POLICY_DATA:-}" ]; then
  POLICY+=("data.path=$POLICY_DATA")
fi
if [ "$GPUS" -ge 8 ]; then
  rm -rf "$ROOT/policy"
  step "recipe policy_qwen25vl_7b, 3 steps (4 learner + 2 policy engine + 2 judge engine GPUs)" "${RECIPE_LIMIT:-5400}" \
    "$PY" -m pjray train --config configs/policy_qwen25vl_7b.yaml "${POLICY[@]}"
else
  skip "recipe policy_qwen25vl_7b, 3 steps" "needs 8 GPUs, $GPUS here"
fi

steps_end
