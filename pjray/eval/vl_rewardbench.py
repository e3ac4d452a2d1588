"""VL-RewardBench (Li et al., CVPR 2025): rows, the official prompt, reading and scoring.

Official sources: repository `vl-rewardbench/VL_RewardBench`, `prompt.py` (the judge prompt),
`inference_hf.py` (judging) and `cal.py` (reading and scoring); data `MMInstruction/VL-RewardBench`
(split `test`).

Rows as published: the hub parquet (`id, query, response [2], image {bytes, path}, human_ranking,
models, judge, rationale, query_source, ground_truth`) or the repository's older `data.jsonl`
with `image_path`. `human_ranking` ranks the two responses (0 = preferred). Ids repeat, so pjray
keys rows by index; the official script keys an item by id + query + the sorted responses, and
that key is kept for its vote (rows that share it are one item there).

Judging, as `inference_hf.py` does: one user turn, the prompt of `prompt.py` (`official_prompt`)
and the image; the two responses in a random order per sample, seeded here (`swapped`, recorded
per sample; the official script draws it unseeded); its sampling is 10 samples at temperature
0.2, top-p 0.2 (`configs/eval_vl_rewardbench.yaml`).

Scoring, as `cal.py` does (`official_k<k>` tables, `official_tables`): its reading
(`official_choice`), a strict-majority vote over the first k lines of each item after its seeded
shuffle (`votes`), and accuracies per group over the decided items (`vote_table`, `group_of`).
pjray's strict reading (`strict`) beside it: N must be 1 or 2, an unreadable sample is wrong,
accuracy over every row (`pjray.eval.reward_bench`).
"""

from __future__ import annotations

import random
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pjray.data.sources import image_bytes
from pjray.eval.metrics import OVERALL
from pjray.eval.preference import PreferenceDataError, PreferenceRow, Sample, paper_choice, preferred_slot, sample_files
from pjray.eval.report import Cell

NAME = "vl_rewardbench"
SOURCE = "vl-rewardbench/VL_RewardBench cal.py (reading, strict-majority vote over k samples, group accuracies)"
GROUPS = ("general", "hallucination", "reasoning")
MACRO = "macro"
FIXED_ORDER = False  # the order is drawn per sample: an outputs line says `swapped`
KS = (1, 3, 5, 7, 9)  # cal.py's vote sizes, in its order (the shuffles share one generator)
SHUFFLE_SEED = 1234

# cal.py's verdict pattern, matched case-insensitively on the text without newlines and '*'.
OFFICIAL_VERDICT = re.compile(
    r"(?:Overall Judgment|Therefore)\s*.*\s*-*\s*Answer\s*(\d+)\s*is\s*(?:the\s*)?(?:slightly\s*)?better", re.IGNORECASE
)

# The id prefix -> the source dataset -> the group (cal.py's get_dataset_from_id and group_mapping).
_DATASETS = {
    "RLAIF": "rlaif-v",
    "RLHF": "rlhf-v",
    "mathverse": "reasoning_tasks",
    "mmmu": "reasoning_tasks",
    "wildvision": "wildvision-battle",
    "hallucination": "povid",
}
_GROUP_OF_DATASET = {
    "vlfeedback": "general",
    "wildvision-battle": "general",
    "povid": "hallucination",
    "rlaif-v": "hallucination",
    "rlhf-v": "hallucination",
    "reasoning_tasks": "reasoning",
}


def source_dataset(row_id: str) -> str:
    """The official script's source dataset of an id, from its prefix."""
    cuts = [i for i in (row_id.find("_"), row_id.find("-")) if i != -1]
    prefix = row_id[: min(cuts)] if cuts else row_id
    return _DATASETS.get(prefix, "vlfeedback")


def group_of(row_id: str) -> str:
    """The group of an id's source dataset: general = vlfeedback + wildvision, hallucination =
    povid (prefix `hallucination`) + RLAIF + RLHF, reasoning = mathverse + mmmu. The prefix is the
    text before the first `_` or `-`; any other prefix is vlfeedback."""
    return _GROUP_OF_DATASET[source_dataset(row_id)]


# --------------------------------------------------------------------------- rows


def parse_row(raw: Any, root: Path, where: str, index: int) -> PreferenceRow:
    if not isinstance(raw, dict):
        raise PreferenceDataError(f"{where}: expected an object, got {type(raw).__name__}")
    missing = [k for k in ("id", "query", "response", "human_ranking") if raw.get(k) is None]
    if missing:
        raise PreferenceDataError(f"{where}: no {', '.join(missing)} (row has {sorted(raw)})")
    responses = raw["response"]
    if (
        not isinstance(responses, (list, tuple))
        or len(responses) != 2
        or not all(isinstance(r, str) for r in responses)
    ):
        raise PreferenceDataError(f"{where}: 'response' must be a list of 2 strings")
    ranking = list(raw["human_ranking"]) if isinstance(raw["human_ranking"], (list, tuple)) else None
    if ranking is None or sorted(ranking) != [0, 1]:
        raise PreferenceDataError(
            f"{where}: 'human_ranking' {raw['human_ranking']!r} is not a ranking of 2 responses ([0, 1] or [1, 0])"
        )
    key = "image" if raw.get("image") is not None else "image_path"
    image = image_bytes(raw.get(key), root, where, key=key)
    if image is None:
        raise PreferenceDataError(f"{where}: no image ('image' or 'image_path')")
    row_id, query = str(raw["id"]), str(raw["query"])
    return PreferenceRow(
        index=index,
        id=row_id,
        query=query,
        responses=(responses[0], responses[1]),
        image=image,
        better=ranking.index(0),
        group=group_of(row_id),
        key=row_id + query + "\t".join(sorted(responses)),
    )


# --------------------------------------------------------------------------- judging


def official_prompt(row: PreferenceRow, swapped: bool) -> str:
    """`prompt.py`'s prompt (its leading space included; no system prompt, no tie, ending
    "Overall Judgment: Answer X is better"), responses in the sample's order; `inference_hf.py`
    then removes "<image>\\n" from it."""
    first, second = (row.responses[1], row.responses[0]) if swapped else row.responses
    text = f""" You are a highly capable multimodal AI assistant tasked with evaluating answers to visual questions. Please analyze the following image and question, then determine which of the two provided answers is better.

Question: {row.query}

Answer 1: {first}

Answer 2: {second}

Please evaluate both answers based on the following criteria:
1. Accuracy: How well does the answer align with the visual information in the image?
2. Completeness: Does the answer fully address all aspects of the question?
3. Clarity: Is the answer easy to understand and well-articulated?
4. Relevance: Does the answer directly relate to the question and the image?

After your evaluation, please:
1. Explain your reasoning for each criterion.
2. Provide an overall judgment on which answer is better (Answer 1 or Answer 2). For example: Overall Judgment: Answer X is better.

Your response should be structured and detailed, demonstrating your understanding of both the visual and textual elements of the task."""  # noqa: E501
    return text.replace("<image>\n", "")


def swapped(row: PreferenceRow, seed: int) -> bool:
    """The sample's response order: a coin per (seed, row), the same in every run."""
    return random.Random(f"{NAME}:{seed}:{row.index}").random() < 0.5


def official_choice(text: str) -> int | None:
    """`cal.py`'s reading: the answer number N, or None when the pattern does not match.
    Newlines and `*` are removed, then `OFFICIAL_VERDICT` finds the last "Answer N is [the]
    [slightly] better" after the first "Overall Judgment" or "Therefore". In the vote a sample
    agrees unless N is the slot of the rejected response (so "Answer 3 is better" agrees)."""
    match = OFFICIAL_VERDICT.search(text.replace("\n", "").replace("*", ""))
    return int(match.group(1)) if match else None


def strict_choice(text: str) -> int | None:
    """pjray's reading: the official one, where N is 1 or 2."""
    n = official_choice(text)
    return n if n in (1, 2) else None


# --------------------------------------------------------------------------- official scoring


@dataclass
class ItemVotes:
    group: str
    agree: int = 0
    reject: int = 0
    unparsed: int = 0

    @property
    def total(self) -> int:
        return self.agree + self.reject + self.unparsed

    def outcome(self) -> str:
        """cal.py's `classify`: a strict majority of the counted samples, else `other`."""
        for name in ("agree", "reject", "unparsed"):
            if getattr(self, name) > self.total / 2:
                return name
        return "other"


def votes(
    rows: Sequence[PreferenceRow], samples: Sequence[Sample], prompt_format: str = "original"
) -> dict[int, dict[str, ItemVotes]]:
    """k -> item key -> the counts of its first k lines after the shuffle, for every k in KS
    (the shuffles share one generator, so each k's lines depend on the earlier ones).

    As `cal.py`: every line of the outputs shuffled (its swap of each position with a random
    one, the generator seeded SHUFFLE_SEED once, before k = 1, 3, 5, 7, 9 in that order), the
    first k lines of each item counted; each item is then classed by strict majority: agree,
    reject, unparsed, or no majority (`ItemVotes.outcome`)."""
    by_row = {r.index: r for r in rows}
    read = paper_choice if prompt_format == "paper" else official_choice
    rng = random.Random(SHUFFLE_SEED)
    out = {}
    for k in KS:
        lines = list(samples)
        for i in range(len(lines)):
            j = rng.randint(0, len(lines) - 1)
            lines[i], lines[j] = lines[j], lines[i]
        counts: dict[str, ItemVotes] = {}
        for s in lines:
            row = by_row[s.row]
            item = counts.setdefault(row.key, ItemVotes(row.group))
            if item.total >= k:
                continue
            n = read(s.output)
            rejected = 3 - preferred_slot(row, s.swapped)
            if n is None:
                item.unparsed += 1
            elif n == rejected:
                item.reject += 1
            else:
                item.agree += 1
        out[k] = counts
    return out


@dataclass(frozen=True)
class _GroupRate:
    value: float | None
    n: int  # decided items (agree + reject)
    unparsed: int = 0  # items whose majority is unparsed
    skipped: int = 0  # items without a majority


def vote_table(items: dict[str, ItemVotes]) -> dict[str, _GroupRate]:
    """Per group, overall and macro (cal.py's `distribution_dataset` on classified items): per
    group agree / (agree + reject), unparsed and no-majority items left out of the denominators
    (reported as `unparsed` and `skipped` counts); overall pooled over the decided items; macro the
    mean of the three group accuracies. Where the official script divides by zero (a group with
    nothing decided), the value is undefined and `official_tables` notes it."""
    outcomes: dict[str, dict[str, int]] = {g: {"agree": 0, "reject": 0, "unparsed": 0, "other": 0} for g in GROUPS}
    for item in items.values():
        outcomes[item.group][item.outcome()] += 1
    table = {}
    for g in GROUPS:
        o = outcomes[g]
        decided = o["agree"] + o["reject"]
        table[g] = _GroupRate(o["agree"] / decided if decided else None, decided, o["unparsed"], o["other"])
    agree = sum(o["agree"] for o in outcomes.values())
    decided = sum(table[g].n for g in GROUPS)
    table[OVERALL] = _GroupRate(
        agree / decided if decided else None,
        decided,
        sum(o["unparsed"] for o in outcomes.values()),
        sum(o["other"] for o in outcomes.values()),
    )
    values = [table[g].value for g in GROUPS]
    table[MACRO] = _GroupRate(statistics.fmean(values) if None not in values else None, decided)  # type: ignore[arg-type]
    return table


def official_tables(
    rows: Sequence[PreferenceRow], samples: Sequence[Sample], prompt_format: str
) -> tuple[dict[str, dict[str, Cell]], dict[str, str], list[str]]:
    """`official_k<k>` for each k in KS up to the most samples a row has (k = 1 always)."""
    depth = len(sample_files(samples))  # the most samples a row has
    tables, notes = {}, []
    for k, items in votes(rows, samples, prompt_format).items():
        if k > 1 and k > depth:
            continue
        t = vote_table(items)
        tables[f"official_k{k}"] = {
            name: Cell(r.value, n=r.n, unparsed=r.unparsed, skipped=r.skipped) for name, r in t.items()
        }
        empty = [g for g in GROUPS if t[g].value is None]
        if empty:
            notes.append(
                f"official_k{k}: no decided item in {', '.join(empty)}: its accuracy and the macro average are "
                "undefined (the official script divides by zero there)"
            )
    reading = "pjray's reading of the paper prompt's two scores" if prompt_format == "paper" else "cal.py's reading"
    sources = {
        name: f"{SOURCE}: {reading}; first {name.removeprefix('official_k')} line(s) of each item after its seeded shuffle, "
        "strict majority; unparsed (`unparsed`) and no-majority (`skipped`) items out of the denominators"
        for name in tables
    }
    sources[OVERALL] = "cal.py: agree / decided, pooled over the three groups"
    sources[MACRO] = "cal.py: the mean of the three group accuracies"
    return tables, sources, notes
