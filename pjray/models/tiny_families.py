"""Tiny random judges of the non-Qwen vision-language families, built offline in about a second.

`build_tiny_family_judge` writes a complete HF directory of `llava_onevision`, `internvl`,
`gemma3` or `idefics3`: safetensors weights, config, generation config, the tiny judges'
byte-level BPE tokenizer with the family's special tokens, a chat template shaped as the
family's released one, and its image-only processor. Each text model has heads of 32 wide
(vLLM's CPU attention kernels have no head_dim 16) and each vision tower turns an image into a
handful of tokens, so the CPU tests run every layer of pjray on every family.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken
from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig, PreTrainedTokenizerFast
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)

from pjray.models.families import family_of_type
from pjray.models.loading import save_judge
from pjray.models.tiny import build_tokenizer

__all__ = ["FAMILY_ARCHS", "build_tiny_family_judge"]

FAMILY_ARCHS: tuple[str, ...] = ("llava_onevision", "internvl", "gemma3", "idefics3")

_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 4096,
}
_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def _template(turn: str, end: str, assistant: str, image: str, system_in_user: bool = False) -> str:
    """A chat template: each turn the Jinja expression `turn` (of `message`) + content + `end`, an
    image part as `image`; `assistant` opens the generation. `system_in_user`: the system text
    leads the first user turn (Gemma 3's template has no system turn)."""
    part = (
        "{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' -%}{{- '" + image + "' -}}"
        "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
        "{%- endfor -%}"
    )
    body = "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}" + part + "{%- endif -%}"
    if system_in_user:
        return (
            "{%- set ns = namespace(prefix='') -%}"
            "{%- for message in messages -%}"
            "{%- if message['role'] == 'system' -%}{%- set ns.prefix = message['content'][0]['text'] + '\\n\\n' -%}"
            "{%- else -%}{{- "
            + turn
            + " -}}{{- ns.prefix -}}{%- set ns.prefix = '' -%}"
            + body
            + "{{- '"
            + end
            + "' -}}"
            "{%- endif -%}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '" + assistant + "' -}}{%- endif -%}"
        )
    return (
        "{%- for message in messages -%}{{- " + turn + " -}}" + body + "{{- '" + end + "' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '" + assistant + "' -}}{%- endif -%}"
    )


_IM = ("'<|im_start|>' + message['role'] + '\\n'", "<|im_end|>\\n", "<|im_start|>assistant\\n")

# arch -> tokens added to the tiny tokenizer (named ones become tokenizer attributes the stock
# processor reads), EOS (None: the tiny tokenizer's own), chat template.
_TOKENS: dict[str, tuple[dict[str, str], tuple[str, ...], str | None, str]] = {
    "llava_onevision": ({}, ("<image>", "<video>"), None, _template(*_IM, "<image>\\n")),
    "internvl": (
        {
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
        (),
        None,
        _template(*_IM, "<IMG_CONTEXT>\\n"),
    ),
    "gemma3": (
        {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"},
        ("<start_of_turn>", "<end_of_turn>"),
        "<end_of_turn>",
        _template(
            "'<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n'",
            "<end_of_turn>\\n",
            "<start_of_turn>model\\n",
            "<start_of_image>",
            system_in_user=True,
        ),
    ),
    "idefics3": (
        {},
        (
            "<fake_token_around_image>",
            "<image>",
            "<end_of_utterance>",
            "<global-img>",
            *(f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)),
        ),
        "<end_of_utterance>",
        _template(
            "'<|im_start|>' + message['role'] | capitalize + ':'", "<end_of_utterance>\\n", "Assistant:", "<image>"
        ),
    ),
}


def _tokenizer(arch: str) -> PreTrainedTokenizerFast:
    named, plain, eos, template = _TOKENS[arch]
    base = build_tokenizer()
    backend = base.backend_tokenizer
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in plain])
    if arch == "gemma3":
        # Gemma's vocabulary has runs of 1-4 newlines as single tokens, which vLLM's Gemma 3
        # processor looks up around each image.
        backend.add_tokens([AddedToken("\n" * k, normalized=False, special=False) for k in (4, 3, 2, 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=eos or base.eos_token,
        pad_token="<|endoftext|>",
        extra_special_tokens=named,
        chat_template=template,
        model_max_length=4096,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def _config_and_processor(arch: str, tok: PreTrainedTokenizerFast, tied: bool) -> tuple[Any, Any]:
    """The `arch` config (special-token ids from `tok`) and its image-only processor."""
    ids = tok.convert_tokens_to_ids
    processor_cls = family_of_type(arch).processor  # type: ignore[union-attr]
    text = {**_TEXT, "vocab_size": len(tok), "tie_word_embeddings": tied, "pad_token_id": tok.pad_token_id}
    if arch == "llava_onevision":
        grid = [[28, 28], [28, 56], [56, 28], [56, 56]]
        config = AutoConfig.for_model(
            arch,
            text_config={"model_type": "qwen2", **text},
            vision_config={"model_type": "siglip_vision_model", **_VISION, "image_size": 28, "patch_size": 14},
            image_token_index=ids("<image>"),
            video_token_index=ids("<video>"),
            vision_feature_layer=-1,
            vision_feature_select_strategy="full",
            image_grid_pinpoints=grid,
            tie_word_embeddings=tied,
        )
        image_processor = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=grid)
        processor = processor_cls(
            image_processor=image_processor,
            tokenizer=tok,
            chat_template=tok.chat_template,
            num_image_tokens=4,
            vision_feature_select_strategy="full",
        )
    elif arch == "internvl":
        config = AutoConfig.for_model(
            arch,
            text_config={"model_type": "qwen2", **text},
            vision_config={**_VISION, "image_size": [28, 28], "patch_size": [14, 14]},
            image_token_id=ids("<IMG_CONTEXT>"),
            downsample_ratio=0.5,
            vision_feature_layer=-1,
            tie_word_embeddings=tied,
        )
        image_processor = GotOcr2ImageProcessorPil(
            size={"height": 28, "width": 28}, crop_to_patches=True, max_patches=4
        )
        processor = processor_cls(
            image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template, image_seq_length=1
        )
    elif arch == "gemma3":
        config = AutoConfig.for_model(
            arch,
            text_config={"model_type": "gemma3_text", **text, "sliding_window": 16},
            vision_config={"model_type": "siglip_vision_model", **_VISION, "image_size": 56, "patch_size": 14},
            image_token_index=ids("<image_soft_token>"),
            boi_token_index=ids("<start_of_image>"),
            eoi_token_index=ids("<end_of_image>"),
            mm_tokens_per_image=4,
            tie_word_embeddings=tied,
        )
        image_processor = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
        processor = processor_cls(
            image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template, image_seq_length=4
        )
    elif arch == "idefics3":
        config = AutoConfig.for_model(
            arch,
            text_config={"model_type": "llama", **text},
            vision_config={**_VISION, "image_size": 56, "patch_size": 14},
            image_token_id=ids("<image>"),
            scale_factor=2,
            pad_token_id=tok.pad_token_id,
            tie_word_embeddings=tied,
        )
        image_processor = Idefics3ImageProcessorPil(
            size={"longest_edge": 112}, max_image_size={"longest_edge": 56}, do_image_splitting=True
        )
        processor = processor_cls(
            image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template, image_seq_len=4
        )
    else:
        raise ValueError(f"unknown tiny family arch {arch!r}; choose one of {FAMILY_ARCHS}")
    return config, processor


def build_tiny_family_judge(
    out_dir: str | os.PathLike, arch: str = "llava_onevision", seed: int = 0, tied: bool = False
) -> Path:
    """Write a tiny random `arch` judge (one of `FAMILY_ARCHS`) at `out_dir`; returns its path.
    Same `seed` -> identical weights; `tied`: the output projection is the input embedding."""
    if arch not in FAMILY_ARCHS:
        raise ValueError(f"unknown tiny family arch {arch!r}; choose one of {FAMILY_ARCHS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(arch)
    config, processor = _config_and_processor(arch, tok, tied)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id)
    save_judge(model, out)
    processor.save_pretrained(out)
    return out
