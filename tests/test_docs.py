"""The README and the docs stay true: no merge-conflict markers anywhere in the tree, every relative
link resolves, every docs page is reachable from README.md, and the README stays a front page."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A conflict left in a file: git writes these at the start of a line, with a space and a name after
# the seven characters of the first and the last.
MARKER = re.compile(r"^(<<<<<<< |>>>>>>> )", re.M)


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / p for p in out.decode().split("\0") if p]


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
        return None


def _links(page: Path) -> list[tuple[str, Path]]:
    """(as written, resolved path) of every relative link of a Markdown page, anchors dropped."""
    found = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        found.append((target, (page.parent / target.split("#")[0]).resolve()))
    return found


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            *sorted((REPO / "docs" / "bench_results").rglob("README.md"))]


def test_no_conflict_markers_in_the_tree():
    offenders = []
    for path in _tracked():
        text = _text(path)
        if text is None:
            continue
        for m in MARKER.finditer(text):
            offenders.append(f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}")
    assert not offenders, f"merge-conflict markers left in: {offenders}"


def test_every_relative_link_resolves():
    broken = [f"{page.relative_to(REPO)} -> {written}"
              for page in _pages() for written, target in _links(page) if not target.exists()]
    assert not broken, f"links to nothing: {broken}"


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [(REPO / "README.md").resolve()]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.is_file():
            continue
        seen.add(page)
        todo.extend(target for _, target in _links(page))
    unreached = [str(p.relative_to(REPO)) for p in _pages() if p.resolve() not in seen]
    assert not unreached, f"docs pages no link from README.md reaches: {unreached}"


def test_docs_index_lists_every_page():
    index = {target for _, target in _links(REPO / "docs" / "README.md")}
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md"))
               if p.name != "README.md" and p.resolve() not in index]
    assert not missing, f"docs/README.md does not list: {missing}"


def test_readme_is_a_front_page():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, "README.md grew past a front page: move the detail to docs/"
    # the two set-up commands, and how to put the commands on PATH, said once
    assert "make run" in text and "make test" in text
    assert text.count("source .venv/bin/activate") == 1


def test_guide_lists_every_environment_switch():
    from fastmoe_xpu import settings

    names = set(settings.ENV_NAMES.values())
    guide = (REPO / "docs" / "guide.md").read_text(encoding="utf-8")
    table = set(re.findall(r"^\| `(FASTMOE_[A-Z0-9_]+)`", guide, re.M))
    assert names <= table, f"docs/guide.md's Environment switches table lacks {sorted(names - table)}"
