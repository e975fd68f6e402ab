"""A Lookup's answer as the client hands it back (`kvstore.client.store.Client.lookup`).

Kept outside `kvstore.client` so that code which only reads or makes answers (the resume planner's
decision, `kvstore trace simulate` on virtual time) does not import the clients, their gRPC stubs and
the SWA pool's Redis path: the simulation's start is a share of its 10 s target (docs/BENCHMARKS.md,
`kvstore bench trace`). `kvstore.client` re-exports it: the same class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.prefix_hosts import PrefixHost


@dataclass(frozen=True, kw_only=True)
class LookupResult:
    """How much of a prompt is loadable now."""

    found_blocks: int
    found_tokens: int
    lease_id: str | None
    #: The prompt's chain hashes from its first block (a list, or the client's memo's `HashChain`, which
    #: shares the kept hashes: index and slice it, or `list()` it).
    block_hashes: Sequence[bytes] = field(repr=False)
    #: T of the asked snapshot that serves the longest resume (`lookup(swa_positions=...)`), else None.
    swa_position: int | None = None
    #: R, the length that snapshot resumes at (T, T - 1, or shorter below the window; at most
    #: found_tokens), else None (docs/SWA_POOL.md "Resume rules").
    swa_resume_tokens: int | None = None
    #: The pin granted when one was asked (`pin`, `lookup(keep_until_s=)`; 0: none) and why less
    #: (docs/RETENTION.md R22-R24).
    kept_until_s: float = 0.0
    keep_note: str = ""
    #: With `lookup(hosts=True)`: the nodes holding the found prefix on their hosts (`kvstore.prefix_hosts`).
    hosts: tuple[PrefixHost, ...] = ()
