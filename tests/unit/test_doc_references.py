"""The docs and docstrings name only what exists: every `pjray.module[.name]` resolves to a module
and a top-level name in it, every repository path (`pjray/...`, `benchmarks/...`, `configs/...`,
`clusters/...`, `tests/...`) is a file or folder, and every relative markdown link reaches a file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
DOCS = sorted(
    [
        *REPO.glob("*.md"),
        *REPO.glob("configs/*.md"),
        *REPO.glob("clusters/*.md"),
        *REPO.glob("benchmarks/*.md"),
        *REPO.glob("benchmarks/results/*.md"),
    ]
)
SOURCES = sorted(
    p
    for p in [*REPO.glob("pjray/**/*.py"), *REPO.glob("benchmarks/*.py"), *REPO.glob("tests/**/*.py")]
    if p != Path(__file__)
)  # this file names missing things on purpose

# Not right after a quote: a string constant such as a random generator's namespace
# ("pjray.scenes.qa:{seed}") or a store prefix names nothing.
MODULE_REF = re.compile(r"(?<![\w./\"'-])pjray(?:\.[A-Za-z_]\w*)+")
PATH_REF = re.compile(r"(?<![\w./\"'-])(?:pjray|benchmarks|configs|clusters|tests)/[\w./-]*\w")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
TOP_LEVEL = (
    r"^(?:def|class|async def) {name}\b|^{name}\s*(?::[^=\n]*)?=|^from \S+ import .*\b{name}\b|^import .*\b{name}\b"
)


def _module_file(parts: list[str]) -> Path | None:
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_reference_ok(ref: str) -> bool:
    """`pjray.a.b[.name[.attr]]`: the longest prefix that is a module, then a top-level name of it
    (an attribute after that name is not checked)."""
    parts = ref.split(".")
    for cut in range(len(parts), 0, -1):
        found = _module_file(parts[:cut])
        if found is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        pattern = TOP_LEVEL.format(name=re.escape(rest[0]))
        return (
            re.search(pattern, found.read_text(encoding="utf-8"), re.M) is not None or (found.parent / rest[0]).exists()
        )
    return False


def _references(text: str) -> tuple[set[str], set[str]]:
    modules = {m.rstrip(".") for m in MODULE_REF.findall(text)}
    paths = {p.rstrip(".") for p in PATH_REF.findall(text)}
    return modules, paths


def _missing(text: str, where: Path) -> list[str]:
    modules, paths = _references(text)
    bad = [f"{where.relative_to(REPO)}: module {m}" for m in sorted(modules) if not module_reference_ok(m)]
    bad += [f"{where.relative_to(REPO)}: path {p}" for p in sorted(paths) if not path_exists(p)]
    return bad


def path_exists(ref: str) -> bool:
    """A file or folder; or, in prose, a module by its stem ("pjray/eval/looking") or the stem of
    a set of files ("benchmarks/results/bias_study" for bias_study.{json,md,png})."""
    path = REPO / ref
    if path.exists() or path.with_suffix(".py").exists():
        return True
    return path.parent.is_dir() and any(p.name.startswith(path.name + ".") for p in path.parent.iterdir())


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_name_only_what_exists(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    bad = _missing(text, doc)
    for link in MD_LINK.findall(text):
        if "://" in link or link.startswith("mailto:"):
            continue
        if not (doc.parent / link).exists():
            bad.append(f"{doc.relative_to(REPO)}: link {link}")
    assert bad == []


def test_docstrings_and_comments_name_only_what_exists() -> None:
    bad = []
    for source in SOURCES:
        bad += _missing(source.read_text(encoding="utf-8"), source)
    assert bad == []


def test_the_checker_sees_a_stale_name() -> None:
    assert module_reference_ok("pjray.eval.looking.swap_test") and module_reference_ok("pjray.rl")
    assert not module_reference_ok("pjray.rl.grpo.ban_tokens") and not module_reference_ok("pjray.nothing_here")
    assert _missing("see benchmarks/study_bias.py", REPO / "README.md") == ["README.md: path benchmarks/study_bias.py"]
