"""Load a judge (model + processor) from a local HF directory or a hub id, one path for both.

The same functions serve the tiny random judges built by `pjray.models.tiny` and real
checkpoints such as `Qwen/Qwen3-VL-4B-Thinking`. What differs between vision-language families
is read from `pjray.models.families`; the processors are those of `pjray.models.processors`.

Text-only judges (a plain causal LM such as Qwen2 or SmolLM2) load as `AutoModelForCausalLM`
with a `TextOnlyProcessor`: the tokenizer behind the same interface, with no image token. Giving
such a judge an image is an error, never a silent drop.

Prompt text and model inputs are kept apart on purpose (see DESIGN "Known traps"):
`render_chat` returns the raw chat text with ONE un-expanded image placeholder per image, which
is what vLLM wants next to `multi_modal_data`; `processor_inputs` expands each placeholder into
the image's tokens for the HF model (trainer and CPU rollouts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import PIL.Image
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PreTrainedModel,
)
from transformers.image_utils import SizeDict
from transformers.processing_utils import ProcessorMixin

from pjray.config import ImageBudget
from pjray.data.images import decode_image
from pjray.errors import InputError
from pjray.models.families import FAMILIES, family_of, family_of_type, token_types
from pjray.models.processors import TextOnlyProcessor
from pjray.types import JudgePrompt

__all__ = [
    "ModelError",
    "save_judge",
    "ban_tokens",
    "truncate_logits",
    "image_token_count",
    "is_text_only",
    "load_judge",
    "load_processor",
    "opens_think",
    "placeholder_ids",
    "processor_inputs",
    "render_chat",
]

THINK_PREFIX = "<think>\n"


class ModelError(InputError):
    """A judge checkpoint pjray cannot use; the message names its path."""

    what = "bad model"


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------
# Processors
# --------------------------------------------------------------------------------------------


def is_text_only(processor: Any) -> bool:
    """True for a text-only judge's processor (no image placeholder token)."""
    return getattr(processor, "image_token", None) is None


def placeholder_ids(processor: Any) -> tuple[int, ...]:
    """The image and video placeholder ids: never sampled, so every engine and the learner take
    them out of the distribution (`ban_tokens`); () for a text-only judge."""
    ids = {getattr(processor, a, None) for a in ("image_token_id", "video_token_id")}
    family = family_of(processor)
    if family is not None:
        ids.add(family.slot_id(processor))
    return tuple(sorted(i for i in ids if i is not None))


def ban_tokens(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`logits` (in place) with the vocabulary entries `ids` at the dtype's lowest finite value:
    zero probability after a softmax, while entropies and log-probs of the other tokens stay
    finite (an -inf logit makes softmax * logit NaN). The learner's side of the placeholder ban
    that every rollout engine applies when it samples."""
    if ids.numel():
        logits.index_fill_(-1, ids.to(logits.device), torch.finfo(logits.dtype).min)
    return logits


def truncate_logits(
    logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """`logits` [..., V] (in place) with the entries outside the top `top_k` (0: off), then
    outside the top-`top_p` nucleus (1.0: off), at the dtype's lowest finite value: the
    distribution the rollout engines sample from after temperature and the placeholder ban
    (vLLM's and HF's top-k/top-p, in that order). The nucleus is the fewest largest entries
    whose probabilities sum to at least top_p, and always the largest. `keep` [...] (long): an
    id per row that stays in whatever the cut (the learner's label: a token sampled by weights a
    step older may fall outside the current top-k, and its log-prob must stay finite)."""
    if not 0 < top_k < logits.shape[-1] and top_p >= 1.0:
        return logits
    low = torch.finfo(logits.dtype).min
    values = logits.detach()
    cut = torch.zeros_like(values, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        cut |= values < torch.topk(values, top_k, dim=-1).values[..., -1:]
    if top_p < 1.0:
        ascending, order = torch.sort(values.masked_fill(cut, low), dim=-1)
        tail = ascending.float().softmax(-1).cumsum(-1) <= 1 - top_p
        tail[..., -1] = False
        cut |= tail.scatter(-1, order, tail)
    if keep is not None:
        cut.scatter_(-1, keep.unsqueeze(-1), False)
    return logits.masked_fill_(cut, low)


def _config_dict(path: str | os.PathLike) -> dict[str, Any]:
    local_config = Path(path) / "config.json"
    if local_config.is_file():
        # A local dir: read the json directly, no need to build a config object.
        return json.loads(local_config.read_text())
    return AutoConfig.from_pretrained(str(path)).to_dict()


def _model_type(path: str | os.PathLike) -> str:
    return _config_dict(path)["model_type"]


def _has_vision(path: str | os.PathLike) -> bool:
    """Whether the checkpoint at `path` has a vision part (else it is a text-only judge)."""
    config = _config_dict(path)
    return family_of_type(config["model_type"]) is not None or "vision_config" in config


def load_processor(path: str | os.PathLike, budget: ImageBudget = ImageBudget()) -> ProcessorMixin:
    """The image-only processor of the judge at `path` (local dir or hub id), its images resized
    within `budget` (`ModelConfig.image_budget`; by default the checkpoint's own) where its family
    sizes images by pixel count (Qwen-VL).

    Has `.tokenizer`, `.image_processor`, and `__call__(text=..., images=...)` returning the
    family's model inputs (`pjray.models.families`). A checkpoint without a vision part gets a
    `TextOnlyProcessor` (tokenizer only).
    """
    if not _has_vision(path):
        try:
            processor: Any = TextOnlyProcessor.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise ModelError(
                f"{path}: a text-only judge (model_type {_model_type(path)!r}, no vision part) "
                f"whose tokenizer cannot be loaded: {err}"
            ) from None
        if processor.tokenizer.pad_token_id is None:
            processor.tokenizer.pad_token = processor.tokenizer.eos_token
        return processor
    model_type = _model_type(path)
    family = family_of_type(model_type)
    if family is None:
        supported = sorted(t for f in FAMILIES for t in f.model_types)
        raise ModelError(
            f"{path}: model_type {model_type!r} is not a supported judge architecture; supported: {supported}"
        )
    processor = family.processor.from_pretrained(str(path))
    tokenizer = processor.tokenizer
    if tokenizer.pad_token_id is None:
        # Batched inputs need a pad id; Qwen checkpoints pad with <|endoftext|>.
        known = "<|endoftext|>" in tokenizer.get_vocab()
        tokenizer.pad_token = "<|endoftext|>" if known else tokenizer.eos_token
    if family.pixel_budget:  # the other families cut images into their processor's fixed tiles
        size = processor.image_processor.size
        lower, upper = budget.edges(size.shortest_edge, size.longest_edge)
        processor.image_processor.size = SizeDict(shortest_edge=lower, longest_edge=upper)
    return processor


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def load_judge(
    path: str | os.PathLike,
    dtype: str = "float32",
    device: str | torch.device | None = "cpu",
    trainable: bool = True,
    attn_implementation: str | None = None,
    budget: ImageBudget = ImageBudget(),
) -> tuple[PreTrainedModel, ProcessorMixin]:
    """Load the judge at `path` as `(model, processor)`.

    `trainable=False` puts the model in eval mode with gradients off (reference / rollout copy).
    `device=None` leaves the weights where `from_pretrained` put them (a ZeRO-3 partitioned load).
    `attn_implementation` is passed through ("sdpa", "flash_attention_2", ...); None = default.
    `budget`: the processor's image budget (`load_processor`).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    processor = load_processor(path, budget)
    kwargs: dict[str, Any] = {"dtype": _DTYPES[dtype]}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    # AutoModelForImageTextToText maps qwen2_vl, qwen2_5_vl, qwen3_vl (and _moe) to their
    # *ForConditionalGeneration classes in transformers 5.x; text-only judges are causal LMs.
    auto_cls = AutoModelForCausalLM if is_text_only(processor) else AutoModelForImageTextToText
    try:
        model = auto_cls.from_pretrained(str(path), **kwargs)
    except OSError as err:  # transformers' word for missing or unreadable checkpoint files
        raise ModelError(f"{path}: cannot load the model: {str(err).splitlines()[0]}") from err
    if device is not None:
        model.to(device)
    model.train(trainable)
    model.requires_grad_(trainable)
    return model, processor


def save_judge(
    model: PreTrainedModel, path: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """`model.save_pretrained(path)` (weights and config; `state_dict` instead of the model's
    own), its weights under the names released checkpoints of its family carry
    (`Family.released_names`), which vLLM loads and transformers reads back."""
    model.save_pretrained(str(path), state_dict=state_dict)
    family = family_of_type(model.config.model_type)
    if family is None or not family.released_names:
        return
    from safetensors.torch import load_file, save_file

    for file in Path(path).glob("*.safetensors"):
        weights = load_file(str(file))
        save_file({family.released_name(k): v for k, v in weights.items()}, str(file), metadata={"format": "pt"})
    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():
        table = json.loads(index.read_text())
        table["weight_map"] = {family.released_name(k): v for k, v in table["weight_map"].items()}
        index.write_text(json.dumps(table, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Prompts and inputs
# --------------------------------------------------------------------------------------------


def _chat_template(processor: ProcessorMixin) -> str:
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise ValueError("the processor has no chat template (neither processor- nor tokenizer-level)")
    return template


def render_chat(processor: ProcessorMixin, prompt: JudgePrompt, think_prefix: bool = True) -> str:
    """The judge's prompt text: system + user turn + generation prompt (+ "<think>\\n"), then
    the prompt's `prefill`, the start of a response written for the judge.

    When `prompt.image` is set, the user turn starts with ONE un-expanded image placeholder
    (`<|vision_start|><|image_pad|><|vision_end|>` for Qwen). Thinking checkpoints whose template
    already opens `<think>` in the generation prompt do not get a second one. A text-only judge
    given an image prompt raises ValueError: dropping the image would change the task.
    """
    if prompt.image is not None and is_text_only(processor):
        raise ValueError(
            f"prompt {prompt.item_id!r} has an image but the judge is text-only; "
            "drop the images from the prompts (data.images=false) or use a VLM judge"
        )
    user_content: list[dict[str, Any]] = []
    if prompt.image is not None:
        user_content.append({"type": "image"})
    user_content.append({"type": "text", "text": prompt.user})
    messages: list[dict[str, Any]] = []
    if prompt.system:
        # Qwen templates take a plain string; others (Idefics3's) only content parts.
        family = family_of(processor)
        parts = family is not None and family.system_parts
        messages.append(
            {"role": "system", "content": [{"type": "text", "text": prompt.system}] if parts else prompt.system}
        )
    messages.append({"role": "user", "content": user_content})
    text = processor.tokenizer.apply_chat_template(
        messages, chat_template=_chat_template(processor), tokenize=False, add_generation_prompt=True
    )
    if not isinstance(text, str):
        raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
    if think_prefix and not opens_think(text):
        text += THINK_PREFIX
    return text + prompt.prefill


def opens_think(prompt_text: str) -> bool:
    """Whether a rendered prompt already opened the reasoning block (it ends in `<think>`, from
    `think_prefix` or from a thinking checkpoint's own template): the response then must not
    open it again."""
    return prompt_text.rstrip().endswith("<think>")


def _as_image(image: bytes | PIL.Image.Image) -> PIL.Image.Image:
    return image.convert("RGB") if isinstance(image, PIL.Image.Image) else decode_image(image)


def image_token_count(processor: ProcessorMixin, image: bytes | PIL.Image.Image) -> int:
    """How many image-feature slots one image expands to in a prompt."""
    family = family_of(processor)
    assert family is not None, "a text-only judge takes no images"
    ids = processor_inputs(processor, [processor.image_token], [image])["input_ids"]
    return int((ids == family.slot_id(processor)).sum())


def prompt_positions(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids of a left-padded batch of prompts, and the position after each prompt.

    `inputs` holds input_ids and attention_mask [U, P], and for a Qwen-VL judge mm_token_type_ids
    (and image_grid_thw when a row has an image). A Qwen-VL judge gets the model's own M-RoPE
    positions [3, U, P] from `get_rope_index`, and text that follows a prompt continues on all
    three axes from its largest position + 1; a causal LM counts 0, 1, ... over the real tokens.
    A forward over prompts with these positions, then over their continuations with explicit
    positions from the returned [U], sees what one forward over prompt + continuation sees.
    """
    mask = inputs["attention_mask"]
    length = mask.sum(-1)
    rope = next((m for m in model.modules() if hasattr(m, "get_rope_index")), None)
    if inputs.get("mm_token_type_ids") is not None and rope is not None:
        positions, deltas = rope.get_rope_index(
            input_ids=inputs["input_ids"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs.get("image_grid_thw"),
            attention_mask=mask,
        )
        return positions, length + deltas.reshape(-1).to(length.device)
    return (mask.cumsum(-1) - 1).clamp(min=0), length


def continued_positions(prompt_ids: torch.Tensor, start: torch.Tensor, length: int) -> torch.Tensor:
    """Position ids of `length` tokens after each of B prompts: start[b], start[b] + 1, ...,
    [B, length], or the same on every M-RoPE axis ([axes, B, length]) when `prompt_ids`, the
    prompts' own positions from `prompt_positions`, are M-RoPE ones."""
    positions = start[:, None] + torch.arange(length, device=start.device)[None, :]
    return positions[None].expand(prompt_ids.shape[0], -1, -1) if prompt_ids.dim() == 3 else positions


def processor_inputs(
    processor: ProcessorMixin,
    texts: list[str],
    images: list[bytes | PIL.Image.Image | None],
    padding_side: str = "right",
) -> dict[str, torch.Tensor]:
    """Padded model inputs for a batch of rendered prompts, images expanded into their tokens.

    `texts[i]` holds one placeholder when `images[i]` is set and none otherwise; rows with and
    without images may be mixed. Returns input_ids / attention_mask [B, T] (long), the family's
    modality ids [B, T] where its forward takes them (`Family.token_types`), and the family's
    image tensors (`Family.vision_keys`, in the processor's layout) when a row has an image. A
    text-only judge gets input_ids and attention_mask alone. `padding_side` "left" suits
    generate, "right" the learner.
    """
    if len(texts) != len(images):
        raise ValueError(f"got {len(texts)} texts but {len(images)} images (use None for no image)")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    family = family_of(processor)
    if family is None:  # a text-only judge
        if any(image is not None for image in images):
            raise ValueError("processor_inputs: the judge is text-only but an image was given")
        out = processor(text=list(texts), padding=True, padding_side=padding_side, return_tensors="pt")
        return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}
    placeholder = processor.image_token
    per_row: list[list[PIL.Image.Image]] = []
    for i, (text, image) in enumerate(zip(texts, images)):
        n = text.count(placeholder)
        expected = 0 if image is None else 1
        if n != expected:
            raise ValueError(
                f"row {i}: text has {n} {placeholder} placeholder(s) but {expected} image(s); "
                "render the text with render_chat from the same prompt"
            )
        per_row.append([] if image is None else [_as_image(image)])
    flat = [image for row in per_row for image in row]
    out = processor(
        text=list(texts),
        images=(per_row if family.nested_images else flat) if flat else None,
        padding=True,
        padding_side=padding_side,
        return_tensors="pt",
    )
    inputs = {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}
    if family.token_types is not None:
        inputs[family.token_types] = token_types(processor, out["input_ids"])
    if flat:
        keys = (*family.vision_keys, family.image_counts) if family.image_counts else family.vision_keys
        inputs.update({k: torch.as_tensor(out[k]) for k in keys if out.get(k) is not None})
    return inputs
