"""Tiny VLM judges: build, load, forward, generate, train, save/reload, processor and prompt text."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from safetensors.torch import load_file

from pjray.data.images import decode_image
from pjray.models.families import token_types
from pjray.models.loading import (
    image_token_count,
    load_judge,
    load_processor,
    opens_think,
    processor_inputs,
    render_chat,
)
from pjray.models.tiny import TINY_ARCHS, build_tiny_judge
from pjray.types import JudgePrompt
from tests.support.prompts import batch_prompt


def _png(size: tuple[int, int] = (96, 80), colour: tuple[int, int, int] = (200, 30, 30), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, colour if mode == "RGB" else 128).save(buf, format="PNG")
    return buf.getvalue()


def _prompt(image: bytes | None) -> JudgePrompt:
    return batch_prompt(
        "item-0",
        "You are a careful judge. Look at the image first.",
        "Question: what colour is the circle?\nA: red\nB: blue\nC: green\nRank the answers.",
        image,
    )


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny judge per arch, built once for the whole session."""
    root = tmp_path_factory.mktemp("tiny_judges")
    return {arch: build_tiny_judge(root / arch, arch=arch, seed=0) for arch in TINY_ARCHS}


@pytest.fixture(params=TINY_ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


def _inputs(processor, image: bytes, padding_side: str = "right") -> dict:
    text = render_chat(processor, _prompt(image))
    return processor_inputs(processor, [text], [image], padding_side=padding_side)


# ------------------------------------------------------------------------------ model


def test_directory_has_hf_files(tiny_dirs: dict[str, Path], arch: str) -> None:
    names = {p.name for p in tiny_dirs[arch].iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json"} <= names
    assert "generation_config.json" in names and "chat_template.jinja" in names


def test_forward_logits_shape(tiny_dirs: dict[str, Path], arch: str) -> None:
    model, processor = load_judge(tiny_dirs[arch], trainable=False)
    inputs = _inputs(processor, _png())
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()


def test_generate_with_image(tiny_dirs: dict[str, Path], arch: str) -> None:
    model, processor = load_judge(tiny_dirs[arch], trainable=False)
    inputs = _inputs(processor, _png(), padding_side="left")
    prompt_len = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape == (1, prompt_len + 8)
    assert torch.equal(out[:, :prompt_len], inputs["input_ids"])


def test_train_step_changes_weights(tiny_dirs: dict[str, Path], arch: str) -> None:
    model, processor = load_judge(tiny_dirs[arch], trainable=True)
    assert model.training and all(p.requires_grad for p in model.parameters())
    inputs = _inputs(processor, _png())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    # The image must be part of the graph: the vision tower receives gradient.
    vision_grads = [p.grad for n, p in model.named_parameters() if "visual" in n and p.grad is not None]
    assert vision_grads and any(g.abs().sum() > 0 for g in vision_grads)
    optim.step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(changed) > len(before) // 2


def test_eval_copy_is_frozen(tiny_dirs: dict[str, Path]) -> None:
    model, _ = load_judge(tiny_dirs["qwen2_vl"], trainable=False, dtype="bfloat16")
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.bfloat16


def test_save_and_reload_gives_identical_logits(tiny_dirs: dict[str, Path], arch: str, tmp_path: Path) -> None:
    model, processor = load_judge(tiny_dirs[arch], trainable=False)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    reloaded, reprocessor = load_judge(tmp_path, trainable=False)
    assert type(reprocessor) is type(processor)
    inputs = _inputs(processor, _png())
    inputs_again = _inputs(reprocessor, _png())
    for key in ("input_ids", "pixel_values", "image_grid_thw"):
        assert torch.equal(inputs[key], inputs_again[key])
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reloaded(**inputs_again).logits)


@pytest.mark.parametrize("vision_arch", [a for a in TINY_ARCHS if a != "qwen2"])
def test_an_export_loads_with_plain_transformers(tiny_dirs: dict[str, Path], vision_arch: str, tmp_path: Path) -> None:
    """What `LearnerRank.save_hf` and `pjray sft` write (model + processor save_pretrained) is a
    checkpoint plain transformers loads: the stock processor class, the image processor's own
    config, and the model through AutoModelForImageTextToText, giving the same logits."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    model, processor = load_judge(tiny_dirs[vision_arch], trainable=False)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    stock = processor.stock_class_name()
    assert stock.endswith("Processor") and not stock.startswith("ImageOnly")
    for name in ("processor_config.json", "tokenizer_config.json"):
        assert json.loads((tmp_path / name).read_text())["processor_class"] == stock, name
    assert (tmp_path / "preprocessor_config.json").is_file()
    try:
        import torchvision  # noqa: F401
    except ImportError:
        # Stock Qwen-VL processors need a torchvision video processor: AutoProcessor must get as
        # far as the stock class and say so, never fall back to the bare tokenizer.
        with pytest.raises(ImportError, match="[Tt]orchvision"):
            AutoProcessor.from_pretrained(tmp_path)
    else:
        assert type(AutoProcessor.from_pretrained(tmp_path)).__name__ == stock
    image_processor = AutoImageProcessor.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    ours = _inputs(processor, _png())
    plain = image_processor(images=[decode_image(_png())], return_tensors="pt")
    assert torch.equal(plain["pixel_values"], ours["pixel_values"])
    assert torch.equal(plain["image_grid_thw"], ours["image_grid_thw"])
    plain_model = AutoModelForImageTextToText.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(plain_model(**ours).logits, model(**ours).logits)
    assert type(load_processor(tmp_path)) is type(processor)  # pjray reads the stock name back


def test_same_seed_same_weights_other_seed_differs(arch: str, tmp_path: Path) -> None:
    a = load_file(build_tiny_judge(tmp_path / "a", arch=arch, seed=3) / "model.safetensors")
    b = load_file(build_tiny_judge(tmp_path / "b", arch=arch, seed=3) / "model.safetensors")
    c = load_file(build_tiny_judge(tmp_path / "c", arch=arch, seed=4) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    tok = [(tmp_path / d / "tokenizer.json").read_bytes() for d in "abc"]
    assert tok[0] == tok[1] == tok[2]


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_judge(tmp_path, arch="qwen2_vl", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_arch_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llava"):
        build_tiny_judge(tmp_path, arch="llava")


def test_unsupported_model_type_names_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="llama"):
        load_processor(tmp_path)


# ------------------------------------------------------------------------------ tokenizer


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=80))
def test_tokenizer_round_trips_text(tiny_dirs: dict[str, Path], text: str) -> None:
    tok = load_processor(tiny_dirs["qwen2_vl"]).tokenizer
    assert tok.decode(tok(text)["input_ids"]) == text


def test_tokenizer_special_and_tag_tokens(tiny_dirs: dict[str, Path]) -> None:
    tok = load_processor(tiny_dirs["qwen3_vl"]).tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for t in ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|image_pad|>", "<|vision_start|>"):
        assert len(tok(t)["input_ids"]) == 1, t
    # Tags are not special: they survive the decoding the reward parser sees.
    ids = tok("<|im_start|>assistant\n<think>\nred\n</think>\n<answer>A > B > C</answer><|im_end|>")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nred\n</think>\n<answer>A > B > C</answer>"
    # Judge-like text encodes compactly (the corpus taught the merges).
    assert len(tok("<answer>A > B > C</answer>")["input_ids"]) <= 7


# ------------------------------------------------------------------------------ prompt text and processor


def test_render_chat_layout(tiny_dirs: dict[str, Path]) -> None:
    processor = load_processor(tiny_dirs["qwen2_vl"])
    prompt = _prompt(_png())
    text = render_chat(processor, prompt)
    assert text.startswith("<|im_start|>system\n" + prompt.system + "<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert text.count("<|image_pad|>") == 1
    assert "<|vision_start|><|image_pad|><|vision_end|>" + prompt.user in text
    plain = render_chat(processor, replace(prompt, image=None), think_prefix=False)
    assert plain.endswith("<|im_start|>assistant\n")
    assert "<|vision_start|>" not in plain and "<|image_pad|>" not in plain


def test_render_chat_does_not_double_think_of_thinking_templates(tiny_dirs: dict[str, Path]) -> None:
    processor = load_processor(tiny_dirs["qwen2_vl"])
    # Thinking checkpoints open <think> in their generation prompt themselves.
    processor.chat_template = processor.chat_template.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"
    )
    text = render_chat(processor, _prompt(None))
    assert text.endswith("assistant\n<think>\n") and text.count("<think>") == 1


def test_think_prefill_is_read_from_the_rendered_prompt(tiny_dirs: dict[str, Path]) -> None:
    """model.think_prefix=false does not mean the response opens <think>: a thinking template
    opens it in the prompt, and the reward must not then demand it in the response."""
    processor = load_processor(tiny_dirs["qwen2_vl"])
    assert opens_think(render_chat(processor, _prompt(None), think_prefix=True))
    assert not opens_think(render_chat(processor, _prompt(None), think_prefix=False))
    processor.chat_template = processor.chat_template.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"
    )
    assert opens_think(render_chat(processor, _prompt(None), think_prefix=False))
    assert not opens_think("<|im_start|>assistant\n<think>\nI see</think>\n")


@pytest.mark.parametrize("size", [(64, 64), (100, 80), (128, 128), (300, 40)])
def test_placeholder_expands_to_image_token_count(tiny_dirs: dict[str, Path], arch: str, size) -> None:
    processor = load_processor(tiny_dirs[arch])
    image = _png(size)
    n = image_token_count(processor, image)
    assert 1 <= n <= 16  # the tiny image processor keeps images to a few dozen patches
    inputs = _inputs(processor, image)
    ids = inputs["input_ids"][0]
    assert int((ids == processor.image_token_id).sum()) == n
    grid = inputs["image_grid_thw"]
    assert grid.shape == (1, 3) and inputs["pixel_values"].shape[0] == int(grid.prod())
    assert torch.equal(inputs["mm_token_type_ids"], token_types(processor, inputs["input_ids"]))


def test_processor_inputs_mixed_batch(tiny_dirs: dict[str, Path]) -> None:
    model, processor = load_judge(tiny_dirs["qwen2_5_vl"], trainable=False)
    big, small = _png((128, 128)), _png((64, 64))
    texts = [
        render_chat(processor, _prompt(big)),
        render_chat(processor, _prompt(None)),
        render_chat(processor, _prompt(small)),
    ]
    images = [big, None, small]
    inputs = processor_inputs(processor, texts, images, padding_side="left")
    counts = (inputs["input_ids"] == processor.image_token_id).sum(1).tolist()
    assert counts == [image_token_count(processor, big), 0, image_token_count(processor, small)]
    assert inputs["image_grid_thw"].shape == (2, 3)
    assert inputs["pixel_values"].shape[0] == int(inputs["image_grid_thw"].prod(-1).sum())
    # Left padding: the shortest row (no image) starts with pad.
    assert inputs["attention_mask"][1, 0] == 0 and inputs["attention_mask"][:, -1].all()
    with torch.no_grad():
        assert model(**inputs).logits.shape[:2] == inputs["input_ids"].shape


def test_processor_inputs_text_only_batch(tiny_dirs: dict[str, Path]) -> None:
    model, processor = load_judge(tiny_dirs["qwen3_vl"], trainable=False)
    inputs = processor_inputs(processor, [render_chat(processor, _prompt(None))], [None])
    assert "pixel_values" not in inputs and "image_grid_thw" not in inputs
    with torch.no_grad():
        assert model(**inputs).logits.shape[1] == inputs["input_ids"].shape[1]


def test_processor_inputs_rejects_placeholder_mismatch(tiny_dirs: dict[str, Path]) -> None:
    processor = load_processor(tiny_dirs["qwen2_vl"])
    text = render_chat(processor, _prompt(_png()))
    with pytest.raises(ValueError, match="row 0"):
        processor_inputs(processor, [text], [None])
    with pytest.raises(ValueError, match="texts"):
        processor_inputs(processor, [text], [])


# ------------------------------------------------------------------------------ images


def test_decode_image_converts_to_rgb() -> None:
    img = decode_image(_png((20, 10), mode="L"))
    assert img.mode == "RGB" and img.size == (20, 10)


@pytest.mark.parametrize("data", [b"not an image at all", b"", _png()[:40]])
def test_decode_image_rejects_corrupt_bytes(data: bytes) -> None:
    with pytest.raises(ValueError, match="could not decode image"):
        decode_image(data)


# ------------------------------------------------------------------------------ torchvision


def test_build_and_load_never_import_torchvision(tmp_path: Path) -> None:
    # A fresh interpreter, so nothing earlier in the session can have imported it. Every
    # `import torchvision` statement is also intercepted and recorded, so an attempt that fails
    # because torchvision is absent here still shows up.
    script = textwrap.dedent(
        f"""
        import builtins, sys
        attempts = []
        _real_import = builtins.__import__
        def _guard(name, *args, **kwargs):
            if name == "torchvision" or name.startswith("torchvision."):
                attempts.append(name)
                raise ImportError("torchvision blocked by test")
            return _real_import(name, *args, **kwargs)
        builtins.__import__ = _guard

        import io, torch
        from PIL import Image
        from pjray.models.tiny import TINY_ARCHS, build_tiny_judge
        from pjray.models.loading import load_judge, processor_inputs, render_chat
        from pjray.types import JudgePrompt

        buf = io.BytesIO(); Image.new("RGB", (64, 64), (1, 2, 3)).save(buf, format="PNG")
        prompt = JudgePrompt("i", "sys", "user", buf.getvalue(), "batch", "ranking", 3, (0, 1, 2), "ABC")
        for arch in TINY_ARCHS:
            path = build_tiny_judge({str(tmp_path)!r} + "/" + arch, arch=arch)
            model, processor = load_judge(path, trainable=False)
            inputs = processor_inputs(processor, [render_chat(processor, prompt)], [prompt.image])
            model.generate(**inputs, max_new_tokens=2)
        assert not attempts, attempts
        assert "torchvision" not in sys.modules
        print("ok")
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
