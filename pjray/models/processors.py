"""The judges' processors: the stock transformers processors without a video processor, and a
tokenizer-only one for text-only judges.

Each processor is built from its family's PIL image processor and the tokenizer, never through
`AutoProcessor`: several stock processors require a video processor that exists only as a
torchvision class (and torchvision does not import beside the CPU torch wheel); `AutoProcessor`
on a directory whose processor it cannot build silently returns the bare tokenizer, which fails
far from the cause; and one preprocessing path feeds CPU tests and GPU runs identical pixels.
Checkpoints are saved under the stock class name, so plain `AutoProcessor` reads them elsewhere.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

from transformers import (
    AutoTokenizer,
    Gemma3Processor,
    Idefics3Processor,
    InternVLProcessor,
    LlavaOnevisionProcessor,
    Qwen2_5_VLProcessor,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

__all__ = [
    "ImageOnlyGemma3Processor",
    "ImageOnlyIdefics3Processor",
    "ImageOnlyInternVLProcessor",
    "ImageOnlyLlavaOnevisionProcessor",
    "ImageOnlyQwen2VLProcessor",
    "ImageOnlyQwen2_5_VLProcessor",
    "ImageOnlyQwen3VLProcessor",
    "TextOnlyProcessor",
]


_NOT_SETTINGS = {"self", "image_processor", "tokenizer", "video_processor", "chat_template", "args", "kwargs"}


class _ImageOnlyMixin:
    """Drops `video_processor` from the processor's signature.

    `ProcessorMixin` derives its sub-processors from the `__init__` signature, so without the
    parameter it neither builds, checks, saves nor reloads a video processor. `from_pretrained`
    loads the family's PIL image processor (`pil_image_processor`) explicitly: the auto class would
    pick the torchvision one whenever torchvision is installed, even when it cannot be imported.
    """

    pil_image_processor: type

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # A parent that still hands `video_processor=None` on to `ProcessorMixin.__init__` has it
        # zipped with `get_attributes()` (image_processor, tokenizer here) and dropped.
        super().__init__(  # type: ignore[call-arg]
            image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kwargs
        )

    @classmethod
    def _stock(cls) -> type:
        """The transformers processor this one narrows."""
        return next(c for c in cls.__mro__ if c.__module__.startswith("transformers."))

    @classmethod
    def stock_class_name(cls) -> str:
        """The name saved checkpoints carry."""
        return cls._stock().__name__

    @classmethod
    def _settings(cls) -> list[str]:
        """The stock processor's own settings (num_image_tokens, image_seq_length...): what
        `ProcessorMixin` would save and reload by `__init__`'s signature, which here has none."""
        return [n for n in inspect.signature(cls._stock().__init__).parameters if n not in _NOT_SETTINGS]

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()  # type: ignore[misc]
        for name in self._settings():
            value = getattr(self, name, None)
            if isinstance(value, (str, int, float, bool)):
                out[name] = value
        out["processor_class"] = self.stock_class_name()
        return out

    @classmethod
    def from_args_and_dict(cls, args, processor_dict: dict[str, Any], **kwargs):
        settings = {k: v for k, v in {**processor_dict, **kwargs}.items() if k in cls._settings()}
        chat_template = kwargs.get("chat_template", processor_dict.get("chat_template"))
        return cls(*args, chat_template=chat_template, **settings)

    def save_pretrained(self, save_directory, **kwargs):
        """Saved as the stock processor, plus the image processor's own preprocessor_config.json,
        which `AutoImageProcessor` and serving stacks read."""
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
        image_processor = _load_image_processor(
            cls.pil_image_processor, pretrained_model_name_or_path, processor_dict, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)
        # Order follows the `__init__` signature (image_processor, tokenizer).
        return [image_processor, tokenizer]


def _load_image_processor(
    cls: type, path: str | os.PathLike, processor_dict: dict[str, Any] | None = None, **kwargs: Any
) -> Any:
    """The PIL image processor `cls` configured from `path`: newer saves nest its settings in
    `processor_config.json`; released checkpoints keep them in `preprocessor_config.json`."""
    nested = (processor_dict or {}).get("image_processor")
    if isinstance(nested, dict):
        settings = {k: v for k, v in nested.items() if k not in ("image_processor_type", "processor_class")}
        return cls(**settings)
    return cls.from_pretrained(path, **kwargs)


class ImageOnlyQwen2VLProcessor(_ImageOnlyMixin, Qwen2VLProcessor):
    pil_image_processor = Qwen2VLImageProcessorPil


class ImageOnlyQwen2_5_VLProcessor(_ImageOnlyMixin, Qwen2_5_VLProcessor):
    pil_image_processor = Qwen2VLImageProcessorPil


class ImageOnlyQwen3VLProcessor(_ImageOnlyMixin, Qwen3VLProcessor):
    pil_image_processor = Qwen2VLImageProcessorPil


class ImageOnlyLlavaOnevisionProcessor(_ImageOnlyMixin, LlavaOnevisionProcessor):
    pil_image_processor = LlavaOnevisionImageProcessorPil


class ImageOnlyInternVLProcessor(_ImageOnlyMixin, InternVLProcessor):
    pil_image_processor = GotOcr2ImageProcessorPil


class ImageOnlyGemma3Processor(_ImageOnlyMixin, Gemma3Processor):
    pil_image_processor = Gemma3ImageProcessorPil


class ImageOnlyIdefics3Processor(_ImageOnlyMixin, Idefics3Processor):
    pil_image_processor = Idefics3ImageProcessorPil


class TextOnlyProcessor:
    """The processor interface of a text-only judge: its tokenizer, and no image tokens.

    `image_token`, `image_token_id` and `video_token_id` are None, which is how the rest of
    pjray tells a text-only judge from a VLM (`pjray.models.loading.is_text_only`).
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
