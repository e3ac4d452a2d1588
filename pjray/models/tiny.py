"""Tiny random Qwen-style VLM judges, built offline in about a second (tests and the CPU demo).

`build_tiny_judge` writes a complete HF directory: safetensors weights, config, generation
config, a byte-level BPE tokenizer trained in-process on a small judge-like corpus, a Qwen-VL
chat template, and an image-only processor with a PIL image processor. The directory loads
through `pjray.models.loading` exactly like a real checkpoint.

`arch="qwen2"` builds a text-only judge (Qwen2ForCausalLM, same tokenizer and chat template, no
vision tower), e.g. for the PPJD job's text LLM. Every text model has heads of 32 wide, which
vLLM's CPU attention kernels accept (they have no head_dim 16), so vLLM's CPU build serves all
four archs.

Nothing here imports torchvision or touches the network.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    PreTrainedTokenizerFast,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from pjray.models.families import IMAGE_ONLY_PROCESSORS

__all__ = [
    "TEXT_ONLY_ARCHS",
    "TINY_ARCHS",
    "TINY_VOCAB_SIZE",
    "QWEN_SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "build_tiny_judge",
    "build_tokenizer",
]

TINY_ARCHS: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # the VLM judges
TEXT_ONLY_ARCHS: tuple[str, ...] = ("qwen2",)

TINY_VOCAB_SIZE = 512

# Order fixes their ids right after the 256 byte symbols; the model config reads them back.
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Not special: they must survive `skip_special_tokens=True` decoding, since the reward parses
# them, but each should still be a single id.
_TAG_TOKENS: tuple[str, ...] = ("<think>", "</think>", "<answer>", "</answer>")

# Qwen2-VL style turns. Images render as one un-expanded placeholder; the processor expands it
# to the image's number of pad tokens. No default system turn (as in Qwen3-VL).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

_COLOURS = ("red", "green", "blue", "yellow", "orange", "purple", "black", "white", "grey", "brown", "pink")
_SHAPES = ("circle", "square", "triangle", "star", "cross", "rectangle", "ellipse", "hexagon")
_POSITIONS = ("left", "right", "top", "bottom", "center", "above", "below", "next to")


def _corpus() -> list[str]:
    """Judge-like English, deterministic, so common judge words become single tokens."""
    lines = [
        "You are a careful judge. Look at the image before you believe an answer.",
        "Rank the candidate answers from best to worst. Think step by step.",
        "Put your reasoning in <think> </think> and the final ranking in <answer> </answer>.",
        "The question asks how many objects there are. Answer A says three, answer B says two.",
        "Assistant: <think>\nThe image shows a red circle and a blue square.\n</think>\n<answer>A > B > C</answer>",
        "<think> answer A is correct, answer C misreads the colour. </think> <answer>B > A > C</answer>",
        "Score each answer from 1 to 10. Answer A: 7. Answer B: 3. Answer C: 9.",
        "Which answer is better, A or B? <answer>A</answer> <answer>B</answer> <answer>C</answer>",
        "system user assistant question image candidate ranking score better worse correct wrong",
        "perception reasoning error count colour color shape size position object objects scene",
    ]
    digits = " ".join(str(i) for i in range(20))
    for i, colour in enumerate(_COLOURS):
        shape = _SHAPES[i % len(_SHAPES)]
        pos = _POSITIONS[i % len(_POSITIONS)]
        lines.append(f"There is a {colour} {shape} on the {pos}. The {shape} is {colour}, not {_COLOURS[i - 1]}.")
        lines.append(f"Answer {'ABC'[i % 3]} counts {i + 1} {shape}s; the image shows {i + 2}.")
    for order in ("A > B > C", "A > C > B", "B > A > C", "B > C > A", "C > A > B", "C > B > A"):
        lines.append(f"<answer>{order}</answer>")
    lines.append(digits)
    # Repetition makes the frequent words win the merges over one-off fragments.
    return lines * 4


def build_tokenizer(vocab_size: int = TINY_VOCAB_SIZE, corpus: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with the Qwen special tokens and a Qwen-VL chat template.

    `corpus` adds training text to the built-in judge-like lines (a larger judge trains its
    tokenizer on its own prompts, so they take fewer tokens)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(_TAG_TOKENS),
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*_corpus(), *corpus], trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in _TAG_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    return fast


def image_processor(patch_size: int, image_size: int = 0, merge: int = 2) -> Qwen2VLImageProcessorPil:
    """PIL image processor. By default 64x64..128x128 images give 16..64 patches (4..16 tokens);
    `image_size` > 0 pins every image to that square side (rounded to whole merged tokens);
    `merge` x `merge` patches make one image token."""
    factor = patch_size * merge
    if image_size > 0:
        side = max(factor, round(image_size / factor) * factor)
        return Qwen2VLImageProcessorPil(
            patch_size=patch_size,
            merge_size=merge,
            temporal_patch_size=2,
            min_pixels=side * side,
            max_pixels=side * side,
        )
    return Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=merge,
        temporal_patch_size=2,
        min_pixels=factor * factor * 4,
        max_pixels=factor * factor * 16,
    )


def _config(arch: str, tok: PreTrainedTokenizerFast, tied: bool = False) -> Any:
    """A ~0.2M-parameter config of `arch` whose special-token ids come from `tok`; `tied`: the
    output projection is the input embedding (as Qwen3-VL-4B's)."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    text: dict[str, Any] = {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        # 2 heads of 32 (1 key-value head): vLLM's CPU attention kernels have no head_dim 16.
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        # M-RoPE (t, h, w) sections over the head's 16 frequencies.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": tied,
    }
    if arch == "qwen2":
        # A plain 1-D RoPE causal LM: the text part of the VLMs above.
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
        return AutoConfig.for_model("qwen2", **text)
    if arch == "qwen2_vl":
        vision: dict[str, Any] = {
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        }
    elif arch == "qwen2_5_vl":
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        }
    elif arch == "qwen3_vl":
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        }
        text["head_dim"] = 32
        text["rope_parameters"]["mrope_interleaved"] = True
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {TINY_ARCHS + TEXT_ONLY_ARCHS}")
    return vlm_config(arch, tok, text, vision, tied)


def vlm_config(
    arch: str, tok: PreTrainedTokenizerFast, text: dict[str, Any], vision: dict[str, Any], tied: bool = False
) -> Any:
    """A Qwen-VL config of `arch` from its text and vision parts, image/video ids from `tok`."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    return AutoConfig.for_model(
        arch,
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tied,
    )


def build_tiny_judge(out_dir: str | os.PathLike, arch: str = "qwen2_vl", seed: int = 0, tied: bool = False) -> Path:
    """Write a tiny random `arch` VLM judge as an HF directory at `out_dir`; returns its path.

    Same `seed` -> identical weights; the tokenizer does not depend on the seed. `tied`: the
    output projection shares the input embedding's tensor (tie_word_embeddings, as Qwen3-VL-4B).
    """
    if arch not in TINY_ARCHS + TEXT_ONLY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {TINY_ARCHS + TEXT_ONLY_ARCHS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer()
    config = _config(arch, tok, tied)
    # Seed right before construction: the weights are the first thing drawn from the RNG.
    # The global RNG state is restored so building a judge does not perturb the caller.
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        auto_cls = AutoModelForCausalLM if arch in TEXT_ONLY_ARCHS else AutoModelForImageTextToText
        model = auto_cls.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(rng_state)
    text_config = config if arch in TEXT_ONLY_ARCHS else config.text_config
    model.generation_config = GenerationConfig(
        bos_token_id=text_config.bos_token_id,
        eos_token_id=text_config.eos_token_id,
        pad_token_id=text_config.pad_token_id,
    )
    model.save_pretrained(out)
    if arch in TEXT_ONLY_ARCHS:
        tok.save_pretrained(out)
        return out

    patch_size = config.vision_config.patch_size
    processor = IMAGE_ONLY_PROCESSORS[arch](
        image_processor=image_processor(patch_size), tokenizer=tok, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(out)  # with the standalone preprocessor_config.json released checkpoints ship
    return out


def build_base_judge(
    out_dir: str | os.PathLike, seed: int = 0, hidden: int = 768, layers: int = 12, heads: int = 12
) -> Path:
    """A larger random Qwen2-VL judge for CPU benchmarks: by default ~114M parameters (text
    hidden 768, 12 layers), with the tiny judge's 2-layer vision tower, tokenizer and processor.
    `hidden / heads` must be 64 (the M-RoPE sections below split a 64-wide head)."""
    if hidden != 64 * heads:
        raise ValueError(f"hidden={hidden}, heads={heads}: the head width must be 64")
    path = build_tiny_judge(out_dir, arch="qwen2_vl", seed=seed)
    config = AutoConfig.from_pretrained(path)
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = hidden, 4 * hidden, layers
    text.num_attention_heads, text.num_key_value_heads = heads, heads
    text.layer_types = ["full_attention"] * text.num_hidden_layers  # sized by the tiny config
    text.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 12, 12]}
    config.vision_config.hidden_size = hidden  # the vision merger projects into the text width
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(path)
    return path
