"""Where responses stop: every engine's stop set holds `<|im_end|>`, the tokenizer's EOS and every
EOS id of the checkpoint's generation config (the vLLM engine runs with generation_config="vllm"
and so reads them itself)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pjray.config import ModelConfig, RolloutConfig
from pjray.models.tiny import build_tiny_judge
from pjray.rollout.engine import checkpoint_eos_ids, stop_token_ids
from pjray.rollout.hf_engine import HFEngine


def tokenizer(im_end: int | None = 7, eos: int | None = 7, unk: int | None = 0):
    vocab = {"<|im_end|>": im_end if im_end is not None else unk}
    return SimpleNamespace(convert_tokens_to_ids=lambda t: vocab.get(t, unk), eos_token_id=eos, unk_token_id=unk)


def test_the_stop_set_unites_the_chat_end_the_tokenizer_and_the_checkpoint():
    assert stop_token_ids(tokenizer(), [7, 11, 12]) == (7, 11, 12)
    assert stop_token_ids(tokenizer(eos=3), 9) == (3, 7, 9)
    assert stop_token_ids(tokenizer(), None) == (7,)
    # An unknown <|im_end|> maps to the unknown token, which never stops a response.
    assert stop_token_ids(tokenizer(im_end=None, eos=None), [4]) == (4,)
    with pytest.raises(ValueError, match="no EOS token"):
        stop_token_ids(tokenizer(im_end=None, eos=None), None, "judge")


def test_a_checkpoint_with_two_eos_ids_stops_the_hf_engine_at_both(tmp_path):
    judge = build_tiny_judge(tmp_path / "judge", seed=0)
    config = json.loads((judge / "generation_config.json").read_text())
    config["eos_token_id"] = [2, 5]
    (judge / "generation_config.json").write_text(json.dumps(config))
    assert checkpoint_eos_ids(str(judge)) == [2, 5]
    engine = HFEngine(str(judge), ModelConfig(), RolloutConfig(max_new_tokens=4))
    assert {2, 5} <= set(engine.eos_ids)
    assert checkpoint_eos_ids(str(tmp_path)) is None  # no generation_config.json
