"""Every relative link of README.md and deploy/README.md names a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("doc", ["README.md", "deploy/README.md"])
def test_every_link_names_a_file(doc: str) -> None:
    path = ROOT / doc
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text())
    assert len(links) >= 5
    missing = [link for link in links if "://" not in link and not (path.parent / link).exists()]
    assert not missing, f"{doc} links to files that do not exist: {missing}"
