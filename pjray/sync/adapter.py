"""Adapter-only weight sync (`model.lora.sync=adapter`): the message and both of its ends.

With LoRA the base weights never change, so an engine that loaded the base judge once needs only
the adapter at every sync: for a 7B judge at rank 8, tens of MB instead of ~15 GB of merged
weights. `AdapterUpdate` is that message, the adapter as PEFT saves it (its config and its
state dict), built on the learner (`adapter_update`, under ZeRO-3 inside a gather of the
adapters) and put in the Ray object store once; each engine applies it its own way: the HF
engine loads it into a PEFT wrapper of its model (`peft_config`, `set_peft_model_state_dict`),
vLLM serves it from a directory in PEFT's format (`AdapterUpdate.write`) as a new LoRA request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from pjray.models.lora import ADAPTER, is_lora

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "AdapterUpdate", "adapter_update"]

ADAPTER_CONFIG = "adapter_config.json"  # the file names of PEFT's save_pretrained
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterUpdate:
    """The learner's LoRA adapter, as PEFT saves it.

    `config` is PEFT's adapter config (the content of adapter_config.json: r, lora_alpha,
    target_modules, exclude_modules, ...), JSON types only. `tensors` maps PEFT's state-dict
    names (`base_model.model.<module path>.lora_A.weight` [r, in] and `....lora_B.weight`
    [out, r], no adapter name) to CPU tensors.
    """

    config: dict[str, Any]
    tensors: dict[str, Tensor]

    @property
    def nbytes(self) -> int:
        """What a sync moves: the adapter's tensor bytes (the config is a few hundred bytes)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    def peft_config(self) -> PeftLoraConfig:
        """PEFT's LoraConfig of this adapter, in inference mode."""
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig.from_peft_type(**{**self.config, "inference_mode": True})

    def write(self, directory: str | Path) -> Path:
        """Write the adapter into `directory` in PEFT's format (what `PeftModel.from_pretrained`
        and vLLM's LoRA loader read); returns the directory."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / ADAPTER_CONFIG).write_text(json.dumps(self.config, indent=2, sort_keys=True))
        save_file({k: t.contiguous() for k, t in self.tensors.items()}, str(out / ADAPTER_WEIGHTS))
        return out


def _json_value(value: Any) -> Any:
    """A PEFT config value in JSON types: sets (resolved target modules) as sorted lists, enums
    (peft_type) as their string values."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if hasattr(value, "value") and isinstance(value, str):  # a str enum (PeftType, TaskType)
        return value.value
    return value


def adapter_update(model: torch.nn.Module) -> AdapterUpdate:
    """The adapter of a PeftModel (`pjray.models.lora.apply_lora`) as an `AdapterUpdate`, copied
    to CPU. Under ZeRO-3 call it inside a gather of the adapter parameters: it reads the module's
    state dict."""
    from peft import get_peft_model_state_dict

    if not is_lora(model):
        raise ValueError(f"adapter_update: {type(model).__name__} has no LoRA adapter (model.lora.rank=0)")
    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    config = _json_value(model.peft_config[ADAPTER].to_dict())  # type: ignore[union-attr]
    return AdapterUpdate(config, {name: t.detach().to("cpu", copy=True) for name, t in state.items()})
