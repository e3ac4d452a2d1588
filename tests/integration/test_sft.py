"""`pjray sft` end to end on CPU: real Ray, a DeepSpeed learner rank, a tiny judge, chat rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pjray.config import load
from pjray.data.scenes import generate_scene, render
from pjray.models.loading import load_judge
from pjray.models.tiny import build_tiny_judge
from pjray.rl.logprobs import collate
from pjray.rl.sft import SFTDataError, read_chat_examples, run_sft, to_experience
from pjray.types import ChatExample, JudgePrompt

pytestmark = pytest.mark.slow


def write_rows(folder: Path, n: int) -> Path:
    """JSONL chat rows whose images are files next to it; one fixed response to learn."""
    rows = []
    for i in range(n):
        name = f"img{i}.png"
        (folder / name).write_bytes(render(generate_scene(i, 64)))
        rows.append(
            {
                "id": f"r{i}",
                "system": "Answer.",
                "user": f"Question {i}?",
                "image": name,
                "response": "ok\n</think>\n<answer>A</answer>",
            }
        )
    path = folder / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_sft_learns_the_target_and_exports_a_loadable_judge(tmp_path: Path, ray_local):
    judge = build_tiny_judge(tmp_path / "judge", seed=0)
    data = write_rows(tmp_path, 8)
    run_dir = tmp_path / "run"
    cfg = load(
        None,
        [
            "sft.source=jsonl",
            f"sft.path={data}",
            "sft.steps=30",
            "sft.batch_size=8",
            "sft.lr=5e-3",
            "sft.warmup_steps=0",
            "learner.micro_batch_size=4",
            f"trainer.run_dir={run_dir}",
            "tracking.wandb=false",
        ],
    )
    export = run_sft(cfg, str(judge))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 31))
    assert metrics[-1]["sft/loss"] < 0.5 * metrics[0]["sft/loss"]
    assert metrics[-1]["sft/token_acc"] > metrics[0]["sft/token_acc"]
    model, processor = load_judge(export)
    assert (export / "preprocessor_config.json").is_file()
    assert processor.image_token_id is not None and model.config.model_type == "qwen2_vl"


def test_an_untrained_span_carries_no_loss(tmp_path: Path):
    _, processor = load_judge(build_tiny_judge(tmp_path / "judge", seed=0), trainable=False)
    prompt = JudgePrompt("p", "Judge.", "Which is right?", render(generate_scene(0, 64)), "chat", "answer", 0, (), "")
    response = "Verdict: by the image.\n</think>\n<answer>A</answer>"
    start = response.index("image")
    whole = to_experience(processor, ChatExample(prompt, response), think_prefix=True)
    masked = to_experience(processor, ChatExample(prompt, response, untrained=(start, start + 5)), think_prefix=True)
    assert whole.loss_mask is None and masked.response_ids == whole.response_ids
    skipped = [t for t, keep in zip(masked.response_ids, masked.loss_mask) if not keep]
    assert (
        skipped
        and "image" in processor.tokenizer.decode(skipped)
        and "answer" not in processor.tokenizer.decode(skipped)
    )
    batch = collate(processor, [whole, masked])
    assert batch.response_mask[0].sum() == len(whole.response_ids)
    assert batch.response_mask[1].sum() == len(whole.response_ids) - len(skipped)
    with pytest.raises(SFTDataError, match="untrained span"):
        to_experience(processor, ChatExample(prompt, response, untrained=(0, len(response) + 1)), think_prefix=True)


def test_bad_chat_rows_name_file_and_row(tmp_path: Path):
    data = write_rows(tmp_path, 2)
    lines = data.read_text().splitlines()
    (tmp_path / "bad_json.jsonl").write_text(lines[0] + "\n{not json\n")
    with pytest.raises(SFTDataError, match=r"bad_json.jsonl: line 2: not JSON"):
        read_chat_examples(tmp_path / "bad_json.jsonl", "jsonl")
    row = json.loads(lines[1])
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "bad_image.jsonl").write_text(lines[0] + "\n" + json.dumps({**row, "image": "corrupt.png"}) + "\n")
    with pytest.raises(SFTDataError, match=r"bad_image.jsonl: row 2: could not decode image"):
        read_chat_examples(tmp_path / "bad_image.jsonl", "jsonl")
    (tmp_path / "no_response.jsonl").write_text(json.dumps({"user": "q"}) + "\n")
    with pytest.raises(SFTDataError, match=r"row 1: needs string fields 'user' and 'response'"):
        read_chat_examples(tmp_path / "no_response.jsonl", "jsonl")
