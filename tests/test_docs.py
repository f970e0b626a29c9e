"""The docs stay a manual: README.md within its line limit and free of benchmark run ids (those live in
docs/benchmarks.md), ``benchmarks/results/`` within its file limit (older runs are lines of its
``history.jsonl``), every run the docs cite still findable, and every relative markdown link between
the docs pointing at a file and heading that exist.

A one-time fold does not hold on its own: the README grew back to 410 lines and the results folder to
124 files after the last one, so the limits are tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cbgen_bench.history import HISTORY_NAME, MAX_RESULT_FILES

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
README_MAX_LINES = 350
RESULTS_MAX_FILES = 16

# A run is ``bench-YYYYmmdd-HHMMSS``; the docs cite it in full or, where the date is clear, by its
# last six digits in backticks (`030005`).
_FULL_RUN = re.compile(r"\b(20\d{6}-\d{6})\b")
_SHORT_RUN = re.compile(r"`(\d{6})`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _docs() -> list[Path]:
    """The markdown pages: README, docs/, and benchmarks/ (not the per-run tables in results/)."""
    pages = [README, *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
    return [p for p in pages if p.is_file()]


def _known_runs() -> set[str]:
    """Stamps (``YYYYmmdd-HHMMSS``) of every run in the history or still kept as files."""
    stamps = {p.name.split("-", 1)[1].rsplit(".", 1)[0] for p in RESULTS.glob("bench-*.json")}
    history = RESULTS / HISTORY_NAME
    for line in history.read_text().splitlines():
        if line.strip():
            stamps.add(json.loads(line)["run"].removeprefix("bench-"))
    return stamps


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation other than ``-`` and ``_`` dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_readme_within_its_line_limit() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (limit {README_MAX_LINES}): it is the manual; move measurements "
        "and history to docs/benchmarks.md or the docs page of the feature, and link to it"
    )


def test_readme_cites_no_run_ids() -> None:
    text = README.read_text()
    runs = _FULL_RUN.findall(text) + _SHORT_RUN.findall(text)
    assert not runs, f"README.md cites benchmark runs {runs}: run ids belong in docs/benchmarks.md"


def test_results_within_their_file_limit() -> None:
    files = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file())
    assert len(files) <= RESULTS_MAX_FILES, (
        f"benchmarks/results holds {len(files)} files (limit {RESULTS_MAX_FILES}): "
        f"`python -m cbgen_bench.history` moves older runs into {HISTORY_NAME}"
    )
    # The harness prunes every run to this limit itself, so a run cannot push the folder over it.
    assert MAX_RESULT_FILES <= RESULTS_MAX_FILES


def test_every_cited_run_is_findable() -> None:
    known = _known_runs()
    missing = []
    for page in _docs():
        text = page.read_text()
        rel = page.relative_to(ROOT)
        missing += [f"{rel}: {s}" for s in _FULL_RUN.findall(text) if s not in known]
        missing += [f"{rel}: {s}" for s in _SHORT_RUN.findall(text) if not any(k.endswith(s) for k in known)]
    assert not missing, f"runs cited but neither in {HISTORY_NAME} nor kept as files: {missing}"


def test_markdown_links_resolve() -> None:
    broken = []
    for page in _docs():
        for target in _LINK.findall(_FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            rel = page.relative_to(ROOT)
            if not dest.exists():
                broken.append(f"{rel}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{rel}: {target} (no such heading)")
    assert not broken, f"markdown links to nothing: {broken}"
