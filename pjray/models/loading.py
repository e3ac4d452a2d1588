"""Load a judge (model + processor) from a local HF directory or a hub id, one path for both.

The same functions serve the tiny random VLMs built by `pjray.models.tiny` and real checkpoints
such as `Qwen/Qwen3-VL-4B-Thinking`. The processor is always built from the PIL image processor
and the tokenizer, never through `AutoProcessor`:

* the stock Qwen*-VL processors require a video processor, which exists only as a torchvision
  class, and torchvision does not import beside the CPU torch wheel;
* `AutoProcessor` on a directory whose processor it cannot build silently returns the bare
  tokenizer, which then fails much later, far from the cause;
* one preprocessing path means CPU tests and GPU runs feed the model identical pixel values.

Judges see images only, so the processors here carry no video processor at all.

Text-only judges (a plain causal LM such as Qwen2 or SmolLM2; vLLM's CPU build serves only
these) load as `AutoModelForCausalLM` with a `TextOnlyProcessor`: the tokenizer behind the same
interface, with no image token. Giving such a judge an image is an error, never a silent drop.

Prompt text and model inputs are kept apart on purpose (see DESIGN "Known traps"):
`render_chat` returns the raw chat text with ONE un-expanded image placeholder, which is what
vLLM wants next to `multi_modal_data`; `processor_inputs` expands the placeholder into the
per-image number of image-pad tokens for the HF model (trainer and CPU rollouts).
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
    AutoTokenizer,
    PreTrainedModel,
)
from transformers.image_utils import SizeDict
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

from pjray.config import ImageBudget
from pjray.data.images import decode_image
from pjray.errors import InputError
from pjray.types import JudgePrompt

__all__ = [
    "IMAGE_ONLY_PROCESSORS",
    "ModelError",
    "ImageOnlyQwen2VLProcessor",
    "ImageOnlyQwen2_5_VLProcessor",
    "ImageOnlyQwen3VLProcessor",
    "TextOnlyProcessor",
    "ban_tokens",
    "truncate_logits",
    "image_token_count",
    "is_text_only",
    "load_judge",
    "load_processor",
    "mm_token_type_ids",
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


class _ImageOnlyMixin:
    """Drops `video_processor` from the processor's signature.

    `ProcessorMixin` derives its sub-processors from the `__init__` signature, so without the
    parameter it neither builds, checks, saves nor reloads a video processor. `from_pretrained`
    loads the PIL image processor explicitly: the auto class would pick the torchvision one
    whenever torchvision is installed, even when it cannot be imported (the CPU machines).
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # The Qwen parent still hands `video_processor=None` on to `ProcessorMixin.__init__`
        # positionally; that one zips the arguments with `get_attributes()` (image_processor,
        # tokenizer here), so the None is dropped rather than checked or stored.
        super().__init__(  # type: ignore[call-arg]
            image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kwargs
        )

    @classmethod
    def stock_class_name(cls) -> str:
        """The transformers processor this one narrows (the next class in the MRO from
        transformers): the name saved checkpoints carry."""
        return next(c.__name__ for c in cls.__mro__ if c.__module__.startswith("transformers."))

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()  # type: ignore[misc]
        out["processor_class"] = self.stock_class_name()
        return out

    def save_pretrained(self, save_directory, **kwargs):
        """Saved as the stock processor, so that plain `AutoProcessor` builds it where torchvision
        imports (given an unknown class name it would silently return the bare tokenizer), plus
        the image processor's own preprocessor_config.json, which `AutoImageProcessor` and
        serving stacks read. pjray reloads either name (`load_processor`)."""
        files = super().save_pretrained(save_directory, **kwargs)  # type: ignore[misc]
        tokenizer_config = Path(save_directory) / "tokenizer_config.json"
        if tokenizer_config.is_file():
            config = json.loads(tokenizer_config.read_text())
            config["processor_class"] = self.stock_class_name()
            tokenizer_config.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        self.image_processor.save_pretrained(save_directory)  # type: ignore[attr-defined]
        return files

    @classmethod
    def _get_arguments_from_pretrained(cls, pretrained_model_name_or_path, processor_dict=None, **kwargs):
        kwargs.pop("subfolder", None)
        image_processor = _load_pil_image_processor(pretrained_model_name_or_path, processor_dict, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)
        # Order follows the `__init__` signature (image_processor, tokenizer).
        return [image_processor, tokenizer]


class ImageOnlyQwen2VLProcessor(_ImageOnlyMixin, Qwen2VLProcessor):
    """`Qwen2VLProcessor` without a video processor."""


class ImageOnlyQwen2_5_VLProcessor(_ImageOnlyMixin, Qwen2_5_VLProcessor):
    """`Qwen2_5_VLProcessor` without a video processor."""


class ImageOnlyQwen3VLProcessor(_ImageOnlyMixin, Qwen3VLProcessor):
    """`Qwen3VLProcessor` without a video processor."""


# model_type (config.json) -> processor class. Qwen3-VL-MoE shares the Qwen3-VL processor.
IMAGE_ONLY_PROCESSORS: dict[str, type[ProcessorMixin]] = {
    "qwen2_vl": ImageOnlyQwen2VLProcessor,
    "qwen2_5_vl": ImageOnlyQwen2_5_VLProcessor,
    "qwen3_vl": ImageOnlyQwen3VLProcessor,
    "qwen3_vl_moe": ImageOnlyQwen3VLProcessor,
}


class TextOnlyProcessor:
    """The processor interface of a text-only judge: its tokenizer, and no image tokens.

    `image_token`, `image_token_id` and `video_token_id` are None, which is how the rest of
    pjray tells a text-only judge from a VLM (`is_text_only`).
    """

    image_token: str | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs: Any) -> TextOnlyProcessor:
        return cls(AutoTokenizer.from_pretrained(str(path), **kwargs))

    def __call__(
        self,
        text: list[str],
        images: Any = None,
        padding: bool = True,
        padding_side: str = "right",
        return_tensors: str = "pt",
    ) -> Any:
        if images:
            raise ValueError("a text-only judge cannot take images")
        return self.tokenizer(text, padding=padding, padding_side=padding_side, return_tensors=return_tensors)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        self.tokenizer.save_pretrained(str(path))


def is_text_only(processor: Any) -> bool:
    """True for a text-only judge's processor (no image placeholder token)."""
    return getattr(processor, "image_token", None) is None


def placeholder_ids(processor: Any) -> tuple[int, ...]:
    """The image and video placeholder ids: never sampled, so every engine and the learner take
    them out of the distribution (`ban_tokens`); () for a text-only judge."""
    ids = {getattr(processor, a, None) for a in ("image_token_id", "video_token_id")}
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


def _load_pil_image_processor(
    path: str | os.PathLike, processor_dict: dict[str, Any] | None = None, **kwargs: Any
) -> Qwen2VLImageProcessorPil:
    """The Qwen2-VL PIL image processor (used by Qwen2-, 2.5- and 3-VL) configured from `path`.

    Newer saves nest the image processor's settings in `processor_config.json`; released
    checkpoints keep them in `preprocessor_config.json`, which `from_pretrained` reads.
    """
    nested = (processor_dict or {}).get("image_processor")
    if isinstance(nested, dict):
        settings = {k: v for k, v in nested.items() if k not in ("image_processor_type", "processor_class")}
        return Qwen2VLImageProcessorPil(**settings)
    return Qwen2VLImageProcessorPil.from_pretrained(path, **kwargs)


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
    return config["model_type"] in IMAGE_ONLY_PROCESSORS or "vision_config" in config


def load_processor(path: str | os.PathLike, budget: ImageBudget = ImageBudget()) -> ProcessorMixin:
    """The image-only processor of the judge at `path` (local dir or hub id), its images resized
    within `budget` (`ModelConfig.image_budget`; by default the checkpoint's own).

    Has `.tokenizer`, `.image_processor`, and `__call__(text=..., images=...)` returning
    input_ids, attention_mask, mm_token_type_ids, pixel_values and image_grid_thw. A checkpoint
    without a vision part gets a `TextOnlyProcessor` (tokenizer only).
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
    try:
        processor_cls = IMAGE_ONLY_PROCESSORS[model_type]
    except KeyError:
        raise ModelError(
            f"{path}: model_type {model_type!r} is not a supported judge architecture; "
            f"supported: {sorted(IMAGE_ONLY_PROCESSORS)}"
        ) from None
    processor = processor_cls.from_pretrained(str(path))
    if processor.tokenizer.pad_token_id is None:
        # Batched inputs need a pad id; Qwen checkpoints pad with <|endoftext|>.
        processor.tokenizer.pad_token = "<|endoftext|>"
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
        # A plain string: every Qwen template accepts it for the system turn.
        messages.append({"role": "system", "content": prompt.system})
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
    """How many image-pad tokens one image expands to: grid t*h*w / merge_size**2."""
    out = processor.image_processor(images=[_as_image(image)], return_tensors="pt")
    merge = processor.image_processor.merge_size
    return int(out["image_grid_thw"][0].prod().item()) // (merge * merge)


def mm_token_type_ids(processor: ProcessorMixin, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token modality ids (0 text, 1 image, 2 video) for `input_ids` [B, T] -> [B, T] long.

    transformers 5.x Qwen-VL models refuse images without this tensor (it drives M-RoPE). The
    processor returns it for a prompt; a learner that appends response tokens rebuilds it here.
    """
    types = torch.zeros_like(input_ids, dtype=torch.long)
    types[input_ids == processor.image_token_id] = 1
    types[input_ids == processor.video_token_id] = 2
    return types


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
) -> dict[str, torch.Tensor | None]:
    """Padded model inputs for a batch of rendered prompts, images expanded into pad tokens.

    `texts[i]` holds one placeholder when `images[i]` is set and none otherwise; rows with and
    without images may be mixed. Returns input_ids / attention_mask / mm_token_type_ids [B, T]
    (long), pixel_values [sum of patches, D] and image_grid_thw [n_images, 3] (both None when
    no row has an image; mm_token_type_ids too for a text-only judge). `padding_side` "left"
    suits generate, "right" the learner.
    """
    if len(texts) != len(images):
        raise ValueError(f"got {len(texts)} texts but {len(images)} images (use None for no image)")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    placeholder = processor.image_token
    if placeholder is None:  # a text-only judge
        if any(image is not None for image in images):
            raise ValueError("processor_inputs: the judge is text-only but an image was given")
        out = processor(text=list(texts), padding=True, padding_side=padding_side, return_tensors="pt")
        return {
            "input_ids": out["input_ids"],
            "attention_mask": out["attention_mask"],
            "mm_token_type_ids": None,  # a causal LM takes no modality ids
            "pixel_values": None,
            "image_grid_thw": None,
        }
    pil_images = []
    for i, (text, image) in enumerate(zip(texts, images)):
        n = text.count(placeholder)
        expected = 0 if image is None else 1
        if n != expected:
            raise ValueError(
                f"row {i}: text has {n} {placeholder} placeholder(s) but {expected} image(s); "
                "render the text with render_chat from the same prompt"
            )
        if image is not None:
            pil_images.append(_as_image(image))
    out = processor(
        text=list(texts),
        images=pil_images or None,
        padding=True,
        padding_side=padding_side,
        return_tensors="pt",
    )
    types = out.get("mm_token_type_ids")
    return {
        "input_ids": out["input_ids"],
        "attention_mask": out["attention_mask"],
        "mm_token_type_ids": (
            mm_token_type_ids(processor, out["input_ids"]) if types is None else torch.as_tensor(types).long()
        ),
        "pixel_values": out.get("pixel_values"),
        "image_grid_thw": out.get("image_grid_thw"),
    }
