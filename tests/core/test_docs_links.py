"""The documentation holds together: every relative link in README.md, CHANGELOG.md, benchmarks/RESULTS.md and
docs/*.md names a file that exists (and, for a Markdown file, a heading that exists where the link names one), and
the README stays a five-minute read: at most 12 KiB, with the test command and the comparison in its first 20
lines."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.conftest import ROOT

README_MAX_BYTES = 12 * 1024
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "RESULTS.md",
            *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text a reader sees as Markdown: fenced blocks and inline code taken out (a link there is not one)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(path: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(path.read_text(encoding="utf-8")))
            if not SCHEME.match(target)]  # http(s), mailto, ...: not checked here


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks too) dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken(path: Path) -> list[str]:
    """Each link of `path` that does not resolve, with why."""
    problems = []
    for target in links(path):
        file, _, anchor = unquote(target).partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with that anchor in {dest.name}")
    return problems


def test_the_documents_exist():
    missing = [str(p.relative_to(ROOT)) for p in documents() if not p.exists()]
    assert not missing, missing


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert not broken(path), f"{path.relative_to(ROOT)}: " + "; ".join(broken(path))


def test_the_readme_is_a_five_minute_read():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, \
        f"README.md is {size:,} bytes, more than {README_MAX_BYTES:,}: move reference to docs/"
    head = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:20]
    assert any(re.search(r"(^|&&\s*)tox\s*(#|$)", line.strip()) for line in head), "the test command `tox`"
    assert any(line.strip().startswith("tox -m compare") for line in head), "the comparison `tox -m compare`"


def test_the_checker_finds_a_broken_link(tmp_path):
    """The checker itself: a missing file, a missing heading and a link inside code (not a link) are told apart."""
    doc = tmp_path / "doc.md"
    (tmp_path / "there.md").write_text("# A heading: with `code`\n\n## Twice\n\n## Twice\n")
    doc.write_text("[ok](there.md#a-heading-with-code) [dup](there.md#twice-1) [web](https://example.com/x)\n"
                   "[gone](nowhere.md) [bad anchor](there.md#nowhere) `[code](not-a-link.md)`\n"
                   "```\n[fenced](not-a-link-either.md)\n```\n")
    assert [p.split(":")[0] for p in broken(doc)] == ["nowhere.md", "there.md#nowhere"]
