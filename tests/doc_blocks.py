"""The fenced code blocks of README.md and docs/*.md, read one way for every doc test.

``tests/cli/test_docs_run.py`` runs them, ``tests/cli/test_docs_links.py`` ignores them
when it collects headings, ``tests/state/test_resume.py`` takes documented loops from
them. A block is what a reader sees: its language tag, its text, the line of its opening
fence, and the ``<!-- docs-test: ... -->`` comment written right above it, if any (how
the doc test runs it, e.g. ``skip: why`` or ``torchrun 2``; the comment does not render).

Invariants:
- blocks come in document order, each exactly once; a fence opens with three or more
  backticks (indented fences inside list items too) and closes with the same fence;
- ``line`` is the 1-based line of the opening fence, so ``f"{path.name}:{line}"`` points
  a reader at the block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<what>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: ``lang`` is the first word of its info string (``""`` untagged)."""

    path: Path
    line: int
    lang: str
    text: str
    marker: str | None = None
    end: int = 0  # the line of the closing fence

    @property
    def where(self) -> str:
        """``README.md:31``, ``docs/resume.md:140``: where a reader finds the block."""
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of one markdown file, in order."""
    lines = Path(path).read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        lang = (m["info"].split() or [""])[0].lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = _MARKER.match(lines[k]) if k >= 0 else None
        found.append(Block(Path(path), i + 1, lang, "\n".join(body) + "\n",
                           marker["what"] if marker else None, j + 1))
        i = j + 1
    return found


def prose(path: Path) -> str:
    """The file's text with every fenced block removed (headings, links, paragraphs)."""
    lines = Path(path).read_text().splitlines()
    inside = {n for b in blocks(path) for n in range(b.line, b.end + 1)}
    return "\n".join(line for n, line in enumerate(lines, 1) if n not in inside) + "\n"
