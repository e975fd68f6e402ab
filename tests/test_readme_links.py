"""Every relative link of README.md, deploy/README.md and the docs/ pages names a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


DOCS = ["README.md", "deploy/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS)
def test_every_link_names_a_file(doc: str) -> None:
    path = ROOT / doc
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text())
    if doc in ("README.md", "deploy/README.md", "docs/ARCHITECTURE.md"):
        assert len(links) >= 5  # the pages a reader starts from link onwards
    missing = [link for link in links if "://" not in link and not (path.parent / link).exists()]
    assert not missing, f"{doc} links to files that do not exist: {missing}"
