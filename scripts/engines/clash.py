"""Print the engines' pinned packages that this venv holds at another version (none: nothing).

    python scripts/engines/clash.py scripts/engines/*.txt

scripts/test.sh installs the engines beside the running tests only when this prints nothing: the
install then adds packages and replaces none that a running test may have imported.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name.lower())


def pins(paths: list[str]) -> dict[str, str]:
    """Every `name==version` line of the pin files, by canonical name."""
    found: dict[str, str] = {}
    for path in paths:
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                name, _, version = line.split("#")[0].strip().partition("==")
                if version:
                    found[canonical(name)] = version
    return found


def clashes(paths: list[str]) -> list[str]:
    """`name installed (pinned version)` for each pin the venv holds at another version."""
    have = {canonical(d.name): d.version for d in importlib.metadata.distributions()}
    return sorted(f"{n} {have[n]} (pinned {v})" for n, v in pins(paths).items() if have.get(n, v) != v)


if __name__ == "__main__":
    print(", ".join(clashes(sys.argv[1:])))
