"""The server's start-up heap frozen out of the cyclic collector's sight (gateway/startup_heap.py).

A full collection under load walked every object start-up made (18-27 ms with every call in flight waiting,
`kvstore bench load` at 16 clients on the dev box); frozen, it walks only what was allocated since.
"""

from __future__ import annotations

import gc
import re
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstore
from gateway.startup_heap import freeze_startup_heap
from tests.children import Child
from tests.waiting import wait_until


class _Node:
    """A tracked object that can hold a reference cycle."""

    me: object = None


@pytest.fixture
def thawed() -> Iterator[None]:
    """Undo the freeze after the test: the rest of the session's objects go back to the collector."""
    yield
    gc.unfreeze()


def _tracked(obj: object) -> bool:
    """Whether the collector's generations hold `obj` (a full collection would walk it)."""
    return any(o is obj for o in gc.get_objects())


def test_objects_alive_at_start_leave_the_collectors_sight_and_its_garbage_goes_first(thawed: None) -> None:
    kept = _Node()
    kept.me = kept  # alive: frozen, never walked again
    lost = _Node()
    lost.me = lost  # start-up's garbage: a cycle only the collector frees
    gone = weakref.ref(lost)
    del lost
    frozen = freeze_startup_heap()
    assert gone() is None, "start-up's garbage was frozen with the live heap instead of collected"
    # The count only falls after the freeze (a frozen object another thread frees leaves it; under xdist an earlier
    # test's threads may), and nothing joins it without another freeze: reading it again equal was a race.
    assert 1 <= gc.get_freeze_count() <= frozen
    assert not _tracked(kept)
    later = _Node()
    later.me = later
    assert _tracked(later), "what the server allocates after the freeze is still collected"


def test_kvstore_serve_freezes_its_start_up_heap_and_serves(tmp_path: Path) -> None:
    child = Child("serve", ["serve", "--port", "0", "--data-dir", str(tmp_path / "data")], tmp_path / "logs")
    try:
        pattern = r"kvstore heap: ([\d,]+) start-up objects frozen"
        wait_until(lambda: re.search(pattern, child.out_path.read_text()), "the server's heap line")
        match = re.search(pattern, child.out_path.read_text())
        assert match is not None
        # The modules, descriptors and tables start-up made: thousands (~45,000 in a bare `kvstore serve`).
        assert int(match.group(1).replace(",", "")) > 10_000
        with kvstore.Client(child.target) as client:
            tokens = list(range(client.block_tokens * 2))
            client.put(tokens, [bytes(client.block_bytes)] * 2)
            assert client.lookup(tokens).found_blocks == 2
        assert child.stop() == 0
    finally:
        child.kill_if_alive()
