"""The two views of one multimodal prompt agree, and the vLLM layouts the config accepts.

The rollout (vLLM) sees the raw chat text with one un-expanded image placeholder plus the image
as `multi_modal_data`; the learner sees the processor-expanded ids with pixel values. Both come
from the same `render_chat` text, so they must describe the same prompt: same text, and the
placeholder expands (once) to exactly `image_token_count` pad tokens. None of this needs vLLM:
`vllm_request` is the pure function that builds what vLLM receives.
"""

from __future__ import annotations

import io
import threading
import time

import PIL.Image
import pytest
import torch

from pjray.config import ConfigError, load
from pjray.models.loading import image_token_count, load_processor, processor_inputs, render_chat
from pjray.models.tiny import TINY_ARCHS, build_tiny_judge
from pjray.rl.logprobs import collate
from pjray.rollout import vllm_engine
from pjray.rollout.vllm_engine import VllmEngine, llm_kwargs, vllm_request
from pjray.types import Experience, JudgePrompt
from tests.support.prompts import batch_prompt

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _png(size: tuple[int, int], colour: str = "red") -> bytes:
    buf = io.BytesIO()
    PIL.Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _prompt(image: bytes | None) -> JudgePrompt:
    return batch_prompt("p0", "You are a careful judge.", "Rank the answers A, B, C.", image)


@pytest.fixture(scope="module", params=TINY_ARCHS)
def vlm_processor(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = build_tiny_judge(tmp_path_factory.mktemp(request.param), arch=request.param, seed=0)
    return load_processor(path)


@pytest.fixture(scope="module")
def text_processor(tmp_path_factory: pytest.TempPathFactory):
    return load_processor(build_tiny_judge(tmp_path_factory.mktemp("qwen2"), arch="qwen2", seed=0))


@pytest.mark.parametrize("size", [(64, 64), (112, 80)])
def test_vllm_and_trainer_views_of_one_prompt_agree(vlm_processor, size: tuple[int, int]) -> None:
    image = _png(size)
    prompt = _prompt(image)
    text = render_chat(vlm_processor, prompt)
    request = vllm_request(vlm_processor, prompt)

    # vLLM's view: the same raw text, one un-expanded placeholder, the decoded image beside it.
    assert set(request) == {"prompt", "multi_modal_data"}
    assert request["prompt"] == text
    assert text.count(vlm_processor.image_token) == 1
    assert text.count("<|vision_start|>") == 1
    vllm_image = request["multi_modal_data"]["image"]
    assert isinstance(vllm_image, PIL.Image.Image) and vllm_image.size == size

    # The trainer's view: the processor expands that one placeholder into the image's tokens.
    expected = image_token_count(vlm_processor, image)
    inputs = processor_inputs(vlm_processor, [text], [image])
    ids = inputs["input_ids"][0]
    assert int((ids == vlm_processor.image_token_id).sum()) == expected > 1
    assert int(inputs["image_grid_thw"].prod(-1).sum()) // vlm_processor.image_processor.merge_size**2 == expected

    # Expanding vLLM's view (text + image, as vLLM's processor does once) gives exactly the
    # trainer's prompt ids, and the learner's collate keeps them in front of the response.
    from_vllm_view = processor_inputs(vlm_processor, [request["prompt"]], [vllm_image])["input_ids"][0]
    assert torch.equal(from_vllm_view, ids)
    batch = collate(vlm_processor, [Experience(prompt_text=text, image=image, response_ids=(5, 6), advantage=1.0)])
    assert torch.equal(batch.input_ids[0, : len(ids)], ids)
    assert batch.input_ids[0, len(ids) :].tolist() == [5, 6]


def test_expanded_text_cannot_be_a_prompt(vlm_processor) -> None:
    """The double-expansion bug needs expanded ids (or text) next to the image: every entry
    point that pairs a text with an image insists on exactly one placeholder."""
    image = _png((64, 64))
    text = render_chat(vlm_processor, _prompt(image))
    n = image_token_count(vlm_processor, image)
    expanded = text.replace(vlm_processor.image_token, vlm_processor.image_token * n)
    with pytest.raises(ValueError, match="placeholder"):
        processor_inputs(vlm_processor, [expanded], [image])


def test_text_only_prompt_has_no_multimodal_data(vlm_processor, text_processor) -> None:
    request = vllm_request(vlm_processor, _prompt(None))
    assert set(request) == {"prompt"} and vlm_processor.image_token not in request["prompt"]
    text_request = vllm_request(text_processor, _prompt(None))
    assert set(text_request) == {"prompt"}
    # A text-only judge never silently drops an image.
    with pytest.raises(ValueError, match="text-only"):
        vllm_request(text_processor, _prompt(_png((64, 64))))


# ---------------------------------------------------------------------------------------------
# The vLLM / GPU layouts the config accepts and rejects (pure validation, no cluster needed)
# ---------------------------------------------------------------------------------------------

VLLM_CPU = [
    "model.init=tiny",
    "rollout.backend=vllm",
    "rollout.device=cpu",
    "model.tiny_arch=qwen2",
    "data.images=false",
]
SPLIT = [
    "rollout.backend=vllm",
    "rollout.num_gpus_per_worker=1",
    "learner.num_gpus_per_rank=1",
    "learner.num_ranks=2",
    "rollout.num_workers=2",
    "learner.micro_batch_size=2",
]
COLOCATED = SPLIT[:-1] + [
    "learner.micro_batch_size=2",
    "rollout.colocate=true",
    "learner.num_gpus_per_rank=0.5",
    "rollout.num_gpus_per_worker=0.4",
    "trainer.sync_backend=ipc",
]


def test_good_layouts_load() -> None:
    assert load(overrides=VLLM_CPU + ["trainer.sync_backend=gloo"]).rollout.device == "cpu"
    # vLLM's CPU build serves the vision judges too: the base judge and every tiny VL arch.
    assert load(overrides=VLLM_CPU[1:3]).model.init == "one_disposition"
    assert load(overrides=VLLM_CPU[:3] + ["model.tiny_arch=qwen3_vl"]).data.images
    assert load(overrides=SPLIT + ["trainer.sync_backend=nccl", "ray.num_gpus=4"]).trainer.sync_backend == "nccl"
    assert load(overrides=COLOCATED + ["ray.num_gpus=2"]).rollout.colocate


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["rollout.backend=vllm"], "rollout.num_gpus_per_worker"),
        (VLLM_CPU[:4], "data.images"),
        (VLLM_CPU + ["rollout.num_gpus_per_worker=1"], "rollout.device=cpu"),
        (VLLM_CPU + ["rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size"),
        (["rollout.backend=hf", "rollout.device=cuda"], "rollout.device=cuda"),
        (["rollout.device=tpu"], "rollout.device"),
        (["rollout.backend=hf", "trainer.sync_backend=ipc"], "trainer.sync_backend=ipc"),
        (["rollout.backend=hf", "trainer.sync_backend=gloo"], "trainer.sync_backend=gloo"),
        (SPLIT + ["rollout.tensor_parallel_size=2"], "rollout.num_gpus_per_worker"),
        (SPLIT + ["ray.num_gpus=3"], "ray.num_gpus"),
        (SPLIT + ["rollout.colocate=true"], "rollout.num_gpus_per_worker"),
        (COLOCATED + ["trainer.sync_backend=nccl"], "trainer.sync_backend=nccl"),
        (COLOCATED + ["rollout.num_workers=1"], "rollout.num_workers"),
        (COLOCATED + ["ray.num_gpus=1"], "ray.num_gpus"),
        (["rollout.backend=hf", "rollout.colocate=true"], "rollout.colocate"),
        (["learner.resources.GPU=1"], "learner.resources.GPU"),
        (["rollout.backend=hf", "rollout.resources.rollout_node=0"], "rollout.resources.rollout_node"),
    ],
)
def test_bad_layouts_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(overrides=overrides)


def _documented_layouts() -> list[tuple[str, list[str]]]:
    """(yaml, overrides) of every `pjray train --config configs/<name>.yaml ...` line in the GPU
    recipes' header comments, so the layouts the docs advertise are the ones tested."""
    from pathlib import Path

    out = []
    for path in sorted((Path(__file__).parents[2] / "configs").glob("*.yaml")):
        lines = [line.lstrip("# ").rstrip() for line in path.read_text().splitlines() if line.startswith("#")]
        joined = " ".join(line[:-1] if line.endswith("\\") else line + "\n" for line in lines)
        for command in joined.splitlines():
            if "pjray train --config" in command:
                words = command.split("pjray train --config", 1)[1].split()
                out.append((words[0], words[1:]))
    return out


LAYOUTS = _documented_layouts()


def test_gpu_recipes_document_their_layouts() -> None:
    names = {name for name, _ in LAYOUTS}
    assert {"configs/qwen3vl_4b.yaml", "configs/flex_judge_7b.yaml"} <= names
    assert len(LAYOUTS) >= 6  # split, colocated and multi-node for each recipe


@pytest.mark.parametrize("name, overrides", LAYOUTS, ids=[f"{n}:{len(o)}" for n, o in LAYOUTS])
def test_documented_gpu_layouts_validate(name: str, overrides: list[str]) -> None:
    from pathlib import Path

    cfg = load(Path(__file__).parents[2] / name, overrides)
    assert cfg.rollout.backend == "vllm" and cfg.rollout.num_gpus_per_worker > 0
    assert cfg.trainer.sync_backend == ("ipc" if cfg.rollout.colocate else "nccl")


def test_vllm_backend_without_vllm_is_a_config_error() -> None:
    """Where vLLM does not import (the main CPU venv), choosing it fails as a config error that
    says how to get it, before any model is loaded."""
    import importlib.util

    from pjray.config import ModelConfig, RolloutConfig
    from pjray.rollout.worker import build_engine

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm imports here; this checks the message where it does not")
    with pytest.raises(ConfigError, match="rollout.backend=vllm.*vllm_cpu_env.sh"):
        build_engine("/nonexistent", ModelConfig(), RolloutConfig(backend="vllm", num_gpus_per_worker=1))


def test_text_only_judge_rollout_and_learner_views_agree(tmp_path) -> None:
    """A text-only judge (the model the CPU vLLM check serves) through the HF engine and the
    learner's collate: the learner's logprobs of the sampled tokens are the sampler's."""
    from pjray.config import load as load_config
    from pjray.models.loading import load_judge
    from pjray.rl.logprobs import forward_logprobs
    from pjray.rollout.hf_engine import HFEngine

    path = str(build_tiny_judge(tmp_path / "qwen2", arch="qwen2", seed=0))
    cfg = load_config(overrides=["model.tiny_arch=qwen2", "data.images=false", "rollout.max_new_tokens=8"])
    engine = HFEngine(path, cfg.model, cfg.rollout)
    assert engine.banned_ids == ()  # no image placeholders to ban
    out = engine.generate([_prompt(None)], n=2, seed=0)
    model, processor = load_judge(path, trainable=False)
    text = render_chat(processor, _prompt(None))
    batch = collate(
        processor, [Experience(prompt_text=text, image=None, response_ids=c.token_ids, advantage=0.0) for c in out]
    )
    with torch.no_grad():
        logp, _ = forward_logprobs(model, processor, batch)
    mask = batch.response_mask[:, 1:].bool()
    for row, c in enumerate(out):
        torch.testing.assert_close(logp[row][mask[row]], torch.tensor(c.logprobs), atol=1e-4, rtol=0)


def test_the_engine_arguments_follow_the_layout(vlm_processor) -> None:
    """What `vllm.LLM` is given: the learner's image budget for the processor everywhere; sleep
    mode and no multimodal processor cache for colocated engines (every sleep clears it); eager
    mode on CPU, the GPU memory share and TP ranks as processes on GPUs, compiled (CUDA graphs)
    there unless rollout.enforce_eager says otherwise, on either device."""
    split = load(
        overrides=SPLIT + ["rollout.tensor_parallel_size=2", "rollout.num_gpus_per_worker=2", "ray.num_gpus=6"]
    )
    colocated = load(overrides=COLOCATED + ["ray.num_gpus=2"])
    cpu = load(overrides=VLLM_CPU)
    size = vlm_processor.image_processor.size
    budget = {"size": {"shortest_edge": size.shortest_edge, "longest_edge": size.longest_edge}}

    on_gpus = llm_kwargs("judge", split.model, split.rollout, vlm_processor)
    assert on_gpus["mm_processor_kwargs"] == budget and on_gpus["limit_mm_per_prompt"] == {"image": 1, "video": 0}
    assert not on_gpus["enable_sleep_mode"] and "mm_processor_cache_gb" not in on_gpus
    assert on_gpus["distributed_executor_backend"] == "mp" and on_gpus["tensor_parallel_size"] == 2
    assert on_gpus["gpu_memory_utilization"] == split.rollout.gpu_memory_utilization
    assert on_gpus["enforce_eager"] is False  # torch.compile and CUDA graphs
    forced = load(overrides=SPLIT + ["rollout.enforce_eager=true"])
    assert llm_kwargs("judge", forced.model, forced.rollout, vlm_processor)["enforce_eager"] is True

    sleeping = llm_kwargs("judge", colocated.model, colocated.rollout, vlm_processor)
    assert sleeping["enable_sleep_mode"] and sleeping["mm_processor_cache_gb"] == 0
    assert "distributed_executor_backend" not in sleeping

    eager = llm_kwargs("judge", cpu.model, cpu.rollout, vlm_processor)
    assert eager["enforce_eager"] is True and "gpu_memory_utilization" not in eager
    # Whole prompts a step on CPU (a split prefill would rewind a seeded CPU generator: the engine dies).
    assert eager["enable_chunked_prefill"] is False and eager["max_num_batched_tokens"] >= cpu.rollout.max_model_len
    assert "enable_chunked_prefill" not in on_gpus
    compiled = load(overrides=VLLM_CPU + ["rollout.enforce_eager=false"])
    assert llm_kwargs("judge", compiled.model, compiled.rollout, vlm_processor)["enforce_eager"] is False


def test_other_families_keep_their_own_image_sizes_and_refuse_what_vllm_cannot_serve(tmp_path) -> None:
    """A judge of another family is given no Qwen pixel budget (its processor's tiles size the
    image on both sides); an adapter sync where vLLM serves no LoRA for the family is refused with
    the way out, before an engine starts."""
    from pjray.models.tiny_families import build_tiny_family_judge

    cfg = load(overrides=VLLM_CPU)
    adapter = load(overrides=VLLM_CPU + ["model.lora.rank=8", "model.lora.sync=adapter"])
    for arch in ("llava_onevision", "gemma3"):
        processor = load_processor(build_tiny_family_judge(tmp_path / arch, arch=arch))
        kwargs = llm_kwargs("judge", cfg.model, cfg.rollout, processor)
        assert kwargs["limit_mm_per_prompt"] == {"image": 1, "video": 0} and "mm_processor_kwargs" not in kwargs
        if arch == "gemma3":
            assert llm_kwargs("judge", adapter.model, adapter.rollout, processor)["enable_lora"] is True
        else:
            with pytest.raises(ValueError, match="model.lora.sync=merged"):
                llm_kwargs("judge", adapter.model, adapter.rollout, processor)


# ---------------------------------------------------------------------------------------------
# An engine whose own processes died (needs vLLM's exception types: the vLLM venv)
# ---------------------------------------------------------------------------------------------


class _Resources:
    engine_dead = False


def _engine_with(resources: _Resources) -> VllmEngine:
    """A VllmEngine whose vllm.LLM is reduced to the client's liveness mark."""
    from types import SimpleNamespace

    engine = VllmEngine.__new__(VllmEngine)
    engine.llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(resources=resources)))
    return engine


def test_an_engine_is_dead_when_vllm_says_so_or_marks_it_dead_soon_after(monkeypatch) -> None:
    exceptions = pytest.importorskip(
        "vllm.v1.engine.exceptions", reason="vLLM's exception types: the vLLM venv runs this"
    )
    monkeypatch.setattr(vllm_engine, "ENGINE_DEATH_GRACE_S", 0.5)
    assert _engine_with(_Resources()).is_dead(exceptions.EngineDeadError())
    # A worker died under a call in flight: its error comes first, the client's mark after it.
    resources = _Resources()
    threading.Timer(0.1, lambda: setattr(resources, "engine_dead", True)).start()
    assert _engine_with(resources).is_dead(Exception("Call to collective_rpc method failed: cancelled"))
    # Any other error of a live engine (a survivor's failed collective) is not a death.
    started = time.monotonic()
    assert not _engine_with(_Resources()).is_dead(RuntimeError("Connection closed by peer"))
    assert 0.5 <= time.monotonic() - started < 2
