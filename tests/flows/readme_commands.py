"""The commands of README.md's Commands sections, parsed at test time (never a copy that can drift).

A block is one fenced ```bash block under a `### ` heading of the `## Commands` section; its commands are its
lines with `\\` continuations joined and comments dropped, in order (later commands use what earlier ones wrote).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


@dataclass(frozen=True)
class Block:
    section: str  # the ### heading
    index: int  # the block's number within its section
    commands: tuple[str, ...]

    @property
    def id(self) -> str:
        name = re.sub(r"[^a-z0-9]+", "-", self.section.split(":")[0].lower()).strip("-")
        return f"{name}-{self.index}"


def _strip_comment(line: str) -> str:
    """The line without a trailing `# ...` comment (a `#` outside quotes, after whitespace)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands_of(block: str) -> list[str]:
    out, pending = [], ""
    for raw in block.splitlines():
        line = _strip_comment(raw)
        if pending:
            line = pending + " " + line.strip()
            pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if line.strip():
            out.append(line.strip())
    if pending:
        out.append(pending.strip())
    return out


def readme_blocks(text: str | None = None) -> list[Block]:
    text = README.read_text() if text is None else text
    match = re.search(r"^## Commands[ \t]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if match is None:
        raise AssertionError("README.md has no '## Commands' section")
    blocks: list[Block] = []
    for sec in re.finditer(r"^### (.+?)\n(.*?)(?=^### |\Z)", match.group(1), re.M | re.S):
        fenced = re.findall(r"^```(?:bash|sh|shell)[ \t]*\n(.*?)^```", sec.group(2), re.M | re.S)
        for i, body in enumerate(fenced):
            blocks.append(Block(sec.group(1).strip(), i, tuple(commands_of(body))))
    return blocks
