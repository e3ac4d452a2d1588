"""The `llm` backend of the PPJD job: three prompt roles, strict JSON parsing, a text-LLM engine.

The released construction code (Perception-Judge `prepare-datasets/prompts/prompts.py`) asks a
text LLM three things, each answered with one JSON object:

- verify  -> {"is_correct": true|false}            is the chosen answer right?
- extract -> {"perception_attrs": ["...", ...]}    3-6 visual attributes the answer relies on
- rewrite -> {"rejected_perception_1": "...",       perception details altered, logic kept
              "rejected_perception_2": "..."}       perception and logic both wrong

The wording below is ours; the roles, keys and filters follow the release. Parsing is strict: the
reply must hold exactly one JSON object with the expected keys and types, otherwise
`LLMReplyError` says what was wrong, and the pipeline turns it into a reject with that reason.

`TextEngine` wraps a text LLM: transformers `generate` (CPU, or one GPU without vLLM), or
`vllm.LLM` (imported lazily; GPU clusters, or vLLM's CPU build). Both take chat messages and
return reply strings; their greedy replies agree (see `VllmTextEngine`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pjray.ppjd.rejects import RowDataError

MIN_ATTRS, MAX_ATTRS = 3, 6
MAX_ATTR_WORDS = 10

SYSTEM = "You are a careful annotator of visual question answering data. Reply with one JSON object only."

VERIFY_PROMPT = """Decide whether the response answers the question correctly.

Question: {question}
Reference answer: {answer}
Response: {chosen}

Reply with JSON only, exactly in this form: {{"is_correct": true}} or {{"is_correct": false}}"""

EXTRACT_PROMPT = """List the visual facts about the image that the response relies on: colours, counts,
positions, sizes, shapes, or text read from the image. Give 3 to 6 facts, each under 10 words.

Question: {question}
Response: {chosen}

Reply with JSON only, in this form: {{"perception_attrs": ["fact one", "fact two", "fact three"]}}"""

REWRITE_PROMPT = """Rewrite the response twice so that it becomes wrong.

Question: {question}
Response: {chosen}
Visual facts it relies on: {attrs}

rejected_perception_1: change one or more visual facts (a colour, count, position, size, shape or
text read from the image) everywhere they are mentioned, and keep every reasoning step as it is.
The final answer must change.
rejected_perception_2: change the visual facts as well, and also make one reasoning step wrong.
Keep the response's format, including its final answer line.

Reply with JSON only, in this form: {{"rejected_perception_1": "...", "rejected_perception_2": "..."}}"""


class LLMReplyError(RowDataError):
    """An LLM reply that is not the JSON the prompt asked for; the message says why (a reject
    reason of its row in the PPJD job)."""


# Each conversation ends with the opening of the expected JSON as the assistant's own words,
# which engines continue (HF `continue_final_message`, vLLM the same): small models that ignore
# "reply with JSON" in the instructions mostly follow a reply that already started as JSON.
VERIFY_PREFILL = '{"is_correct": '
EXTRACT_PREFILL = '{"perception_attrs": ["'
REWRITE_PREFILL = '{"rejected_perception_1": "'


def _conversation(text: str, prefill: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": text},
        {"role": "assistant", "content": prefill},
    ]


def verify_messages(question: str, chosen: str, answer: str) -> list[dict[str, str]]:
    text = VERIFY_PROMPT.format(question=question, chosen=chosen, answer=answer or "(none given)")
    return _conversation(text, VERIFY_PREFILL)


def extract_messages(question: str, chosen: str) -> list[dict[str, str]]:
    return _conversation(EXTRACT_PROMPT.format(question=question, chosen=chosen), EXTRACT_PREFILL)


def rewrite_messages(question: str, chosen: str, attrs: Sequence[str]) -> list[dict[str, str]]:
    text = REWRITE_PROMPT.format(question=question, chosen=chosen, attrs="; ".join(attrs))
    return _conversation(text, REWRITE_PREFILL)


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_json_object(reply: str) -> dict[str, Any]:
    """The one JSON object in `reply` (a ```json fence around it is allowed, nothing else).

    Strict on purpose: text around the object usually means the model rambled, and a guessed
    object from the middle of prose is how wrong labels get into a dataset.
    """
    text = reply.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    if not text:
        raise LLMReplyError("empty reply")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise LLMReplyError(f"not JSON ({err.msg} at char {err.pos}): {_clip(reply)}") from None
    if not isinstance(value, dict):
        raise LLMReplyError(f"expected a JSON object, got {type(value).__name__}: {_clip(reply)}")
    return value


def _clip(text: str, n: int = 80) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= n else text[:n] + "...")


def _only_keys(value: dict[str, Any], keys: set[str]) -> None:
    missing, extra = keys - set(value), set(value) - keys
    if missing or extra:
        raise LLMReplyError(f"expected keys {sorted(keys)}, missing {sorted(missing)}, extra {sorted(extra)}")


def parse_verify(reply: str) -> bool:
    value = parse_json_object(reply)
    _only_keys(value, {"is_correct"})
    if not isinstance(value["is_correct"], bool):
        raise LLMReplyError(f"is_correct must be true or false, got {value['is_correct']!r}")
    return value["is_correct"]


def parse_extract(reply: str) -> list[str]:
    value = parse_json_object(reply)
    _only_keys(value, {"perception_attrs"})
    attrs = value["perception_attrs"]
    if not isinstance(attrs, list) or not all(isinstance(a, str) for a in attrs):
        raise LLMReplyError("perception_attrs must be a list of strings")
    attrs = [" ".join(a.split()) for a in attrs if a.strip()]
    if not MIN_ATTRS <= len(attrs) <= MAX_ATTRS:
        raise LLMReplyError(f"{len(attrs)} perception attributes (need {MIN_ATTRS}-{MAX_ATTRS})")
    long = [a for a in attrs if len(a.split()) >= MAX_ATTR_WORDS]
    if long:
        raise LLMReplyError(f"attribute over {MAX_ATTR_WORDS - 1} words: {_clip(long[0])}")
    if len(set(a.lower() for a in attrs)) != len(attrs):
        raise LLMReplyError("duplicate perception attributes")
    return attrs


def parse_rewrite(reply: str, chosen: str) -> tuple[str, str]:
    """(perception-only, perception+reasoning) rewrites; each must differ from `chosen` and each other."""
    value = parse_json_object(reply)
    _only_keys(value, {"rejected_perception_1", "rejected_perception_2"})
    texts = []
    for key in ("rejected_perception_1", "rejected_perception_2"):
        text = value[key]
        if not isinstance(text, str) or not text.strip():
            raise LLMReplyError(f"{key} must be a non-empty string")
        if " ".join(text.split()) == " ".join(chosen.split()):
            raise LLMReplyError(f"{key} repeats the chosen answer unchanged")
        texts.append(text.strip())
    if texts[0] == texts[1]:
        raise LLMReplyError("rejected_perception_1 and rejected_perception_2 are the same text")
    return texts[0], texts[1]


# --------------------------------------------------------------------------- engines


class TextEngine(Protocol):
    def chat(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        """One reply per conversation, in order; greedy unless the engine was built to sample.

        A conversation that ends with an assistant message is continued, and the reply includes
        that message's text (so a prefilled "{" is part of what gets parsed).
        """
        ...


@dataclass(frozen=True)
class TextEngineSpec:
    """How to build a text engine inside a pipeline actor (a plain, picklable record)."""

    model: str  # HF directory or hub id (a directory holding a .gguf with `gguf_file`)
    gguf_file: str = ""
    engine: str = "hf"  # hf | vllm
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0: greedy
    device: str = "cpu"
    batch_size: int = 4


class HFTextEngine:
    """Chat with a causal LM through transformers `generate`, left-padded batches."""

    def __init__(self, spec: TextEngineSpec) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model, **kwargs)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(spec.model, **kwargs).to(spec.device).eval()
        self._torch = torch

    def chat(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        replies: list[str] = []
        for start in range(0, len(conversations), self.spec.batch_size):
            chunk = conversations[start : start + self.spec.batch_size]
            texts = [self._render(c) for c in chunk]
            inputs = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left").to(self.spec.device)
            sampling: dict[str, Any] = (
                {"do_sample": True, "temperature": self.spec.temperature}
                if self.spec.temperature > 0
                else {"do_sample": False}
            )
            with self._torch.inference_mode():
                out = self.model.generate(
                    **inputs,
                    max_new_tokens=self.spec.max_new_tokens,
                    pad_token_id=self.tokenizer.pad_token_id,
                    **sampling,
                )
            prompt_len = inputs["input_ids"].shape[1]
            replies.extend(
                _prefill(c) + self.tokenizer.decode(row[prompt_len:], skip_special_tokens=True)
                for c, row in zip(chunk, out)
            )
        return replies

    def _render(self, conversation: list[dict[str, str]]) -> str:
        if conversation[-1]["role"] == "assistant":
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
        return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def _prefill(conversation: list[dict[str, str]]) -> str:
    return conversation[-1]["content"] if conversation[-1]["role"] == "assistant" else ""


class VllmTextEngine:
    """Chat through `vllm.LLM` (GPU, or vLLM's CPU build), continuing a prefilled assistant message.

    On vLLM's CPU build its greedy replies equal `HFTextEngine`'s, character for character, and
    `LlmStage` runs on it (tests/integration/test_vllm_cpu.py); on GPUs it makes the same calls.
    The exception: HF `generate` also applies penalties that a checkpoint's generation config
    sets (e.g. repetition_penalty), which these explicit sampling params leave out.

    Serves the checkpoint in its own dtype, as `HFTextEngine` does (vLLM's "auto" would run a
    float32 checkpoint in bfloat16 and change greedy replies). Replies are the tokenizer's
    decode of the generated ids, as in `HFTextEngine`: vLLM's incremental detokenizer would
    drop a trailing incomplete UTF-8 character that a full decode keeps. On CPU the engine
    core runs in this process (one pipeline actor, one process) without a compile step, with
    a 1 GiB KV cache unless VLLM_CPU_KVCACHE_SPACE says otherwise. vLLM reads no GGUF files:
    a `gguf_file` spec needs the hf engine.
    """

    def __init__(self, spec: TextEngineSpec) -> None:
        if spec.gguf_file:
            raise ValueError(f"the vllm text engine cannot load {spec.gguf_file!r} (GGUF): use engine=hf")
        on_cpu = spec.device == "cpu"
        if on_cpu:
            from pjray.rollout.vllm_engine import cpu_engine_env

            cpu_engine_env()
        from transformers import AutoConfig
        from vllm import LLM, SamplingParams  # noqa: PLC0415  (optional, heavy)

        dtype = getattr(AutoConfig.from_pretrained(spec.model), "dtype", None) or "auto"
        self.llm = LLM(model=spec.model, tokenizer=spec.model, dtype=dtype, enforce_eager=on_cpu)
        self.params = SamplingParams(temperature=spec.temperature, max_tokens=spec.max_new_tokens, detokenize=False)
        self.tokenizer = self.llm.get_tokenizer()

    def chat(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        # All conversations of one call end alike (one role per call), so one flag fits them all.
        prefilled = conversations[-1][-1]["role"] == "assistant" if conversations else False
        outputs = self.llm.chat(
            conversations,
            self.params,
            use_tqdm=False,
            add_generation_prompt=not prefilled,
            continue_final_message=prefilled,
        )
        return [
            _prefill(c) + self.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
            for c, o in zip(conversations, outputs)
        ]


def build_text_engine(spec: TextEngineSpec) -> TextEngine:
    if spec.engine == "hf":
        return HFTextEngine(spec)
    if spec.engine == "vllm":
        return VllmTextEngine(spec)
    raise ValueError(f"ppjd.llm_engine={spec.engine!r}: expected hf or vllm")
