"""The fenced code blocks of a Markdown page, as the page shows them: a test runs a page's
own code (tests/system/test_integrator_guide.py), never a copy of it that could drift."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FENCE = "```"


@dataclass(frozen=True)
class CodeBlock:
    language: str  # the first word of the fence's info string ('' for none)
    section: str  # the `## ` heading the block is under ('' before the first)
    text: str
    line: int  # the page's line of the opening fence, for failure messages


def code_blocks(path: Path) -> list[CodeBlock]:
    """Every fenced block of the page, in page order; an unclosed fence fails here."""
    blocks: list[CodeBlock] = []
    section = ""
    opened: tuple[str, int] | None = None
    body: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if opened is None:
            if line.startswith(FENCE):
                info = line[len(FENCE) :].split()
                opened = (info[0] if info else "", number)
                body = []
            elif line.startswith("## "):
                section = line[3:].strip()
        elif line.strip() == FENCE:
            blocks.append(CodeBlock(opened[0], section, "\n".join(body) + "\n", opened[1]))
            opened = None
        else:
            body.append(line)
    assert opened is None, f"{path}:{opened[1]}: a code block is not closed"
    return blocks
