"""Is image-following robust to how the held-out tuples are built? One judge, several constructions.

    python benchmarks/looking_constructions.py                          # the default run's judge (runs/demo/hf_model)
    python benchmarks/looking_constructions.py --judge DIR --per-kind 96

An independent implementation of the looking protocol agreed with pjray on the default run's
colour image-following but not on size (50% against 78%). This measures which detail of the
construction moves the rate, on the same judge, greedy, every variant against the base judge
forced onto its image disposition (the comparator of every claim):

| variant | tuples | letters |
|---|---|---|
| `primary` | pjray's: independent K = 3 tuples of the held-out split, the perception error's value drawn among the wrong ones | balanced per kind (each letter shows the correct and the perception-error answer equally often) |
| `letters_per_item` | the same tuples | a seeded random order per item, not balanced |
| `size_adjacent` | size tuples whose perception error is the neighbouring size (small <-> medium <-> large) | balanced |
| `size_far` | size tuples whose perception error is the opposite extreme (small <-> large) | balanced |

The swapped image shows the perception error's value, so an adjacent error asks the judge to
tell medium from small or large, a far one small from large. Each variant's tuples are drawn
from one pool of held-out scenes (`SEED`), checked by content against the base judge's training
items; `--per-kind` a kind and variant. Per variant and kind: image-following with its 95% Wilson
interval, correct first, the paired swap test, and the paired test against the forced base judge.
Not varied here: the reasoning error's kind (pjray's independent construction draws it among the
answer's free steps). The base judge is the shipped one (`SHIPPED_INIT`; one disposition, so its
forced run is its plain run); the committed looking_constructions.* were measured on the default
run's judge when the shipped base judge was `model.init=base_judge`, beside it forced.

Writes looking_constructions.{md,json} into benchmarks/results (or --out DIR).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

from pjray.data.scenes import SIZES
from pjray.eval.held_out import assert_held_out, judge_on, training_items
from pjray.eval.looking import K, LookingItem, balanced_letters, ceiling_test, looking_items, swap_test
from pjray.models.base_judge import BaseJudgeRecipe
from pjray.ppjd.perturb import scene_items
from pjray.recipes.base_judge import RECIPES, SHIPPED, SHIPPED_INIT

ROOT = Path(__file__).resolve().parents[1]
SEED = 20261206  # the pool of held-out scenes
LETTERS_SEED = 8105  # the held-out check's


def pool(kind: str, n: int, image_size: int, objects: tuple[int, int]) -> list[LookingItem]:
    """`n` independent tuples of one kind under their three images (letters not yet balanced)."""
    items = scene_items(n, SEED + len(kind), K, image_size, (kind,), objects, "held_out", "independent")
    return looking_items(items, LETTERS_SEED)


def distance(item: LookingItem) -> int:
    """How far the perception error's size is from the true one (1: adjacent, 2: far)."""
    truth, swapped_to = item.pair.shown
    return abs(SIZES.index(truth) - SIZES.index(swapped_to))


def rebalanced(items: list[LookingItem]) -> list[LookingItem]:
    """The same tuples with their letters balanced again (a selection unbalances them)."""
    return looking_items([it.pair.original for it in items], LETTERS_SEED)


def per_item_letters(items: list[LookingItem]) -> list[LookingItem]:
    rng = random.Random(SEED)
    return [replace(it, shown=tuple(rng.sample(it.pair.original.order, K))) for it in items]


def variants(per_kind: int, image_size: int, objects: tuple[int, int]) -> dict[str, list[LookingItem]]:
    colour, size = pool("color", per_kind, image_size, objects), pool("size", 6 * per_kind, image_size, objects)
    primary = rebalanced(colour[:per_kind] + size[:per_kind])
    adjacent = [it for it in size if distance(it) == 1]
    far = [it for it in size if distance(it) == 2]
    if min(len(adjacent), len(far)) < per_kind:
        raise SystemExit(
            f"the pool holds {len(adjacent)} adjacent and {len(far)} far size tuples; need {per_kind} of each"
        )
    out = {
        "primary": primary,
        "letters_per_item": per_item_letters(primary),
        "size_adjacent": rebalanced(adjacent[:per_kind]),
        "size_far": rebalanced(far[:per_kind]),
    }
    for name in ("primary", "size_adjacent", "size_far"):
        balanced_letters(out[name])
    return out


def measure(judge: Path, base: Path, sets: dict[str, list[LookingItem]], recipe: BaseJudgeRecipe) -> dict:
    results = {}
    for name, items in sets.items():
        started = time.perf_counter()
        trained, judged = judge_on(str(judge), items, forced=False, recipe=recipe)
        forced, base_verdicts = judge_on(str(base), items, forced=True, recipe=recipe)
        ceiling = ceiling_test(base_verdicts, judged)
        kinds = {}
        for kind, looks in trained["looks"].items():
            if kind == "pooled":
                continue
            mine = [v for v in judged if v.kind == kind]
            kinds[kind] = {
                "items": looks["items"],
                "image_following": looks["image_following"],
                "ci": looks["image_following_ci"],
                "correct_first": looks["correct_first"],
                "swap_test": swap_test(mine),
                "forced_base_image_following": forced["looks"][kind]["forced"]["image_following"],
                "vs_forced": ceiling[kind],
                "adjacent_share": (
                    round(sum(distance(it) == 1 for it in items if it.kind == kind) / looks["items"], 4)
                    if kind == "size"
                    else None
                ),
            }
        results[name] = {"kinds": kinds, "seconds": round(time.perf_counter() - started, 1)}
        print(f"{name}: {json.dumps({k: v['image_following'] for k, v in kinds.items()})}", flush=True)
    return results


def markdown(out: dict) -> str:
    lines = [
        "# Image-following under several tuple constructions",
        "",
        f"`python benchmarks/looking_constructions.py --per-kind {out['per_kind']}` on `{out['judge']}` "
        f"(greedy; the base judge forced onto its image disposition beside it). **One judge, one run** "
        "(the seed-0 default run); intervals are 95% Wilson intervals over items.",
        "",
        "| variant | kind | n | adjacent errors | image-following [95%] | correct first | perception error first, "
        "original -> swapped (swap test p) | forced base judge | vs forced: b / c, p |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, got in out["variants"].items():
        for kind, r in got["kinds"].items():
            s, v = r["swap_test"], r["vs_forced"]
            adjacent = "" if r["adjacent_share"] is None else f"{r['adjacent_share']:.0%}"
            lines.append(
                f"| {name} | {kind} | {r['items']} | {adjacent} | {r['image_following']:.0%} [{r['ci'][0]:.0%}, {r['ci'][1]:.0%}] | "
                f"{r['correct_first']:.0%} | {s['perception_error_first_original']:.0%} -> "
                f"{s['perception_error_first_swapped']:.0%} ({s['p']:.2g}) | {r['forced_base_image_following']:.0%} | "
                f"{v['b']} / {v['c']}, {v['p']:.2g} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--judge", default=str(ROOT / "runs" / "demo" / "hf_model"), help="the trained judge (HF dir)")
    parser.add_argument("--per-kind", type=int, default=96, help="tuples a kind and variant (a multiple of 6)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    judge = Path(args.judge)
    if not (judge / "config.json").is_file():
        raise SystemExit(
            f"{judge}: no judge there; run `pjray train` first (the default run writes runs/demo/hf_model)"
        )
    recipe = RECIPES[SHIPPED_INIT]  # the shipped base judge, the default run's start
    sets = variants(args.per_kind, recipe.image_size, tuple(recipe.objects))
    shown = [x for items in sets.values() for it in items for x in (it.pair.original, it.pair.swapped, it.blank)]
    assert_held_out(shown, training_items(recipe))
    out = {
        "judge": str(judge.resolve().relative_to(ROOT)) if judge.resolve().is_relative_to(ROOT) else judge.name,
        "per_kind": args.per_kind,
        "seed": SEED,
        "variants": measure(judge, SHIPPED / "hf_model", sets, recipe),
    }
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "looking_constructions.json").write_text(json.dumps(out, indent=1))
    (dest / "looking_constructions.md").write_text(markdown(out))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
