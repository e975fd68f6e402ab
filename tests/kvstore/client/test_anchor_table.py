"""AnchorTable.ends, the one-probe form of `best` a guessed next turn uses (C7): it says whether a chain's
own end is a kept anchor, exactly when `best` of that chain is its whole length."""

from __future__ import annotations

import os
import random

from kvstore.client.lookup_anchors import AnchorTable


def test_ends_is_best_of_the_whole_chain() -> None:
    rng = random.Random(7)
    chain = [os.urandom(32) for _ in range(400)]
    for _ in range(300):
        table = AnchorTable(max_entries=8)
        for _ in range(rng.randrange(0, 12)):
            at = rng.randrange(64, 401)
            # a noted depth that is not the hash's own (another chain's count) now and then: ends must not take it
            table.note(chain[at - 1], at if rng.random() < 0.8 else rng.randrange(64, 401))
        blocks = rng.randrange(64, 401)
        whole = table.best(chain[:blocks]) == blocks
        assert table.ends(chain[blocks - 1], blocks) == whole


def test_ends_moves_the_anchor_to_the_recent_end() -> None:
    table = AnchorTable(max_entries=2)
    a, b, c = os.urandom(32), os.urandom(32), os.urandom(32)
    table.note(a, 64)
    table.note(b, 64)
    assert table.ends(a, 64)  # a is now the most recent: c's note drops b
    table.note(c, 64)
    assert table.ends(a, 64) and not table.ends(b, 64) and table.ends(c, 64)
