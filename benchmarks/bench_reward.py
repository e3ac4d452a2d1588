"""Throughput of the judge reward (parse + ranking reward) on a realistic mix of responses.

Each case is timed twice in the same run: `judge_reward` as shipped (python-Levenshtein, C), and
a baseline that runs the same parser but a plain-Python dynamic-programming edit distance. The
ratio column is judge_reward's rate over the baseline's. Two more rows time the distance alone.

    python benchmarks/bench_reward.py [--seconds 1.0] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import Levenshtein

from pjray.reward import judge_reward, parse_judgment

WORDS = (
    "the image shows a red car parked next to two people near building left side answer claims "
    "blue which contradicts visual evidence count of objects is three not four reasoning step "
    "assistant correctly identifies color but misreads the sign text in background so its final "
    "conclusion follows from a wrong premise while other answer is fluent"
).split()


def python_levenshtein(a: str, b: str) -> int:
    """Edit distance by the textbook two-row dynamic programme, in plain Python."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def baseline_reward(text: str, target: str, style: str = "ranking") -> float:
    """The same reward as judge_reward(metric="levenshtein"), with the plain-Python distance."""
    j = parse_judgment(text, len(target), style=style)
    if j.ranking is None:
        return 0.0
    ranking = max(0.0, 1.0 - python_levenshtein(j.ranking, target) / len(target))
    return ranking if j.format_ok else 0.0


def think_text(rng: random.Random, lo: int = 1000, hi: int = 2000) -> str:
    """Pseudo reasoning of lo..hi characters."""
    n, words = rng.randint(lo, hi), []
    while sum(map(len, words)) + len(words) < n:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def ranking_response(rng: random.Random, ranking: str, think: str) -> str:
    sep = rng.choice([" > ", ">", "", ", "])
    return f"<think>\n{think}\n</think>\n\n<answer>{sep.join(ranking)}</answer>"


def scores_response(rng: random.Random, ranking: str, think: str) -> str:
    # Distinct scores consistent with `ranking`, listed in letter order.
    values = sorted(rng.sample(range(1, 11), len(ranking)), reverse=True)
    score_of = dict(zip(ranking, values))
    answers = "".join(f"<answer>{score_of[c]}</answer>" for c in sorted(ranking))
    return f"<think>\n{think}\n</think>\n\n{answers}"


def bad_response(rng: random.Random, target: str, think: str) -> str:
    kind = rng.randrange(5)
    if kind == 0:  # no think block
        return f"{think}\n<answer>{' > '.join(target)}</answer>"
    if kind == 1:  # duplicated letter
        return f"<think>{think}</think><answer>{target[0]} > {target[0]} > {target[1:]}</answer>"
    if kind == 2:  # two answers
        return f"<think>{think}</think><answer>{target}</answer><answer>{target[::-1]}</answer>"
    if kind == 3:  # truncated at max_new_tokens
        return f"<think>{think}"
    return f"<think>{think}</think><answer>The best answer is {target[0]}.</answer>"  # prose


Row = tuple[str, str, str]  # (response, target, style)


def make_cases(seed: int, n: int = 200) -> list[tuple[str, list[Row]]]:
    """(name, rows) for each benchmark case, n responses each."""
    rng = random.Random(seed)

    def target(k: int = 3) -> str:
        return "".join(rng.sample("ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:k], k))

    def case(make: Callable[[str], str], k: int = 3, style: str = "ranking") -> list[Row]:
        return [(make(t), t, style) for t in (target(k) for _ in range(n))]

    cases = [
        ("K=3 correct, short think", case(lambda t: ranking_response(rng, t, think_text(rng, 150, 300)))),
        ("K=3 random order, 1-2k think", case(lambda t: ranking_response(rng, target(), think_text(rng)))),
        ("K=3 bad format, 1-2k think", case(lambda t: bad_response(rng, t, think_text(rng)))),
        (
            "K=3 scores style, 1-2k think",
            case(lambda t: scores_response(rng, target(), think_text(rng)), style="scores"),
        ),
        ("K=8 random order, 1-2k think", case(lambda t: ranking_response(rng, target(8), think_text(rng)), k=8)),
        ("K=26 random order, 1-2k think", case(lambda t: ranking_response(rng, target(26), think_text(rng)), k=26)),
    ]
    # A training-like mix of the K=3 cases: right and wrong orders, bad formats, scores style.
    mix = [row for _, rows in cases[:4] for row in rows]
    rng.shuffle(mix)
    cases.append(("K=3 mix of the above", mix))
    return cases


def race(fn: Callable[[], object], baseline: Callable[[], object], seconds: float) -> tuple[int, float, float]:
    """Alternate one round of fn and one of baseline until `seconds` pass in all.

    Interleaving makes both see the same machine load. Returns (rounds, fn seconds, baseline
    seconds).
    """
    rounds, t_fn, t_base = 0, 0.0, 0.0
    while t_fn + t_base < seconds:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        baseline()
        t_fn, t_base = t_fn + (t1 - t0), t_base + (time.perf_counter() - t1)
        rounds += 1
    return rounds, t_fn, t_base


def table_rows(name: str, n: int, raced: tuple[int, float, float]) -> list[tuple]:
    """Two table rows, the shipped function then the baseline, from a race of n calls a round."""
    rounds, secs, b_secs = raced
    rate, b_rate = rounds * n / secs, rounds * n / b_secs
    return [
        (name, rounds * n, secs, rate, rate / b_rate),
        ("  baseline: py-DP distance", rounds * n, b_secs, b_rate, 1.0),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="time per table row")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    table = []
    for name, rows in make_cases(args.seed):
        # Same inputs, same answers: the shipped reward and the baseline must agree.
        for text, t, st in rows:
            a, b = judge_reward(text, t, style=st).total, baseline_reward(text, t, st)
            assert abs(a - b) < 1e-12, (name, text[-80:], a, b)
        result = race(
            lambda: [judge_reward(x, t, style=st) for x, t, st in rows],
            lambda: [baseline_reward(x, t, st) for x, t, st in rows],
            2 * args.seconds,
        )
        table += table_rows(name, len(rows), result)

    for k in (3, 26):
        rng = random.Random(args.seed)
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:k]
        pairs = [("".join(rng.sample(letters, k)), "".join(rng.sample(letters, k))) for _ in range(200)]
        result = race(
            lambda: [Levenshtein.distance(a, b) for a, b in pairs],
            lambda: [python_levenshtein(a, b) for a, b in pairs],
            2 * args.seconds,
        )
        table += table_rows(f"distance only, K={k} (C)", len(pairs), result)

    widths = (32, 9, 7, 11, 17)
    names = ("case", "calls", "seconds", "rewards/s", "ratio vs baseline")
    cells = [f"{names[0]:<{widths[0]}}"] + [f"{c:>{w}}" for c, w in zip(names[1:], widths[1:])]
    print("| " + " | ".join(cells) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for name, calls, secs, r, ratio in table:
        print(f"| {name:<32} | {calls:>9} | {secs:>7.2f} | {r:>11,.0f} | {ratio:>16.2f}x |")


if __name__ == "__main__":
    main()
