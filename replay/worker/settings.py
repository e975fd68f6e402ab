"""The worker's one settings object: where it listens, which store it uses, and what bounds a request.

Flags of `kvstore worker` fill it (replay/worker/command.py is the only place
that reads them); the service, the runner and the tests take it whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvstore.config import UINT32_MAX, Range, check_ranges
from kvstore.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """How the reference worker serves (docs/WORKER.md)."""

    #: The kvstore server blocks and snapshots are fetched from and stored to ("host:port").
    store_target: str = "127.0.0.1:50051"
    #: Address to bind. Loopback by default.
    host: str = "127.0.0.1"
    #: TCP port; 0 picks a free one (printed at start).
    port: int = 50061
    #: torch device the model runs on: "cpu", "cuda", "cuda:1".
    device: str = "cpu"
    #: Longest prompt one Run takes (tokens).
    max_prompt_tokens: int = 1 << 20
    #: Most greedy tokens one Run decodes.
    max_new_tokens: int = 4096
    #: Most Runs waiting for the device at once; one more is answered RESOURCE_EXHAUSTED.
    max_queued_runs: int = 16
    #: Largest gRPC message in either direction.
    max_message_bytes: int = 64 * 1024 * 1024
    #: Seconds each call to the store may take.
    store_timeout_s: float = 60.0
    #: Positions per model call inside one extend (bounds activation memory).
    chunk_tokens: int = 4096
    #: Seconds in-flight Runs get to finish on SIGTERM.
    grace_s: float = 5.0
    #: On CUDA, run bounded replays through CUDA graphs (replay.model.graphs: the same logits as the
    #: eager step, fewer host launches); False keeps every step eager. No effect on the CPU.
    cuda_graphs: bool = True

    RANGES: ClassVar[dict[str, Range]] = {
        "port": Range(0, 65535),
        "max_prompt_tokens": Range(1, 1 << 32),
        "max_new_tokens": Range(0, UINT32_MAX),
        "max_queued_runs": Range(1, 1 << 16),
        "max_message_bytes": Range(1 << 20, 2**31 - 1),
        "store_timeout_s": Range(0, 86400, lo_open=True),
        "chunk_tokens": Range(1, 1 << 24),
        "grace_s": Range(0, 3600),
    }

    def __post_init__(self) -> None:
        check_ranges(self, "worker")
        if not self.store_target:
            raise ConfigError("worker.store_target is empty: give the kvstore server's host:port (--target)")
