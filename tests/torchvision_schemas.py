"""Declares the schemas of torchvision's `nms` and `qnms` operators, loaded at interpreter start
in the vLLM CPU test venv (tests/vllm_cpu_env.sh) when the only torchvision at hand is a CUDA
build whose C++ ops cannot load beside the CPU torch: torchvision registers fake kernels for
these two at import, which needs the operators declared. No kernel is registered, so calling
them raises, as in any torchvision without its C++ ops. A torchvision whose ops load defines
the same schemas itself; this file is then not installed.
"""

import torch

_LIBRARY = torch.library.Library("torchvision", "DEF")
_LIBRARY.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_LIBRARY.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
