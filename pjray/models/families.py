"""What differs between the vision-language judge families pjray trains, in one table.

A `Family` names its transformers model types, its processor (with no video processor, built
from a PIL image processor, so that nothing needs torchvision), where its vision part sits, the
per-token modality ids its forward takes, how the per-prompt image tensors of several rows join
into one forward's arguments, and how its positions and image sizes are set. The loader, the
learner, the engines and LoRA read this table; nothing else in pjray names a family. Every
family runs packed sequences (learner.packing): transformers reads the restarting position ids
of each as sequence boundaries. A text-only judge (a causal LM) has no family.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pjray.models.processors import (
    ImageOnlyGemma3Processor,
    ImageOnlyIdefics3Processor,
    ImageOnlyInternVLProcessor,
    ImageOnlyLlavaOnevisionProcessor,
    ImageOnlyQwen2_5_VLProcessor,
    ImageOnlyQwen2VLProcessor,
    ImageOnlyQwen3VLProcessor,
)

__all__ = ["FAMILIES", "IMAGE_ONLY_PROCESSORS", "VISION_PARTS", "Family", "family_of", "family_of_type", "token_types"]


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    processor: type  # its image-only processor class (`pjray.models.processors`)
    # The vision part's modules on the inner model (model.model.<name>): the encoder and the
    # projector into the text width, what model.freeze_vision freezes and LoRA leaves out.
    vision_parts: tuple[str, ...]
    vision_keys: tuple[str, ...]  # the processor's outputs that carry the images
    # The per-token modality ids the forward takes (1 on image slots), rebuilt from the ids
    # wherever a learner appends response tokens; None: the forward takes none.
    token_types: str | None = None
    mrope: bool = False  # positions from the model's own get_rope_index (Qwen-VL's M-RoPE)
    pixel_budget: bool = False  # model.min_pixels / max_pixels resize its images
    # Keys whose one-prompt tensors carry a leading prompt dimension of 1 over the images (the
    # forward flattens prompts x images and drops all-zero padding images): joined as one prompt.
    prompt_dim_keys: tuple[str, ...] = ()
    # Keys whose images are padded to the most patches (dim 1) when several join.
    padded_keys: tuple[str, ...] = ()
    image_counts: str | None = None  # the forward's per-prompt image counts, rebuilt on join
    nested_images: bool = False  # the processor takes each prompt's images as a list of its own
    slot_on_tokenizer: bool = False  # the image-feature slot token is the tokenizer's image_token
    system_parts: bool = True  # the chat template takes the system turn as content parts
    vllm_lora: bool = True  # vLLM serves LoRA adapters on it (model.lora.sync=adapter)
    # (pattern, replacement) renames from transformers' parameter names to the layout released
    # checkpoints and vLLM use, where they differ (`released_name`).
    released_names: tuple[tuple[str, str], ...] = ()

    def row_vision(self, encoding: Any) -> dict[str, Tensor]:
        """The image tensors of a one-prompt processor output, without the prompt dimension."""
        out = {}
        for key in self.vision_keys:
            value = encoding.get(key)
            if value is None:
                continue
            value = torch.as_tensor(value)
            out[key] = value[0] if key in self.prompt_dim_keys else value
        return out

    def join(self, rows: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
        """The forward's image arguments for prompts whose `row_vision` are `rows`, in order
        (rows without an image are {}); {} when none has one."""
        with_images = [r for r in rows if r]
        if not with_images:
            return {}
        out: dict[str, Tensor] = {}
        for key in self.vision_keys:
            parts = [r[key] for r in with_images if key in r]
            if not parts:
                continue
            if key in self.padded_keys:
                most = max(p.shape[1] for p in parts)
                parts = [torch.nn.functional.pad(p, (0,) * (2 * (p.dim() - 2)) + (0, most - p.shape[1])) for p in parts]
            joined = torch.cat(parts)
            out[key] = joined[None] if key in self.prompt_dim_keys else joined
        if self.image_counts is not None:
            out[self.image_counts] = torch.tensor([_images_in(self, r) for r in rows], dtype=torch.long)
        return out

    def vision_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The vision part's modules of `model` (an HF model or the inner one); ValueError where
        it has none of them."""
        inner = getattr(model, "model", model)
        found = [getattr(inner, name, None) for name in self.vision_parts]
        if not all(isinstance(m, torch.nn.Module) for m in found):
            raise ValueError(f"{type(model).__name__} lacks a {self.name} vision part {self.vision_parts}")
        return found  # type: ignore[return-value]

    def released_name(self, name: str) -> str:
        """`name` (a transformers parameter or checkpoint key) in the released layout."""
        for pattern, replacement in self.released_names:
            name = re.sub(pattern, replacement, name)
        return name

    def slot_id(self, processor: Any) -> int:
        """The token the model fills with image features (after the processor's expansion)."""
        owner = processor.tokenizer if self.slot_on_tokenizer else processor
        return int(owner.image_token_id)


_TOWER_AND_PROJECTOR = ("vision_tower", "multi_modal_projector")  # the LLaVA-style vision part

# transformers 5 names a SigLIP tower's parameters without the `vision_model.` level that released
# checkpoints and vLLM's SigLIP carry (it adds the level back only when loading).
_SIGLIP = ((r"^(model\.)?vision_tower\.(?!vision_model\.)", r"\1vision_tower.vision_model."),)


def _images_in(family: Family, row: dict[str, Tensor]) -> int:
    return 0 if not row else int(row[family.vision_keys[0]].shape[0])


def _qwen_vl(name: str, model_types: tuple[str, ...], processor: type) -> Family:
    """A Qwen-VL generation: M-RoPE, patches and grids, the pixel budget, `model.visual`."""
    return Family(
        name=name,
        model_types=model_types,
        processor=processor,
        vision_parts=("visual",),
        vision_keys=("pixel_values", "image_grid_thw"),
        token_types="mm_token_type_ids",
        mrope=True,
        pixel_budget=True,
        system_parts=False,
    )


FAMILIES: tuple[Family, ...] = (
    _qwen_vl("qwen2_vl", ("qwen2_vl",), ImageOnlyQwen2VLProcessor),
    _qwen_vl("qwen2_5_vl", ("qwen2_5_vl",), ImageOnlyQwen2_5_VLProcessor),
    # Qwen3-VL-MoE shares the Qwen3-VL processor.
    _qwen_vl("qwen3_vl", ("qwen3_vl", "qwen3_vl_moe"), ImageOnlyQwen3VLProcessor),
    Family(
        name="llava_onevision",
        model_types=("llava_onevision",),
        processor=ImageOnlyLlavaOnevisionProcessor,
        vision_parts=_TOWER_AND_PROJECTOR,
        vision_keys=("pixel_values", "image_sizes"),
        padded_keys=("pixel_values",),
        image_counts="batch_num_images",
        vllm_lora=False,
        released_names=_SIGLIP,
    ),
    Family(
        name="internvl",
        model_types=("internvl",),
        processor=ImageOnlyInternVLProcessor,
        vision_parts=_TOWER_AND_PROJECTOR,
        vision_keys=("pixel_values",),
    ),
    Family(
        name="gemma3",
        model_types=("gemma3",),
        processor=ImageOnlyGemma3Processor,
        vision_parts=_TOWER_AND_PROJECTOR,
        vision_keys=("pixel_values",),
        token_types="token_type_ids",
        nested_images=True,
        slot_on_tokenizer=True,
        released_names=_SIGLIP,
    ),
    Family(
        name="idefics3",
        model_types=("idefics3",),
        processor=ImageOnlyIdefics3Processor,
        vision_parts=("vision_model", "connector"),
        vision_keys=("pixel_values", "pixel_attention_mask"),
        prompt_dim_keys=("pixel_values", "pixel_attention_mask"),
    ),
)

_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
IMAGE_ONLY_PROCESSORS = {t: f.processor for t, f in _BY_TYPE.items()}  # model_type -> processor class
# Every family's vision module names, as PEFT matches module names (LoRA leaves them out).
VISION_PARTS = rf".*\b({'|'.join(sorted({p for f in FAMILIES for p in f.vision_parts}))})\b.*"
_BY_PROCESSOR = {f.processor: f for f in FAMILIES}


def family_of_type(model_type: str) -> Family | None:
    """The family of a config.json `model_type`; None if pjray has none for it."""
    return _BY_TYPE.get(model_type)


def family_of(processor: Any) -> Family | None:
    """The family of a loaded judge's processor; None for a text-only judge."""
    return _BY_PROCESSOR.get(type(processor))


def token_types(processor: Any, input_ids: Tensor) -> Tensor:
    """Per-token modality ids (0 text, 1 image, 2 video) for `input_ids` [B, T] -> [B, T] long,
    what the family's forward takes as `Family.token_types`; a learner that appends response
    tokens to a prompt rebuilds them here."""
    family = family_of(processor)
    assert family is not None, "a text-only judge takes no modality ids"
    types = torch.zeros_like(input_ids, dtype=torch.long)
    types[input_ids == family.slot_id(processor)] = 1
    video = getattr(processor, "video_token_id", None)
    if video is not None:
        types[input_ids == video] = 2
    return types
