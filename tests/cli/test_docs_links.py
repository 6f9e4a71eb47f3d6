"""Links between README.md and docs/*.md point at files and headings that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from doc_blocks import DOCS, prose


def _anchor(heading: str) -> str:
    """GitHub's slug of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = prose(path)  # a "# comment" inside a code block is no heading
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=[p.name for p in DOCS])
def test_relative_links_resolve(doc: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.exists(), f"{doc.name}: link to a missing file {target!r}"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{doc.name}: link to a missing heading {target!r}"
