"""The docs a newcomer reads: figures that match their JSON, links that resolve, nothing dropped.

* Every figure of README.md and benchmarks/README.md is generated from ``benchmarks/results/*.json``
  by ``benchmarks/figures.py``; regenerated here, a region that differs from the file fails, with
  the diff (a hand-edited figure, or a JSON committed without rerunning the generator).
* Relative links of README.md, docs/, benchmarks/ and benchmarks/history/ point at files that
  exist, and their ``#anchors`` at headings that exist; so do ``some.md#anchor`` references written
  in code and docs.
* benchmarks/README.md was 1,865 lines of write-ups until issue 57 split them into one page per
  benchmark under benchmarks/history/: every heading it had (``fixtures/benchmarks_readme_headings.txt``)
  is a heading of some page, and, where git has the old file, every line of it is in some page.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from polar_testing.benchmarks import BENCHMARKS

REPO = Path(__file__).resolve().parents[1]
#: The last commit of benchmarks/README.md before it was split into benchmarks/history/.
SPLIT_FROM = "30938b773ccde0b55826bd6c7a7d02d9ef19cb29"
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MD_REF = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)")


def load_figures():
    """benchmarks/figures.py as a module (registered first: its dataclasses look their module up)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("polar_figures", BENCHMARKS / "figures.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def markdown_pages() -> list[Path]:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").glob("*.md")),
             *sorted((REPO / "benchmarks" / "history").glob("*.md"))]
    return [p for p in pages if p.exists()]


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            out.append((i, line))
    return out


def headings(text: str) -> list[str]:
    return [m.group(2).strip() for _, line in prose(text) if (m := re.match(r"(#{1,6}) (.*)", line))]


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces -> -)."""
    seen: dict[str, int] = {}
    out = set()
    for h in headings(path.read_text()):
        slug = re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_figures_match_their_json():
    figures = load_figures()
    stale = {rel: (now, new) for rel, (now, new) in figures.expected().items() if now != new}
    if stale:
        import difflib

        diff = "".join(line for rel, (now, new) in stale.items() for line in difflib.unified_diff(
            now.splitlines(True), new.splitlines(True), rel, rel + " (from its JSON)"))
        pytest.fail("figures that disagree with their JSON; run .venv/bin/python benchmarks/figures.py\n" + diff[:6000])


def test_every_figure_names_the_json_it_came_from():
    figures = load_figures()
    assert len(figures.FIGURES) >= 15
    for fig in figures.FIGURES:
        row = fig.row()
        assert row.read, f"{fig.key}: read nothing from a result JSON"
        assert (REPO / "benchmarks" / "history" / f"{row.page}.md").exists(), (fig.key, row.page)


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    bad = []
    for n, line in prose(page.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.relative_to(REPO)}:{n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.relative_to(REPO)}:{n}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_md_anchor_references_in_code_and_docs_resolve():
    """``benchmarks/README.md#x`` and the like, written in a docstring or a page, name a heading."""
    bad, checked = [], 0
    roots = ["README.md", "docs", "benchmarks", "scripts", "tests", "addon", "polar_core", "polar_analysis",
             "polar_runtime", "polar_trial", "polar_testing", "training", "notebooks"]
    for root in roots:
        base = REPO / root
        files = [base] if base.is_file() else [p for p in base.rglob("*") if p.suffix in (".py", ".md", ".sh", ".toml")]
        for path in files:
            if "fixtures" in path.parts or path == Path(__file__):
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for file, anchor in MD_REF.findall(line):
                    dest = next((d for d in (path.parent / file, REPO / file) if d.is_file()), None)
                    if dest is None:
                        continue  # not a path of this repository (an example, another project's file)
                    checked += 1
                    if anchor not in anchors(dest):
                        bad.append(f"{path.relative_to(REPO)}:{n}: {file}#{anchor}")
    assert not bad, "references to headings that do not exist:\n" + "\n".join(bad)


def _all_pages_text() -> list[str]:
    return [p.read_text() for p in [REPO / "benchmarks" / "README.md", *(REPO / "benchmarks" / "history").glob("*.md")]]


def test_every_former_benchmarks_heading_lands_in_a_page():
    former = [re.sub(r"^#+ ", "", h) for h in
              (REPO / "tests" / "fixtures" / "benchmarks_readme_headings.txt").read_text().splitlines() if h]
    assert len(former) == 30
    now = {h for text in _all_pages_text() for h in headings(text)}
    missing = [h for h in former if h not in now]
    assert not missing, "headings of the former benchmarks/README.md in no page:\n" + "\n".join(missing)


def test_every_line_of_the_former_benchmarks_readme_lands_in_a_page():
    proc = subprocess.run(["git", "show", f"{SPLIT_FROM}:benchmarks/README.md"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"git has no {SPLIT_FROM[:7]} here (a shallow clone): {proc.stderr.strip()[:200]}")

    def norm(line: str) -> str:
        return line.lstrip("#").strip()  # headings moved one level up

    now = {norm(line) for text in _all_pages_text() for line in text.splitlines()}
    missing = [line for line in proc.stdout.splitlines() if norm(line) and norm(line) not in now]
    assert not missing, f"{len(missing)} lines of the former benchmarks/README.md in no page:\n" + "\n".join(missing[:20])
