"""Blind checks (`eval.image`, `eval.blind`): the grey image, every bench's judged prompts, the
model inputs of a tiny judge, the output cache, the report, and the text-only judge's error."""

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

from pjray.config import ConfigError, load
from pjray.eval.blind import GREY, IMAGE_MODES, grey_image, judged_image
from pjray.eval.report import to_markdown, write_report
from pjray.eval.runner import JudgeRunner, cache_key, evaluate, evaluate_pass
from pjray.models.loading import image_token_count, load_processor, processor_inputs, render_chat
from pjray.models.tiny import build_tiny_judge
from pjray.types import JudgePrompt

FIXTURES = Path(__file__).parents[1] / "fixtures"
PAIR = FIXTURES / "mllm_judge" / "pair.jsonl"
SCENES = ["eval.num_items=3", "eval.image_size=64"]
BENCHES = {
    "pair": ["eval.bench=pair", f"eval.data={PAIR}"],
    "batch": ["eval.bench=batch", f"eval.data={FIXTURES / 'mllm_judge' / 'batch.jsonl'}"],
    "perceptual_bias": ["eval.bench=perceptual_bias", *SCENES],
    "mm_judgebias": ["eval.bench=mm_judgebias", *SCENES],
    "mm_judgebias_published": ["eval.bench=mm_judgebias", f"eval.data={FIXTURES / 'mm_judgebias' / 'records.jsonl'}"],
}


def _encoded(size: tuple[int, int], mode: str = "RGB", fmt: str = "PNG") -> bytes:
    """A many-coloured image of `size`, in `mode` and `fmt`."""
    img = Image.new("RGB", size)
    img.putdata([((7 * i) % 256, (3 * i) % 256, (11 * i) % 256) for i in range(size[0] * size[1])])
    buf = io.BytesIO()
    img.convert(mode).save(buf, format=fmt)
    return buf.getvalue()


def _colours(image: bytes) -> list:
    with Image.open(io.BytesIO(image)) as img:
        return [colour for _, colour in img.convert("RGB").getcolors(maxcolors=1 << 16)]


def _size(image: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(image)) as img:
        return img.size


def _recorded(cfg) -> list[JudgePrompt]:
    """Every prompt one pass of `cfg` judges, in order (the judge answers garbage)."""
    seen: list[JudgePrompt] = []

    def generate(prompts, seed):
        seen.extend(prompts)
        return ["@@"] * len(prompts)

    evaluate_pass(cfg, generate)
    return seen


# --------------------------------------------------------------------------- the grey image


@pytest.mark.parametrize(
    "size, mode, fmt",
    [((64, 64), "RGB", "PNG"), ((37, 90), "RGBA", "PNG"), ((120, 33), "L", "PNG"), ((50, 40), "RGB", "JPEG")],
)
def test_grey_image_keeps_the_size_and_has_one_colour(size, mode, fmt):
    original = _encoded(size, mode, fmt)
    grey = grey_image(original)
    assert grey[:8] == b"\x89PNG\r\n\x1a\n" and _size(grey) == size
    assert _colours(grey) == [GREY] and len(_colours(original)) > 1
    assert grey_image(grey) == grey  # deterministic: one size, one encoding


def test_judged_image_modes():
    image = _encoded((20, 10))
    assert judged_image(image, "as_is") is image
    assert _colours(judged_image(image, "grey")) == [GREY]
    assert judged_image(image, "none") is None
    assert judged_image(None, "grey") is None  # a row without an image stays without one
    with pytest.raises(ValueError, match="gray"):
        judged_image(image, "gray")


# --------------------------------------------------------------------------- every bench


@pytest.mark.parametrize("bench", list(BENCHES))
def test_blind_passes_change_only_the_images(bench):
    """grey: the same prompts (same order, same texts), each image grey and of its size; none: no
    image. The data is built from the real images in every pass (the MM-JudgeBias records too)."""
    overrides = BENCHES[bench]
    normal = _recorded(load(overrides=overrides))
    grey = _recorded(load(overrides=[*overrides, "eval.image=grey"]))
    none = _recorded(load(overrides=[*overrides, "eval.image=none"]))
    assert normal and any(p.image is not None for p in normal)
    texts = [(p.item_id, p.system, p.user) for p in normal]
    assert [(p.item_id, p.system, p.user) for p in grey] == texts
    assert [(p.item_id, p.system, p.user) for p in none] == texts
    for n, g in zip(normal, grey):
        assert (g.image is None) == (n.image is None)
        if n.image is not None:
            assert _size(g.image) == _size(n.image) and _colours(g.image) == [GREY]
    assert all(p.image is None for p in none)


def test_every_perceptual_bias_prompt_is_greyed_probes_included():
    prompts = _recorded(load(overrides=["eval.bench=perceptual_bias", *SCENES, "eval.image=grey"]))
    assert {p.protocol for p in prompts} == {"score", "vqa"}
    assert all(p.image is not None and _colours(p.image) == [GREY] for p in prompts)


# --------------------------------------------------------------------------- the model inputs


@pytest.fixture(scope="module")
def tiny_judges(tmp_path_factory):
    root = tmp_path_factory.mktemp("blind_judges")
    return {arch: build_tiny_judge(root / arch, arch=arch, seed=0) for arch in ("qwen2_vl", "qwen2")}


def test_grey_prompts_reach_the_model_with_their_image_tokens(tiny_judges):
    """A grey pass's prompt renders with its image placeholder, expands to as many image tokens
    as the original, and its pixel values hold one value per channel (a uniform image)."""
    overrides = ["eval.bench=pair", f"eval.data={PAIR}"]
    normal = _recorded(load(overrides=overrides))[0]
    grey = _recorded(load(overrides=[*overrides, "eval.image=grey"]))[0]
    processor = load_processor(tiny_judges["qwen2_vl"])
    inputs = {}
    for name, prompt in (("normal", normal), ("grey", grey)):
        text = render_chat(processor, prompt)
        assert text.count(processor.image_token) == 1
        inputs[name] = processor_inputs(processor, [text], [prompt.image])
    tokens = [int((inputs[n]["input_ids"] == processor.image_token_id).sum()) for n in ("normal", "grey")]
    assert tokens[0] == tokens[1] == image_token_count(processor, normal.image) > 0
    assert torch.equal(inputs["normal"]["input_ids"], inputs["grey"]["input_ids"])
    assert torch.equal(inputs["normal"]["image_grid_thw"], inputs["grey"]["image_grid_thw"])
    pixels = inputs["grey"]["pixel_values"]
    assert pixels.shape == inputs["normal"]["pixel_values"].shape
    assert not torch.equal(pixels, inputs["normal"]["pixel_values"])
    # Qwen-VL patches are flattened channel first: every value of a channel is grey's, normalised.
    ip = processor.image_processor
    want = torch.tensor([(g / 255 - m) / s for g, m, s in zip(GREY, ip.image_mean, ip.image_std)])
    by_channel = pixels.reshape(pixels.shape[0], 3, -1)
    assert torch.allclose(by_channel, want[None, :, None].expand_as(by_channel), atol=1e-5)


def test_no_image_prompts_reach_the_model_without_image_tokens(tiny_judges):
    prompt = _recorded(load(overrides=["eval.bench=pair", f"eval.data={PAIR}", "eval.image=none"]))[0]
    processor = load_processor(tiny_judges["qwen2_vl"])
    inputs = processor_inputs(processor, [render_chat(processor, prompt)], [prompt.image])
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == 0 and "pixel_values" not in inputs


class _Started(Exception):
    """Raised instead of starting Ray: the runner got past its checks and the cache."""


def _runner(monkeypatch, judge: str, overrides=(), cache=None) -> JudgeRunner:
    runner = JudgeRunner(load(overrides=[f"eval.judge={judge}", *overrides]), cache)

    def start():
        raise _Started

    monkeypatch.setattr(runner, "start", start)
    return runner


def test_a_text_only_judge_shown_images_names_eval_image(tiny_judges, monkeypatch):
    prompts = _recorded(load(overrides=["eval.bench=pair", f"eval.data={PAIR}"]))
    runner = _runner(monkeypatch, str(tiny_judges["qwen2"]), ["eval.blind=[grey]"], cache=None)
    with pytest.raises(
        ConfigError, match=r"eval\.image=as_is, eval\.blind=\['grey'\]: .* text-only .* eval\.image=none"
    ):
        runner.generate(prompts, 0)
    blind = [replace(p, image=None) for p in prompts]
    with pytest.raises(_Started):  # no image: the text-only judge takes it
        runner.generate(blind, 0)
    with pytest.raises(_Started):  # a VLM judge takes images
        _runner(monkeypatch, str(tiny_judges["qwen2_vl"])).generate(prompts, 0)


# --------------------------------------------------------------------------- the cache


def test_cache_never_mixes_blind_and_normal_outputs(tmp_path, monkeypatch):
    overrides = ["eval.bench=pair", f"eval.data={PAIR}"]
    passes = {mode: _recorded(load(overrides=[*overrides, f"eval.image={mode}"])) for mode in ("as_is", "grey", "none")}
    runner = _runner(monkeypatch, "owner/judge", cache=tmp_path / "cache.jsonl")
    keys = {mode: [cache_key(p, runner.fingerprint, 0, runner.sampling) for p in ps] for mode, ps in passes.items()}
    assert len({k for ks in keys.values() for k in ks}) == 3 * len(passes["as_is"])
    # Every normal output cached: the normal pass is served from the cache, a blind one is not.
    runner.cache.put_many(
        [{"key": k, "item_id": "", "seed": 0, "text": "normal", "finish_reason": "stop"} for k in keys["as_is"]]
    )
    runner.judge_takes_images = True  # a VLM judge ("owner/judge" is not loaded)
    assert runner.generate(passes["as_is"], 0) == ["normal"] * len(passes["as_is"])
    for mode in ("grey", "none"):
        with pytest.raises(_Started):
            runner.generate(passes[mode], 0)


# --------------------------------------------------------------------------- the report


def _sighted_pair_judge(prompts, seed):
    """Right on the pair fixture (pair-0: A, pair-1: B) when it sees the image; with a grey one
    it always says A."""
    out = []
    for p in prompts:
        blind = p.image is None or _colours(p.image) == [GREY]
        b_wins = p.item_id == "pair-1" and not blind
        low, high = (2, 8) if b_wins else (8, 2)
        out.append(f"x</think><answer>{low}</answer><answer>{high}</answer>")
    return out


def test_report_puts_the_blind_numbers_beside_the_normal_ones(tmp_path):
    cfg = load(overrides=["eval.bench=pair", f"eval.data={PAIR}", "eval.blind=[grey]"])
    report = evaluate(cfg, _sighted_pair_judge)
    assert report.tables["acc_without_tie"]["overall"].value == 1.0  # pair-0 and pair-1 right
    blind = report.blind["grey"]
    assert blind.tables["acc_without_tie"]["overall"].value == 0.5  # pair-1 wrong
    assert blind.outputs == report.outputs == 3 and blind.unparsed == 0
    assert report.flat_metrics()["eval/blind/grey/acc_without_tie/overall"] == 0.5
    assert report.flat_metrics()["eval/acc_without_tie/overall"] == 1.0

    paths = write_report(report, tmp_path, plots=False)
    data = json.loads(paths["json"].read_text())
    assert data["blind"]["grey"]["tables"]["acc_without_tie"]["overall"]["value"] == 0.5
    assert data["tables"]["acc_without_tie"]["overall"]["value"] == 1.0
    md = paths["markdown"].read_text()
    assert "| | acc_with_tie | acc_with_tie [grey] | acc_without_tie | acc_without_tie [grey] | n | unparsed |" in md
    assert "| overall | 0.667 | 0.333 | 1.000 | 0.500 |" in md
    assert "- blind pass [grey]: judge outputs 3, unparseable: 0 (0.0%)" in md
    assert "blind pass [grey] (eval.blind): every image the judge saw was a uniform grey image" in md


def test_no_blind_pass_leaves_the_report_as_it_was():
    report = evaluate(load(overrides=["eval.bench=pair", f"eval.data={PAIR}"]), _sighted_pair_judge)
    assert report.blind == {} and not any("blind" in k for k in report.flat_metrics())
    assert "[grey]" not in to_markdown(report) and not any("eval.image" in n for n in report.notes)


def test_a_main_pass_without_images_says_so():
    report = evaluate(
        load(overrides=["eval.bench=mm_judgebias", *SCENES, "eval.image=none"]), lambda ps, seed: ["5"] * len(ps)
    )
    assert any(
        n.startswith("eval.image=none: the judge saw no image") and "unnecessary_image compare identical inputs" in n
        for n in report.notes
    )


# --------------------------------------------------------------------------- the config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["eval.image=gray"], r"eval\.image='gray': expected one of as_is, grey, none"),
        (["eval.blind=[as_is]"], r"eval\.blind=\['as_is'\]: 'as_is' is not a blind mode"),
        (["eval.blind=[grey,grey]"], r"eval\.blind=\['grey', 'grey'\]: each mode once"),
        (["eval.image=none", "eval.blind=[none]"], r"eval\.blind=\['none'\]: each mode once, and not eval\.image=none"),
    ],
)
def test_image_keys_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(overrides=overrides)


def test_image_defaults_judge_the_image_once():
    e = load().eval
    assert (e.image, e.blind) == ("as_is", [])
    assert [load(overrides=[f"eval.image={mode}"]).eval.image for mode in IMAGE_MODES] == list(IMAGE_MODES)
    assert load(overrides=["eval.image=none", "eval.blind=[grey]"]).eval.blind == ["grey"]
