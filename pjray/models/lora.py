"""LoRA adapters (PEFT) on a judge, and the merged weights it exports.

`model.lora.rank > 0` wraps the learner's judge in a `peft.PeftModel`: low-rank adapters on the
linear layers (`model.lora.target_modules`, by default every linear layer but the output
projection, as PEFT's "all-linear" selects them), none in the vision part (encoder and projector) unless
`model.lora.vision` asks for them, as the Perception-Judge release trains its 32B Flex judge.
Only the adapters train; the base weights stay frozen, so the reference model of the KL term is
the same module with its adapters disabled (no second copy).

Everything that leaves the learner as full weights (a merged weight sync, checksums, the HF
export) sees the judge as a plain HF model: `export_view` lists the base model's own parameter
names, and each adapted weight is exported merged, W + scaling * (B @ A), computed from the
current adapters without touching the module (merging in place and back would drift W by
rounding). An adapter sync (model.lora.sync=adapter, `pjray.sync.adapter`) sends the adapter
alone instead: the engines hold the frozen base weights already.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pjray.models.families import VISION_PARTS

if TYPE_CHECKING:
    from pjray.config import LoraConfig

__all__ = ["ExportedParam", "apply_lora", "base_model", "export_view", "is_lora"]

ADAPTER = "default"  # PEFT's name of the one adapter we train
_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the HF model


@dataclass(frozen=True)
class ExportedParam:
    """One parameter as a plain HF model names it, and how to compute its full value from the
    module's parameters (`params`, which a ZeRO-3 caller gathers first)."""

    name: str
    params: tuple[torch.nn.Parameter, ...]
    value: Callable[[], Tensor]

    @property
    def shape(self) -> torch.Size:
        base = self.params[0]
        return getattr(base, "ds_shape", base.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """`model` wrapped in a PeftModel with one trainable LoRA adapter, as `cfg` says."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = cfg.target_modules
    # The vision part is left out by name where there is one (a text-only judge has none, and
    # PEFT warns about an exclusion that matches nothing).
    has_tower = any(re.search(VISION_PARTS, name) for name, _ in model.named_modules())
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        exclude_modules=VISION_PARTS if has_tower and not cfg.vision else None,
    )
    return get_peft_model(model, peft_cfg)


def is_lora(model: torch.nn.Module) -> bool:
    # A model can only be a PeftModel once peft is imported: a run without LoRA never imports it.
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under a PeftModel (adapters injected and active), else `model` itself."""
    return model.get_base_model() if is_lora(model) else model  # type: ignore[operator]


def export_view(model: torch.nn.Module) -> list[ExportedParam]:
    """The parameters a plain HF model of the same architecture has, by its names, in module
    order: for a LoRA model the base weights with the adapters merged in; otherwise the
    module's own parameters as they are."""
    if not is_lora(model):
        return [ExportedParam(name, (p,), _reader(p)) for name, p in model.named_parameters()]
    out: list[ExportedParam] = []
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue  # adapters: merged into their base weight below
        plain = name.removeprefix(_PREFIX).replace(".base_layer.", ".")
        if not name.endswith(".base_layer.weight"):
            out.append(ExportedParam(plain, (param,), _reader(param)))
            continue
        layer = model.get_submodule(name.removesuffix(".base_layer.weight"))
        adapters = (layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight)
        out.append(ExportedParam(plain, (param, *adapters), _merged(layer, param)))
    return out


def _reader(param: torch.nn.Parameter) -> Callable[[], Tensor]:
    return lambda: param.data


def _merged(layer: torch.nn.Module, weight: torch.nn.Parameter) -> Callable[[], Tensor]:
    def value() -> Tensor:
        with torch.no_grad():
            delta = layer.get_delta_weight(ADAPTER)  # scaling * (B @ A), in the layout of W
            return weight.data + delta.to(weight.dtype)

    return value
