"""The base judge recipes: a small Qwen3-VL judge, built from scratch on a CPU, that perceives
scenes and writes the judge format (`<think>...</think><answer>...</answer>`).

The paper trains judges that already judge and see the image well enough, yet rank a fluent
answer that contradicts the image as high as the correct one (Mode (b), response-anchored
judgment); GRPO on PPJD must teach them to *use* what they see. A recipe (`BaseJudgeRecipe`)
builds that starting point in three parts:
1. architecture (`base_config`): a ~1.3M-parameter text model (128 wide, 4 layers) and a 2-layer
   vision tower; 96 px scenes resized to 48 px, 3 x 3 patches of 16 px (one per grid cell),
   merged into **one image token**; a byte-level BPE tokenizer trained on the judge texts;
2. perception front-end (`pretrain_vision`), frozen in every later stage (`model.freeze_vision`),
   so GRPO cannot change the judge's eyesight, only how it is used, as in the paper's analysis;
3. supervised judging (`sft_examples`, trained by `pjray sft` on the DeepSpeed learner).
The recipe's defaults (`model.init=base_judge`) are perceptually biased by construction: an
honest think text states what the image shows, then a disposition ("Verdict: by the text." or
"... by the image.") that the verdict rests on, mostly by the text. The shipped recipe
(`model.init=one_disposition`, `pjray.recipes.base_judge.SHIPPED_INIT`) has no disposition to
switch and an untaught part for GRPO to teach; its gates: `pjray.eval.held_out.base_judge_gates`.

Every step is deterministic for a seed, and a build is cached in a directory named by a hash of
the recipe, so a changed recipe builds anew (`pjray.recipes.base_judge`). What did not work, and
the builds' measurements: `benchmarks/results/design_notes.md`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from pjray.data.prompts import EOS_TOKEN, LETTERS, render_batch, render_probe, render_score
from pjray.data.scenes import COLORS, SHAPES, SIZES, Scene, SceneQA, generate_scene, in_split, render, split_qas
from pjray.ppjd.perturb import final_answer, ranked_item
from pjray.ppjd.swap import swap_pair
from pjray.types import ChatExample, JudgeItem, JudgePrompt

__all__ = [
    "BaseJudgeRecipe",
    "judge_scenes",
    "sft_examples",
    "ranking_target",
    "score_target",
    "probe_target",
    "disposition",
    "matching",
    "marked_candidates",
]

SCORE_CONSISTENT, SCORE_MISMATCH = 8, 4
CHECKS = ("flags", "compare")
KIND_VALUES = {"color": COLORS, "size": SIZES}


@dataclass(frozen=True)
class BaseJudgeRecipe:
    """Everything that decides the base judge's weights (its hash names the cache directory).

    Scenes: one object, colour and size questions (`objects`, `kinds`), so that every perception
    error stays verifiable from the facts and perception is a whole-image readout: the judge sees
    well, and what it lacks is what the paper's base judges lack, using what it sees. Three sizes
    (small, medium, large), so that a size question has two wrong answers that differ.

    The shipped recipe (`RECIPES["one_disposition"]` in `pjray.recipes.base_judge`) sets
    `disposition=False` (every verdict by the image), `checks="compare"`, independent tuples,
    `swapped_share=0.5` and the `untaught` values orange and purple. The recipe's defaults teach
    a switch (GRPO raises "by the image", and the checks that word turns on are already there);
    that one has nothing to switch and something to learn. Its four gates
    (`pjray.eval.held_out.base_judge_gates`) are measured on the looking protocol's held-out
    independent tuples at the end of every build and written into the build's `report.json`.
    """

    seed: int = 0
    image_size: int = 96  # scenes are rendered at this side, as data.image_size renders them
    model_image_size: int = 48  # the processor's side: 3 x 3 patches of 16 px, one per scene grid cell,
    patch_size: int = 16
    merge_size: int = 3  # merged into one image token
    objects: tuple[int, int] = (1, 1)  # (min, max) objects per scene of the judging tasks
    kinds: tuple[str, ...] = ("color", "size")  # question kinds of the judging tasks
    # The ranked tuples of the judging tasks (pjray.ppjd.perturb.CONSTRUCTIONS). Nested, as the
    # paper builds PPJD. With "flags" checks, independent tuples (every wrong candidate its own
    # wrong answer) taught checks by the image too unreliable for judging by the image to pay, so
    # GRPO had nothing to follow: there the checks must compare each answer with the image, while
    # on nested tuples the correct answer is also the odd one out, which the checks can lean on.
    # (The shipped recipe builds independent tuples with "compare" checks and swapped images.)
    # Measured: benchmarks/results/design_notes.md.
    construction: str = "nested"
    # The judging data (tokenizer corpus, supervised judging) is of the "train" content split
    # (pjray.data.scenes.SPLITS): no held-out (shape, cell) combination; the held-out reports
    # use the others. The perception front-end is trained on all content, as a pretrained
    # vision encoder is: trained on the train split alone it misread size on held-out
    # combinations, so size questions could not be judged (benchmarks/results/design_notes.md).
    vision_split: str = "all"
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    vocab_size: int = 1024
    # Perception front-end
    vision_steps: int = 1000
    vision_batch: int = 32
    vision_lr: float = 3e-3
    # Supervised judging
    sft_scenes: int = 6000
    sft_steps: int = 2000
    sft_batch: int = 16
    sft_micro_batch: int = 4  # length-sorted micro-batches: probes do not pad to ranking prompts
    sft_lr: float = 2e-3
    bias: float = 0.8  # the disposition's prior: by the text (response-anchored) on this fraction
    # The fraction of judging targets whose verdict follows the image: more than 1 - bias, so the
    # verdict after "by the image" is learned; the disposition of the extra ones is not trained.
    image_verdicts: float = 0.7
    # False: one disposition. No "Verdict: ..." sentence, every supervised verdict by the image
    # (needs bias 0 and image_verdicts 1), so there is no switch to flip and the judge forced onto
    # its image disposition is the judge itself.
    disposition: bool = True
    # How a verdict by the image checks each candidate (CHECKS): "flags" marks the answer the image
    # shows ("A: purple. B: red, matches."); "compare" restates the image's value beside every
    # answer and says whether they are the same ("A: purple vs red, no. B: red vs red, yes."), so
    # each check compares two neighbouring words.
    checks: str = "flags"
    # The untaught part of the task: values of the asked attribute whose checks the supervised data
    # never teaches. On an image showing one, the checks mark a random candidate as the match (and
    # the verdict and score follow them), so the judge guesses there; what GRPO teaches is there.
    untaught: tuple[str, ...] = ()
    batch_examples: int = 2  # batch-ranking examples a scene, each in its own shown order
    # The fraction of judging examples shown on the tuple's swapped image (`pjray.ppjd.swap`: the
    # perception-error answer made right), the same texts: no feature of the texts alone then
    # tells which candidate matches, only the image does.
    swapped_share: float = 0.0

    def __post_init__(self) -> None:
        if self.checks not in CHECKS:
            raise ValueError(f"checks={self.checks!r}: expected one of {CHECKS}")
        if not self.disposition and (self.bias != 0.0 or self.image_verdicts != 1.0):
            raise ValueError(
                "a judge of one disposition (disposition=False) judges every verdict by the image: bias 0, image_verdicts 1"
            )
        unknown = [v for v in self.untaught if not any(v in values for values in KIND_VALUES.values())]
        if unknown:
            raise ValueError(f"untaught values {unknown} are no value of a judged attribute {dict(KIND_VALUES)}")
        if self.swapped_share and not set(self.kinds) <= set(KIND_VALUES):
            raise ValueError(
                f"swapped_share: the image swap re-renders {sorted(KIND_VALUES)} questions, not {list(self.kinds)}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def forced_sentence(self) -> str:
        """`forced_sentence` for a judge of this recipe."""
        return forced_sentence(self.disposition)

    def part(self, *values: str) -> str:
        """ "untaught" when any of `values` (what the images of one item show) is untaught, else "taught"."""
        return "untaught" if any(v in self.untaught for v in values) else "taught"


# --------------------------------------------------------------------------- targets


def ranking_target(
    item: JudgeItem,
    shown: tuple[int, ...],
    aware: bool,
    recipe: BaseJudgeRecipe | None = None,
    marked: frozenset[int] | None = None,
) -> str:
    """The think text and verdict for a batch-ranking prompt that shows `item.candidates` in the
    order `shown` (letter i = candidate shown[i]), as `recipe` (default: the recipe's defaults,
    model.init=base_judge) writes it.

    The think text states what the image shows, then the judge's disposition
    (`disposition(aware)`, unless the recipe has one disposition), and the verdict follows it. By
    the text (`aware=False`): the candidates in the order shown, as a judge that cannot tell
    fluent answers apart keeps them. By the image: the think text goes on to check each
    candidate's final answer against the image (`recipe.checks`), and the verdict puts the
    candidates the checks mark (`marked`; default: those whose final answer is what the image
    shows) first, then the others, each group in the order shown.
    """
    recipe = recipe or BaseJudgeRecipe()
    truth = str(item.meta["truth"])
    marked = matching(item) if marked is None else marked
    parts = [f"Image: {truth}.", *_disposition_part(recipe, aware)]
    positions = list(range(len(shown)))
    if aware:
        for pos, cand in enumerate(shown):
            parts.append(f"{LETTERS[pos]}: {_check(item, cand, truth, cand in marked, recipe.checks)}.")
        positions.sort(key=lambda p: shown[p] not in marked)  # stable: shown order within
    verdict = " > ".join(LETTERS[p] for p in positions)
    return " ".join(parts) + f"\n</think>\n<answer>{verdict}</answer>"


def disposition(aware: bool) -> str:
    """The think text's second sentence, right after what the image shows: what the verdict
    rests on. It comes before any check of the candidates, so a sample judged by the text holds
    no check that its reward could reinforce or punish."""
    return "Verdict: by the image." if aware else "Verdict: by the text."


def forced_sentence(has_disposition: bool) -> str:
    """What the looking protocol writes after a judge's own "Image: X." to force it onto its image
    mode: the image disposition, or nothing for a judge that writes no disposition sentence."""
    return disposition(True) if has_disposition else ""


def _disposition_part(recipe: BaseJudgeRecipe, aware: bool) -> list[str]:
    if recipe.disposition:
        return [disposition(aware)]
    if not aware:
        raise ValueError("a judge of one disposition judges every verdict by the image")
    return []


def matching(item: JudgeItem) -> frozenset[int]:
    """The candidates whose final answer is what the image shows."""
    truth = str(item.meta["truth"])
    return frozenset(c for c in range(len(item.candidates)) if _final_is(item, c, truth))


def marked_candidates(item: JudgeItem, recipe: BaseJudgeRecipe, rng: random.Random) -> frozenset[int]:
    """The candidates a supervised check marks as the match: `matching`, except on an image of an
    untaught value (`recipe.untaught`), where one candidate drawn at random is marked."""
    if recipe.part(str(item.meta["truth"])) == "untaught":
        return frozenset({rng.randrange(len(item.candidates))})
    return matching(item)


def _check(item: JudgeItem, cand: int, truth: str, marked: bool, checks: str) -> str:
    said = final_answer(item.candidates[cand]) or "nothing"
    if checks == "compare":
        return f"{said} vs {truth}, {'yes' if marked else 'no'}"
    return f"{said}, matches" if marked else said


def _final_is(item: JudgeItem, cand: int, truth: str) -> bool:
    said = final_answer(item.candidates[cand])
    return said is not None and said.strip().lower() == truth.strip().lower()


def score_target(
    item: JudgeItem, cand: int, aware: bool, recipe: BaseJudgeRecipe | None = None, marked: bool | None = None
) -> str:
    """The think text and score for the score protocol on candidate `cand` of `item`: by the
    text every fluent answer scores SCORE_CONSISTENT; by the image the think text checks the
    answer, and one the check does not mark (`marked`; default: its final answer is what the
    image shows) scores SCORE_MISMATCH."""
    recipe = recipe or BaseJudgeRecipe()
    truth = str(item.meta["truth"])
    marked = cand in matching(item) if marked is None else marked
    score = SCORE_MISMATCH if aware and not marked else SCORE_CONSISTENT
    think = " ".join([f"Image: {truth}.", *_disposition_part(recipe, aware)])
    if aware:
        think += f" Answer: {_check(item, cand, truth, marked, recipe.checks)}."
    return f"{think}\n</think>\n<answer>{score}</answer>"


def probe_target(answer: str) -> str:
    return f"Image: {answer}.\n</think>\n<answer>{answer}</answer>"


# --------------------------------------------------------------------------- examples


def judge_scenes(n: int, seed: int, recipe: BaseJudgeRecipe, split: str = "train") -> list[tuple[SceneQA, JudgeItem]]:
    """`n` scene questions of the content `split` with their ranked K=3 items (built by
    `recipe.construction`), kinds cycling through `recipe.kinds`."""
    qas = split_qas(n, partial(_scene_seed, seed), split, recipe.image_size, recipe.kinds, recipe.objects)
    return [(qa, ranked_item(qa, 3, construction=recipe.construction)) for qa in qas]


def _scene_seed(seed: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"pjray.base_judge:{seed}:{index}".encode()).digest()[:4], "big") >> 1


def sft_examples(recipe: BaseJudgeRecipe, n_scenes: int, seed: int) -> list[ChatExample]:
    """The supervised mixture over `n_scenes` scenes, deterministic for (recipe, seed). Per scene:
    the scene question as a plain VQA probe (the diagnosis' probe prompt), `recipe.batch_examples`
    batch-ranking examples (each in its own shown order) and one score example, each response in
    the judge format (`probe_target`, `ranking_target`, `score_target`):
    - probe: `Image: red.` then `<answer>red</answer>`;
    - batch: `Image: red. Verdict: by the text.` then `<answer>A > B > C</answer>`, or `Image: red.
      Verdict: by the image. A: purple. B: red, matches. C: green.` then `<answer>B > A > C</answer>`;
    - score: `... Verdict: by the text.` then `<answer>8</answer>`, or `... Verdict: by the image.
      Answer: purple.` then `<answer>4</answer>`.
    A fraction `recipe.image_verdicts` of the judging targets follows the image, so the checks and
    the verdict after "by the image" are learned well; the disposition word is trained on only
    enough of them (`disposition_keep_rate`; the loss skips "image" in the others,
    `ChatExample.untrained`) that the trained dispositions are by the text on a fraction
    `recipe.bias`. With the defaults the judge perceives (its think text and probe answers are
    right) but mostly does not let perception decide its verdict: the correct answer is first one
    time in three, and a fluent wrong answer scores as high as the correct one. The disposition
    is one habit shared by the ranking and the score prompts, as a real judge's response-anchoring
    is, so GRPO on batch ranking can lower the score protocol's bias only through it. Judging by
    the image earns more batch-ranking reward on PPJD tuples (Levenshtein: 2/3 against 4/9 on
    average) than on control tuples without perception errors, where a contradiction can keep
    the right final answer.
    """
    rng = random.Random(f"pjray.base_judge.sft:{seed}")
    keep = disposition_keep_rate(recipe.bias, recipe.image_verdicts)

    def judged(prompt: JudgePrompt, target: Callable[[bool], str], task: str) -> ChatExample:
        aware = rng.random() < recipe.image_verdicts
        response = target(aware)
        untrained = None
        if recipe.disposition and aware and rng.random() >= keep:  # the verdict is trained, the disposition is not
            start = response.rindex(disposition(True)) + len(disposition(False).removesuffix("text."))
            untrained = (start, start + len("image"))
        return ChatExample(prompt, response, task, untrained)

    examples: list[ChatExample] = []

    def shown_on(item: JudgeItem) -> JudgeItem:
        if recipe.swapped_share and rng.random() < recipe.swapped_share:
            return swap_pair(item).swapped
        return item

    for qa, item in judge_scenes(n_scenes, seed, recipe):
        examples.append(
            ChatExample(render_probe(qa.question, item.image, item_id=item.id), probe_target(qa.final), "vqa")
        )
        for _ in range(recipe.batch_examples):  # several shown orders: ranking is the hardest task
            it = shown_on(item)
            prompt = render_batch(it, rng)
            marked = marked_candidates(it, recipe, rng) if recipe.untaught else None
            examples.append(
                judged(prompt, partial(ranking_target, it, prompt.shown, recipe=recipe, marked=marked), "batch")
            )
        it = shown_on(item)
        cand = rng.randrange(len(it.candidates))
        score_prompt = render_score(it.question, it.image, it.candidates[cand], item_id=f"{it.id}:{cand}")
        marked_score = cand in marked_candidates(it, recipe, rng) if recipe.untaught else None
        examples.append(
            judged(score_prompt, partial(score_target, it, cand, recipe=recipe, marked=marked_score), "score")
        )
    return examples


def disposition_keep_rate(bias: float, image_verdicts: float) -> float:
    """The fraction of image-verdict targets whose disposition is trained, so that the trained
    dispositions are by the text on a fraction `bias` of the judging targets while a fraction
    `image_verdicts` (>= 1 - bias) of the verdicts follows the image."""
    if not (0.0 <= bias <= 1.0 and 1.0 - bias <= image_verdicts <= 1.0):
        raise ValueError(f"need 0 <= bias <= 1 and 1 - bias <= image_verdicts <= 1; got {bias}, {image_verdicts}")
    if bias == 0.0 or image_verdicts == 0.0:
        return 1.0
    return (1.0 - bias) * (1.0 - image_verdicts) / (bias * image_verdicts)


VISION_SEED_INDEX, VISION_HELD_OUT_INDEX = 10_000_000, 20_000_000


def training_scene_seeds(recipe: BaseJudgeRecipe) -> set[int]:
    """Every scene seed the recipe trains on (tokenizer corpus, perception front-end, supervised
    judging), so that evaluations can assert their scenes are held out."""
    seeds = {qa.scene.seed for qa, _ in judge_scenes(recipe.sft_scenes, recipe.seed, recipe)}
    seeds |= {qa.scene.seed for qa, _ in judge_scenes(TOKENIZER_SCENES, TOKENIZER_SEED, recipe)}
    seeds |= set(vision_seeds(recipe, recipe.vision_steps * recipe.vision_batch, recipe.vision_split))
    return seeds


def vision_seeds(
    recipe: BaseJudgeRecipe, n: int, split: str = "train", index: int = VISION_SEED_INDEX, seed: int | None = None
) -> list[int]:
    """The first `n` one-object scene seeds of the content `split` from `_scene_seed(seed,
    index)` on: the perception front-end's scenes (its held-out check: another seed and index)."""
    seed = recipe.seed if seed is None else seed
    first, out = _scene_seed(seed, index), []
    s = first
    while len(out) < n:
        if in_split(generate_scene(s, recipe.image_size, 1, 1), split):
            out.append(s)
        s += 1
    return out


# --------------------------------------------------------------------------- building

TOKENIZER_SCENES, TOKENIZER_SEED = 300, -1


def tokenizer_corpus(recipe: BaseJudgeRecipe) -> list[str]:
    """The texts the base judge's tokenizer is trained on: its system prompts, and the prompts
    and targets of a few hundred scenes (a seed no training or evaluation data uses)."""
    from pjray.data.prompts import (
        SYSTEM_BATCH_RANKING,
        SYSTEM_BATCH_SCORES,
        SYSTEM_PAIR_RANKING,
        SYSTEM_PAIR_SCORES,
        SYSTEM_PROBE,
        SYSTEM_SCORE,
    )

    systems = [
        SYSTEM_BATCH_RANKING,
        SYSTEM_BATCH_SCORES,
        SYSTEM_PAIR_RANKING,
        SYSTEM_PAIR_SCORES,
        SYSTEM_SCORE,
        SYSTEM_PROBE,
    ]
    lines = systems * 20
    for ex in sft_examples(recipe, TOKENIZER_SCENES, seed=TOKENIZER_SEED):
        lines += [ex.prompt.user, ex.response]
    return lines


def base_config(recipe: BaseJudgeRecipe, tok: Any) -> Any:
    """The Qwen3-VL config of the recipe; special-token ids from `tok`."""
    from pjray.models.tiny import QWEN_SPECIAL_TOKENS, vlm_config

    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    head_dim = recipe.hidden // recipe.heads
    # Interleaved M-RoPE sections (t, h, w) over head_dim / 2 frequencies.
    half = head_dim // 2
    sections = [half - 2 * (half // 3), half // 3, half // 3]
    text = {
        "vocab_size": len(tok),
        "hidden_size": recipe.hidden,
        "intermediate_size": 4 * recipe.hidden,
        "num_hidden_layers": recipe.layers,
        "num_attention_heads": recipe.heads,
        "num_key_value_heads": recipe.heads,
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e4,
            "mrope_section": sections,
            "mrope_interleaved": True,
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
    }
    grid = recipe.model_image_size // recipe.patch_size  # patches per side
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "out_hidden_size": recipe.hidden,
        "num_heads": 2,
        "patch_size": recipe.patch_size,
        "spatial_merge_size": recipe.merge_size,
        "temporal_patch_size": 2,
        "num_position_embeddings": grid * grid,
        "deepstack_visual_indexes": [0],
    }
    return vlm_config("qwen3_vl", tok, text, vision)


def build_untrained(out_dir: str, recipe: BaseJudgeRecipe) -> None:
    """Write the recipe's randomly initialised judge (weights, tokenizer, processor) to `out_dir`."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from pjray.models.families import IMAGE_ONLY_PROCESSORS
    from pjray.models.tiny import CHAT_TEMPLATE, build_tokenizer, image_processor

    tok = build_tokenizer(recipe.vocab_size, tokenizer_corpus(recipe))
    config = base_config(recipe, tok)
    state = torch.random.get_rng_state()
    torch.manual_seed(recipe.seed)
    try:
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    text = config.text_config
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id
    )
    model.save_pretrained(out_dir)
    ip = image_processor(recipe.patch_size, recipe.model_image_size, recipe.merge_size)
    processor = IMAGE_ONLY_PROCESSORS["qwen3_vl"](image_processor=ip, tokenizer=tok, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)


# Auxiliary targets of the perception front-end, read from its one image token: (name, classes).
AUX_TARGETS: tuple[tuple[str, int], ...] = (
    ("color", len(COLORS)),
    ("shape", len(SHAPES)),
    ("size", len(SIZES)),
    ("row", 3),
    ("col", 3),
)


def object_targets(scene: Scene) -> torch.Tensor:
    """[5] long: the colour, shape, size, row and column of a one-object scene's object."""
    (o,) = scene.objects
    return torch.tensor([COLORS.index(o.color), SHAPES.index(o.shape), SIZES.index(o.size), o.row, o.col])


def pretrain_vision(model: Any, processor: Any, recipe: BaseJudgeRecipe, log: Any = None) -> dict[str, float]:
    """Train the vision tower and merger to read the one object's colour, shape, size, row and
    column from its one image token (`AUX_TARGETS`, through auxiliary heads dropped afterwards).
    The tower is frozen in every later stage (`model.freeze_vision`).

    Returns accuracies per target on scenes of the held-out content split (combinations of
    shape and cell the front-end never saw)."""
    from pjray.data.images import decode_image

    visual = model.model.visual
    width = model.config.text_config.hidden_size
    with torch.random.fork_rng():  # the heads' initialisation is part of the recipe
        torch.manual_seed(recipe.seed)
        heads = torch.nn.ModuleList(torch.nn.Linear(width, n) for _, n in AUX_TARGETS)
    params = [*visual.parameters(), *heads.parameters()]
    optimizer = torch.optim.AdamW(params, lr=recipe.vision_lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, recipe.vision_lr, total_steps=recipe.vision_steps, pct_start=0.1
    )

    def batch(seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scenes = [generate_scene(s, recipe.image_size, 1, 1) for s in seeds]
        enc = processor.image_processor(images=[decode_image(render(s)) for s in scenes], return_tensors="pt")
        return enc["pixel_values"], enc["image_grid_thw"], torch.stack([object_targets(s) for s in scenes])

    def logits(pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        feats = visual(pixels, grid_thw=grid, return_dict=True).pooler_output.reshape(grid.shape[0], width)
        return [h(feats) for h in heads]

    seeds = vision_seeds(recipe, recipe.vision_steps * recipe.vision_batch, recipe.vision_split)  # their own seed range
    visual.train()
    for step in range(recipe.vision_steps):
        start = step * recipe.vision_batch
        pixels, grid, targets = batch(seeds[start : start + recipe.vision_batch])
        out = logits(pixels, grid)
        loss = sum(torch.nn.functional.cross_entropy(o, targets[:, i]) for i, o in enumerate(out))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if log is not None and (step + 1) % 100 == 0:
            log(f"perception front-end: step {step + 1}/{recipe.vision_steps}, loss {loss.item():.3f}")
    visual.eval()
    held_out = vision_seeds(recipe, 256, "held_out", VISION_HELD_OUT_INDEX, recipe.seed + 1)
    with torch.no_grad():
        pixels, grid, targets = batch(held_out)
        out = logits(pixels, grid)
    return {name: float((out[i].argmax(-1) == targets[:, i]).float().mean()) for i, (name, _) in enumerate(AUX_TARGETS)}
