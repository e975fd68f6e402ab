"""One call to restore a prompt's stored blocks into the caller's memory, by the fastest path there is.

    result = restore(client, tokens, dest, reader=reader)   # dest: uint8 [n, block_bytes]
    usable = dest[:result.blocks]                           # result.path, result.reason say how

Paths, fastest first (docs/DIRECT_RESTORE.md):

- "direct-gpu": the worker's GPU reads the blocks straight from this process's
  mapping of the store's file (`kvstore.client.gpu_gather`, one kernel), CPU
  threads verifying meanwhile. Needs a `ColocatedReader`, a CUDA `dest`, and the
  GPU module with CUDA and Triton working.
- "direct-cpu": the same mapping, copied on CPU threads with the checksum in the
  same pass (to a CUDA `dest` through one host buffer). The fallback without
  CUDA or when registering the mapping fails.
- "shm": the server copies into a shared region registered for this call
  (`TransferSession`), then into `dest`: same host, no reader configured.
- "grpc": the blocks stream over `Get`: the path across hosts.

The direct paths read the store's file, which holds every tenant's blocks: they
are used only when the caller configured a reader (the trust model,
docs/SECURITY.md); "auto" never opens one itself.

A fleet client (`kvstore.client.fleet.FleetClient`) restores each run from its
nearest replica over "grpc" with failover (docs/FLEET.md F33, F47); given the
reader of this host's node, the runs that node holds go by the direct paths
(`_restore_runs`, F48); on "shm" (and "auto" without a reader) the runs this
host's nodes hold are copied by them into a shared region, the rest streamed
(`_fleet_shm`, F63).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.client import arguments
from kvstore.client.colocated import DEFAULT_LEASE_MS, ColocatedReader, MappedRead
from kvstore.client.colocated_memory import writable_bytes
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError
from kvstore.v1 import kvstore_pb2 as pb

#: The paths, fastest first.
PATHS = ("direct-gpu", "direct-cpu", "shm", "grpc")
_DATA_LOSS = "DATA_LOSS"
#: One GPU gatherer per reader and device, made on first use, closed with the reader (before its mapping goes).
_GATHERERS: weakref.WeakKeyDictionary[ColocatedReader, dict[str, Any]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class RestoreResult:
    """What a restore did.

    Attributes:
        path: the path used ("direct-gpu", "direct-cpu", "shm" or "grpc").
        blocks: leading blocks in `dest` that are usable (found and verified).
        tokens: `blocks * block_tokens`.
        corrupt: asked indices of blocks that failed their checksum (misses; the server was told).
        reason: why this path, and any fallback taken on the way.
    """

    path: str
    blocks: int
    tokens: int
    corrupt: list[int] = field(default_factory=list)
    reason: str = ""


def restore(client: Any, tokens_or_hashes: Sequence[Any], dest: Any, *, path: str = "auto",
            reader: ColocatedReader | None = None, gpu: Any = None,
            lease_ms: int = DEFAULT_LEASE_MS) -> RestoreResult:
    """Fill `dest`'s leading rows with the prompt's stored blocks; the usable prefix is `result.blocks`.

    Args:
        client: a `kvstore.Client`.
        tokens_or_hashes: the prompt's token ids, or its chain hashes (32-byte each).
        dest: uint8 memory for every full block: a tensor or numpy array `[>= n, block_bytes]`
            (CUDA for "direct-gpu"), or a writable buffer of at least `n * block_bytes`.
        path: "auto" (the fastest available) or one of `PATHS` (that one, or an error).
        reader: the `ColocatedReader` of this host's store: enables the direct paths.
        gpu: a `kvstore.client.gpu_gather.GpuGather` for "direct-gpu" (default: one per reader).
        lease_ms: the direct paths' Lookup lease.

    Raises:
        InvalidArgument: bad tokens or hashes, a `dest` too small or of the wrong kind for the path.
        FailedPrecondition: a forced path that cannot run here (no reader, no CUDA, a server
            that cannot map this host's regions).
        KVStoreError: the server's errors (Unavailable, ...).
    """
    fleet = _is_fleet(client)
    if not (hasattr(client, "connection") or fleet) or not hasattr(client, "hashes"):
        raise InvalidArgument(f"client must be a kvstore.Client, got {type(client).__name__}")
    if not isinstance(path, str) or path not in (*PATHS, "auto"):
        raise InvalidArgument(f"path must be auto or one of {', '.join(PATHS)}; got {path!r}")
    if reader is not None and not isinstance(reader, ColocatedReader):
        raise InvalidArgument(f"reader must be a ColocatedReader, got {type(reader).__name__}")
    hashes = _hashes(client, tokens_or_hashes)
    cuda = _is_cuda(dest)
    _check_dest(dest, len(hashes), client.block_bytes, cuda)
    notes: list[str] = []
    if fleet:
        return _fleet(client, hashes, dest, cuda, path=path, reader=reader, gpu=gpu, lease_ms=lease_ms)
    if path in ("direct-gpu", "direct-cpu") and reader is None:
        raise FailedPrecondition(f"path {path} needs a ColocatedReader of this host's store",
                                 hint="the direct paths are off unless configured (docs/SECURITY.md): "
                                      "pass reader=ColocatedReader(data_dir)")
    if path == "direct-gpu" and not cuda:
        raise InvalidArgument("path direct-gpu needs a CUDA dest tensor")
    if not hashes:
        return _result(client, path if path != "auto" else "grpc", 0, [], ["no full block to restore"])
    if reader is not None and path in ("auto", "direct-gpu", "direct-cpu"):
        result = _direct(client, reader, hashes, dest, cuda, path, gpu, lease_ms, notes)
        if result is not None:
            return result
    elif path == "auto":
        notes.append("no ColocatedReader configured: direct paths off")
    if path in ("auto", "shm"):
        result = _shm(client, hashes, dest, cuda, forced=path == "shm", notes=notes)
        if result is not None:
            return result
    return _grpc(client, hashes, dest, cuda, notes)


def _fleet(client: Any, hashes: list[bytes], dest: Any, cuda: bool, *, path: str, reader: ColocatedReader | None,
           gpu: Any, lease_ms: int) -> RestoreResult:
    """A fleet client's restore: with this host's node's reader, its runs directly and the rest streamed
    (`_restore_runs`, F48); else the runs this host's nodes hold over shared memory and the rest streamed
    (`_fleet_shm`, F63); else every run streamed from its nearest replica (F47)."""
    if path in ("direct-gpu", "direct-cpu") and reader is None:
        raise FailedPrecondition(f"path {path} needs a ColocatedReader of this host's node's store",
                                 hint="pass reader=ColocatedReader(data_dir) (docs/FLEET.md F48)")
    if path == "direct-gpu" and not cuda:
        raise InvalidArgument("path direct-gpu needs a CUDA dest tensor")
    notes = []
    if reader is not None and path in ("auto", "direct-gpu", "direct-cpu") and hashes:
        result = _restore_runs(client, reader, hashes, dest, path=path, gpu=gpu, lease_ms=lease_ms, cuda=cuda)
        if result is not None:
            return result
        if path != "auto":
            raise FailedPrecondition(f"the reader's store ({reader.data_dir}) is no live node of this fleet",
                                     hint="give the ColocatedReader of the node on this host (docs/FLEET.md F48)")
        notes.append(f"the reader's store ({reader.data_dir}) is no live node of this fleet")
    elif path == "auto":
        notes.append("no ColocatedReader configured: direct paths off")
    if path in ("auto", "shm") and hashes:
        # This host's node: the reader's, as F48 decides it, else the live nodes whose records name this host.
        local = None if reader is None or reader.node_id is None else [reader.node_id]
        result = _fleet_shm(client, hashes, dest, cuda, forced=path == "shm", local=local, notes=notes)
        if result is not None:
            return result
    notes.insert(0, "a fleet client: each run streamed from its nearest replica")
    return _grpc(client, hashes, dest, cuda, notes)


def _fleet_shm(client: Any, hashes: list[bytes], dest: Any, cuda: bool, *, forced: bool, local: list[str] | None,
               notes: list[str]) -> RestoreResult | None:
    """F63: a fleet session's region mapped into this host's nodes, the runs they hold copied by them, the rest
    streamed (`FleetTransferSession`), then into `dest`; None when no node of this host maps it (auto)."""
    from kvstore.client.fleet_transfer import FleetTransferSession  # here: it imports the fleet client's modules

    size = client.block_bytes
    with FleetTransferSession(client, path="shm" if forced else "auto", local=local) as session:
        region = session.register(len(hashes) * size)  # forced: FailedPrecondition when no node here maps it
        nodes = session.shared_with(region)
        if not nodes:
            why = "; ".join(f"{n}: {r}" for n, r in sorted(session.shm_reasons.items()))
            notes.append(f"no node of this host maps this process's regions{f' ({why})' if why else ''}")
            return None
        state = session.fetch(hashes, region)
        k = state.done_prefix
        _land(region, dest, k, size, cuda)
        paths = session.last_paths
    over_shm = sum("shm" in p.split("+") for p in paths)
    corrupt = sorted(i for i, (code, _) in state.failures.items() if code == _DATA_LOSS)
    reason = (f"a fleet client: {over_shm} of {len(paths)} runs over shared memory from this host's node(s) "
              f"{', '.join(nodes)}, the rest streamed from their replicas")
    return _result(client, "shm" if over_shm else "grpc", k, corrupt, [reason, *notes])


# -- arguments --------------------------------------------------------------


def _hashes(client: Any, values: Any) -> list[bytes]:
    """Chain hashes from token ids or hashes (told apart by the first element)."""
    if isinstance(values, str | bytes | bytearray | memoryview):
        raise InvalidArgument(f"tokens_or_hashes must be a sequence of token ids or hashes, got "
                              f"{type(values).__name__}")
    if hasattr(values, "tolist"):  # numpy array or tensor of token ids
        values = values.tolist()
    if not isinstance(values, Sequence):
        raise InvalidArgument(f"tokens_or_hashes must be a sequence, got {type(values).__name__}")
    if values and isinstance(values[0], bytes | bytearray | memoryview):
        out = [bytes(h) if isinstance(h, bytes | bytearray | memoryview) else h for h in values]
        return arguments.hashes(out, "tokens_or_hashes")
    return list(client.hashes(values))


def _is_fleet(client: Any) -> bool:
    """Whether `client` is a fleet client (its blocks lie on many nodes)."""
    from kvstore.client.fleet import FleetClient  # here: the fleet client imports the whole client package

    return isinstance(client, FleetClient)


def _is_cuda(dest: Any) -> bool:
    device = getattr(dest, "device", None)
    return getattr(device, "type", None) == "cuda"


def _check_dest(dest: Any, n: int, block_bytes: int, cuda: bool) -> None:
    """Refuse a `dest` that cannot take `n` blocks before anything is read."""
    if cuda:
        import torch

        if (dest.dtype != torch.uint8 or dest.dim() != 2 or dest.shape[0] < n or dest.shape[1] != block_bytes
                or not dest.is_contiguous()):
            raise InvalidArgument(f"dest must be a contiguous uint8 tensor [>= {n}, {block_bytes}], got "
                                  f"{dest.dtype} {tuple(dest.shape)}")
        return
    writable_bytes(dest, n * block_bytes)


def _rows(dest: Any, block_bytes: int, k: int) -> memoryview:
    """The first `k` rows of a CPU `dest` as one writable byte view."""
    return writable_bytes(dest, k * block_bytes)


# -- the direct paths -------------------------------------------------------


def _gpu_gather(gpu: Any, read: MappedRead, dest: Any) -> tuple[int, list[int]]:
    """H-gpu's gatherer, in one place: (usable leading blocks, corrupt indices, reported by it)."""
    _, result = gpu.gather(read, dest)
    return int(result.blocks), list(result.corrupt)


def _gatherer(reader: ColocatedReader, device: Any) -> Any:
    """The reader's GpuGather for `device` (made once; unregistered when the reader closes).

    Raises:
        FailedPrecondition: the GPU module is missing or cannot run here (DirectGpuUnavailable is one).
    """
    per_device = _GATHERERS.setdefault(reader, {})
    key = str(device)
    gpu = per_device.get(key)
    if gpu is None:
        try:
            from kvstore.client.gpu_gather import GpuGather
        except ImportError as exc:
            raise FailedPrecondition(f"kvstore.client.gpu_gather cannot be imported: {exc}") from None
        try:
            gpu = GpuGather(device=device)
        except KVStoreError:
            raise
        except Exception as exc:  # CUDA's own errors at device setup: the GPU path is not available
            raise FailedPrecondition(f"the GPU gatherer cannot start: {exc}") from None
        per_device[key] = gpu
        reader.on_close(gpu.close)
    return gpu


def _direct(client: Any, reader: ColocatedReader, hashes: list[bytes], dest: Any, cuda: bool, path: str,
            gpu: Any, lease_ms: int, notes: list[str]) -> RestoreResult | None:
    """A direct path's result; None when "auto" should go on to the next path."""
    # On the GPU path the copy runs while the Lookup is in flight: the gatherer reads
    # `found_blocks` (waiting for the answer) only after its kernels, and cuts the prefix there.
    overlap = cuda and path in ("auto", "direct-gpu")
    with reader.read(client, hashes, lease_ms=lease_ms, wait=not overlap) as read:
        if not len(read) and read.found_blocks and not read.damaged:
            # The server found blocks this mapping does not hold: the reader is of another store.
            if path != "auto":
                raise FailedPrecondition(f"the reader's store ({reader.data_dir}) does not hold the blocks the "
                                         f"server found: is it the server's data dir?")
            notes.append(f"the reader's store ({reader.data_dir}) does not hold what the server found")
            return None
        if cuda and path in ("auto", "direct-gpu"):
            try:
                blocks, corrupt = _gpu_gather(gpu if gpu is not None else _gatherer(reader, dest.device), read, dest)
            except FailedPrecondition as exc:  # DirectGpuUnavailable included: registering failed, no Triton
                if path == "direct-gpu":
                    raise
                notes.append(f"direct-gpu unavailable ({exc.message})")
            else:
                corrupt = sorted({*corrupt, *read.damaged})
                _report(read, read.damaged, notes)
                return _result(client, "direct-gpu", min([blocks, *corrupt]), corrupt,
                               ["a ColocatedReader is configured and dest is on the GPU", *notes])
        return _direct_cpu(client, read, dest, cuda, notes)


def _direct_cpu(client: Any, read: MappedRead, dest: Any, cuda: bool, notes: list[str]) -> RestoreResult:
    read.settle()  # the Lookup's answer first: only what it found is copied
    n = len(read)
    if cuda:
        import torch

        host = torch.empty((n, client.block_bytes), dtype=torch.uint8)
        bad = read.copy_into(host)
        good = min([*bad, *read.damaged, n])
        dest[:good].copy_(host[:good])
        why = "dest is on the GPU: copied through host memory"
    else:
        bad = read.copy_into(_rows(dest, client.block_bytes, n))
        why = "dest is in host memory"
    corrupt = sorted({*bad, *read.damaged})
    _report(read, corrupt, notes)
    return _result(client, "direct-cpu", min([*corrupt, n]), corrupt,
                   [f"a ColocatedReader is configured; {why}", *notes])


def _report(read: MappedRead, indices: list[int], notes: list[str]) -> None:
    """Tell the server (best effort: the blocks are misses here whatever it answers)."""
    if not indices:
        return
    try:
        read.report_corrupt(indices)
    except KVStoreError as exc:
        notes.append(f"reporting {len(indices)} corrupt block(s) failed: {exc.message}")


# -- the server's paths -----------------------------------------------------


def _shm(client: Any, hashes: list[bytes], dest: Any, cuda: bool, *, forced: bool,
         notes: list[str]) -> RestoreResult | None:
    """The shared-memory path's result; None when the server cannot map this host's regions or serves no
    transfer session, a gateway (auto)."""
    size = client.block_bytes
    try:
        with client.transfer(path="shm" if forced else "auto") as session:
            region = session.register(len(hashes) * size)
            if not region.shared:
                notes.append("the server cannot map this host's regions (another host?)")
                return None
            state = session.fetch(hashes, region)
            k = state.done_prefix
            _land(region, dest, k, size, cuda)
    except FailedPrecondition as exc:  # a gateway serves no transfer session (F40): auto goes on to Get
        if forced:
            raise
        notes.append(f"no transfer session here ({exc.message})")
        return None
    corrupt = sorted(i for i, (code, _) in state.failures.items() if code == _DATA_LOSS)
    return _result(client, "shm", k, corrupt, ["the server maps this process's shared regions", *notes])


def _land(region: Any, dest: Any, k: int, size: int, cuda: bool) -> None:
    """A shared region's first `k` blocks into `dest`'s rows (through a pinned copy to a CUDA `dest`)."""
    if cuda:
        region.pin()
        dest[:k].copy_(region.blocks(size, k))
    else:
        _rows(dest, size, k)[:] = region.view[: k * size]


def _grpc(client: Any, hashes: list[bytes], dest: Any, cuda: bool, notes: list[str]) -> RestoreResult:
    size = client.block_bytes
    filled, corrupt, stopped = 0, [], False
    host = None if cuda else _rows(dest, size, len(hashes))
    staged: list[bytes] = []
    for index, status, data in client.stream(hashes):  # read to the end: the Get then refreshes the blocks
        if status == pb.BLOCK_STATUS_CORRUPT:
            corrupt.append(index)
        if stopped or status != pb.BLOCK_STATUS_FOUND or index != filled:
            stopped = True
            continue
        if host is not None:
            host[filled * size:(filled + 1) * size] = data
        else:
            staged.append(data)
        filled += 1
    if cuda and staged:
        import torch

        dest[:filled].copy_(torch.frombuffer(bytearray(b"".join(staged)), dtype=torch.uint8).view(filled, size))
    return _result(client, "grpc", filled, corrupt, ["blocks streamed over Get", *notes])


def _result(client: Any, path: str, blocks: int, corrupt: list[int], reasons: list[str]) -> RestoreResult:
    return RestoreResult(path=path, blocks=blocks, tokens=blocks * client.block_tokens, corrupt=corrupt,
                         reason="; ".join(reasons))

# -- a fleet's direct paths, run by run (docs/FLEET.md F48) ----------------------

# `restore` through a fleet client with this host's node's `ColocatedReader`: the direct paths, run by run (F48).
#
# A prompt's runs lie on several nodes; the reader maps one of them, this host's
# (`ColocatedReader.node_id`). Each run that node holds a copy of is restored
# from it as on one server (`restore` on a plain client of that node: its leased
# Lookup of the run's hashes, F29's chain on that node, then the direct copy,
# GPU or CPU); every other run, and the rest of a run the local copy lacks, is
# streamed from its nearest replica with failover (`FleetClient` streams, F33).
# The copies a direct read did not ask are refreshed in the background (F34), as
# for any fleet read. The usable prefix ends at the first run that comes back
# short.


def _rows_from(dest: Any, start: int, n: int, size: int) -> Any:
    """`dest` from row `start` on: a row slice of a 2-D tensor or array, else a byte view of a buffer."""
    shape = getattr(dest, "shape", None)
    if shape is not None and len(shape) == 2:
        return dest[start:]
    return writable_bytes(dest, n * size)[start * size:]


def _restore_runs(client: Any, reader: ColocatedReader, hashes: list[bytes], dest: Any, *, path: str,
                 gpu: Any, lease_ms: int, cuda: bool) -> RestoreResult | None:
    """The fleet's direct restore (the module's docstring); None when the reader's node is not live in the fleet."""
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
            part = restore(node, hashes[run.first_block:run.end_block], _rows_from(dest, run.first_block, n, size),
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


def _stream_into(client: Any, hashes: list[bytes], lo: int, hi: int, dest: Any, n: int,
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


__all__ = ["PATHS", "RestoreResult", "restore"]
