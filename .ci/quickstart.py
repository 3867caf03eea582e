"""Print the commands of README.md's Quickstart section, one per line (CI runs them as written).

The section is the text from the `## Quickstart` heading to the next `## ` heading; each ```bash fenced block in it
is one command (its lines joined, `\\` continuations kept as the shell would read them). Standard library only: CI
runs this before anything is installed.
"""

from __future__ import annotations

import re
import sys


def quickstart_commands(readme: str) -> list[str]:
    match = re.search(r"^## Quickstart[ \t]*\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if match is None:
        raise ValueError("README.md has no '## Quickstart' section")
    blocks = re.findall(r"^```(?:bash|sh|shell)[ \t]*\n(.*?)^```", match.group(1), re.M | re.S)
    commands = []
    for block in blocks:
        lines = [line.rstrip() for line in block.splitlines()]
        command = "\n".join(line for line in lines if line and not line.lstrip().startswith("#"))
        if command:
            commands.append(command.replace("\\\n", " "))
    return commands


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "README.md"
    try:
        with open(path, encoding="utf-8") as f:
            commands = quickstart_commands(f.read())
    except (OSError, ValueError) as e:
        print(f"quickstart: {e}", file=sys.stderr)
        return 1
    for command in commands:
        if "\n" in command:  # one command per output line: a multi-line block runs as one `a && b` chain
            command = " && ".join(part.strip() for part in command.split("\n"))
        print(command)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
