"""`restore` through a fleet client with this host's node's `ColocatedReader`: the direct paths, run by run (F48).

A prompt's runs lie on several nodes; the reader maps one of them, this host's
(`ColocatedReader.node_id`). Each run that node holds a copy of is restored
from it as on one server (`restore` on a plain client of that node: its leased
Lookup of the run's hashes, F29's chain on that node, then the direct copy,
GPU or CPU); every other run, and the rest of a run the local copy lacks, is
streamed from its nearest replica with failover (`FleetClient` streams, F33).
The copies a direct read did not ask are refreshed in the background (F34), as
for any fleet read. The usable prefix ends at the first run that comes back
short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.client.colocated import ColocatedReader
from kvstore.client.colocated_memory import writable_bytes
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.client.fleet import FleetClient
    from kvstore.client.restore import RestoreResult


def rows_from(dest: Any, start: int, n: int, size: int) -> Any:
    """`dest` from row `start` on: a row slice of a 2-D tensor or array, else a byte view of a buffer."""
    shape = getattr(dest, "shape", None)
    if shape is not None and len(shape) == 2:
        return dest[start:]
    return writable_bytes(dest, n * size)[start * size:]


def restore_runs(client: FleetClient, reader: ColocatedReader, hashes: list[bytes], dest: Any, *, path: str,
                 gpu: Any, lease_ms: int, cuda: bool) -> RestoreResult | None:
    """The fleet's direct restore (the module's docstring); None when the reader's node is not live in the fleet."""
    from kvstore.client.restore import RestoreResult, restore

    local = reader.node_id
    if local is None or local not in client.view.nodes:
        return None
    node = client.node_client(local)
    size, n = client.block_bytes, len(hashes)
    runs = client.placement(hashes)
    filled, corrupt, direct, paths = 0, [], 0, set()
    for run in runs:
        want = run.end_block - run.first_block
        got = 0
        if local in run.replicas:
            part = restore(node, hashes[run.first_block:run.end_block], rows_from(dest, run.first_block, n, size),
                           path=path, reader=reader, gpu=gpu, lease_ms=lease_ms)
            got, direct = part.blocks, direct + 1
            paths.add(part.path)
            corrupt += [run.first_block + i for i in part.corrupt]
            for other in run.replicas:
                if other != local and got:
                    client.refresher.add(other, hashes[run.first_block:run.first_block + got])
        if got < want:
            streamed, bad = _stream_into(client, hashes, run.first_block + got, run.end_block, dest, n, cuda)
            got += streamed
            corrupt += bad
        filled += got
        if got < want:
            break
    used = "direct-gpu" if "direct-gpu" in paths else "direct-cpu" if "direct-cpu" in paths else "grpc"
    reason = (f"a fleet client with the ColocatedReader of this host's node {local}: {direct} of {len(runs)} runs "
              f"read from it ({', '.join(sorted(paths)) or 'none'}), the rest streamed from their replicas")
    return RestoreResult(path=used, blocks=filled, tokens=filled * client.block_tokens, corrupt=sorted(corrupt),
                         reason=reason)


def _stream_into(client: FleetClient, hashes: list[bytes], lo: int, hi: int, dest: Any, n: int,
                 cuda: bool) -> tuple[int, list[int]]:
    """Blocks [lo, hi) streamed into `dest`'s rows from `lo`: (leading blocks filled, corrupt indices)."""
    size = client.block_bytes
    host = None if cuda else writable_bytes(dest, n * size)
    filled, corrupt, staged = 0, [], []
    for index, status, data in client.stream_part(hashes, lo, hi):
        if status == pb.BLOCK_STATUS_CORRUPT:
            corrupt.append(lo + index)
        if status != pb.BLOCK_STATUS_FOUND or index != filled:
            break
        if host is not None:
            at = (lo + filled) * size
            host[at:at + size] = data
        else:
            staged.append(data)
        filled += 1
    if staged:
        import torch

        dest[lo:lo + filled].copy_(torch.frombuffer(bytearray(b"".join(staged)), dtype=torch.uint8).view(filled, size))
    return filled, corrupt
