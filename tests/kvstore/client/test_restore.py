"""restore(): which path it takes and why, its fallbacks, and the bytes it lands, against a real server."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.client.colocated import MappedRead
from kvstore.client.restore import PATHS, RestoreResult, restore
from kvstore.errors import FailedPrecondition, InvalidArgument
from tests.kvstore.client.test_colocated_overlap import _evicted_under_the_read
from tests.kvstore.client.test_colocated_support import BLOCK_TOKENS, Store, damage, payload, prompt

#: The `store` and `new_store` fixtures (a test module cannot import a conftest under importlib mode).
pytest_plugins = ["tests.kvstore.client.test_colocated_support"]


class CudaLike:
    """Stands for a CUDA tensor on this CPU-only machine: says it is on "cuda", holds a CPU tensor.

    Only what restore() asks of a CUDA dest is here, so a path that would use it as host memory fails.
    """

    def __init__(self, rows: int, block_bytes: int) -> None:
        self.cpu = torch.zeros((rows, block_bytes), dtype=torch.uint8)
        self.device = SimpleNamespace(type="cuda")
        self.dtype, self.shape = self.cpu.dtype, self.cpu.shape

    def dim(self) -> int:
        return self.cpu.dim()

    def is_contiguous(self) -> bool:
        return True

    def __getitem__(self, key: Any) -> torch.Tensor:
        return self.cpu[key]


def stored(store: Store, n: int = 12, seed: int = 1) -> tuple[Any, list[int], np.ndarray]:
    rng = random.Random(seed)
    client = store.client()
    tokens = prompt(rng, n)
    blocks = payload(rng, n, client.block_bytes)
    client.put(tokens, blocks)
    return client, tokens, blocks


def test_without_a_reader_auto_takes_shm_and_says_why(store: Store) -> None:
    client, tokens, blocks = stored(store)
    dest = np.zeros_like(blocks)
    result = restore(client, tokens, dest)
    assert result == RestoreResult(path="shm", blocks=12, tokens=12 * BLOCK_TOKENS, corrupt=[], reason=result.reason)
    assert "no ColocatedReader configured" in result.reason
    assert (dest == blocks).all()


def test_with_a_reader_and_host_memory_auto_reads_the_mapping_on_cpu(store: Store) -> None:
    client, tokens, blocks = stored(store)
    reader = store.reader()
    for dest in (np.zeros_like(blocks), torch.zeros(tuple(blocks.shape), dtype=torch.uint8),
                 bytearray(blocks.nbytes)):
        result = restore(client, tokens, dest, reader=reader)
        assert (result.path, result.blocks, result.corrupt) == ("direct-cpu", 12, [])
        assert bytes(memoryview(dest.numpy() if isinstance(dest, torch.Tensor) else dest)) == blocks.tobytes()
    # hashes work as well as tokens, and a longer prompt restores its stored prefix
    more = tokens + prompt(random.Random(99), 3)
    dest2 = np.zeros((15, client.block_bytes), dtype=np.uint8)
    result = restore(client, client.hashes(more), dest2, reader=reader)
    assert (result.blocks, result.tokens) == (12, 12 * BLOCK_TOKENS)
    assert (dest2[:12] == blocks).all()


def test_every_path_lands_the_bytes_the_servers_get_returns(store: Store) -> None:
    client, tokens, blocks = stored(store, n=20, seed=2)
    reader = store.reader()
    want = b"".join(b or b"" for b in client.get(tokens).blocks)
    for path in ("direct-cpu", "shm", "grpc"):
        dest = np.zeros_like(blocks)
        result = restore(client, tokens, dest, path=path, reader=reader)
        assert (result.path, result.blocks) == (path, 20)
        assert dest.tobytes() == want


def test_the_direct_paths_are_off_unless_a_reader_is_configured(store: Store) -> None:
    client, tokens, blocks = stored(store)
    for path in ("direct-cpu", "direct-gpu"):
        with pytest.raises(FailedPrecondition, match="needs a ColocatedReader"):
            restore(client, tokens, np.zeros_like(blocks), path=path)
    assert restore(client, tokens, np.zeros_like(blocks)).path not in ("direct-cpu", "direct-gpu")


def test_a_cuda_dest_without_cuda_falls_back_to_the_cpu_copy(store: Store) -> None:
    client, tokens, blocks = stored(store)
    reader = store.reader()
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU tests cover it")
    dest = CudaLike(12, client.block_bytes)
    result = restore(client, tokens, dest, reader=reader)  # the real gpu_gather: no CUDA here
    assert (result.path, result.blocks) == ("direct-cpu", 12)
    assert "direct-gpu unavailable" in result.reason and "through host memory" in result.reason
    assert (dest.cpu.numpy() == blocks).all()
    with pytest.raises(FailedPrecondition):
        restore(client, tokens, CudaLike(12, client.block_bytes), path="direct-gpu", reader=reader)


def test_direct_gpu_hands_the_open_read_to_the_gatherer(store: Store) -> None:
    client, tokens, blocks = stored(store)
    reader = store.reader()
    seen: list[MappedRead] = []

    class Gatherer:
        """Does what GpuGather.gather does, on the CPU: copy the verified spans into dest's rows."""

        def gather(self, read: MappedRead, out: CudaLike) -> tuple[CudaLike, SimpleNamespace]:
            seen.append(read)
            bad = read.copy_into(out.cpu)
            return out, SimpleNamespace(blocks=min([*bad, len(read.spans)]), corrupt=bad)

    dest = CudaLike(12, client.block_bytes)
    result = restore(client, tokens, dest, reader=reader, gpu=Gatherer())
    assert (result.path, result.blocks, result.corrupt) == ("direct-gpu", 12, [])
    assert (dest.cpu.numpy() == blocks).all()
    assert len(seen) == 1 and len(seen[0].spans) == 12
    with pytest.raises(FailedPrecondition):
        seen[0].verify()  # the read (and its txn) ended with the restore
    with pytest.raises(InvalidArgument):
        restore(client, tokens, np.zeros_like(blocks), path="direct-gpu", reader=reader, gpu=Gatherer())


def test_a_corrupt_block_cuts_the_restored_prefix_and_the_server_drops_it(store: Store) -> None:
    client, tokens, blocks = stored(store, n=8, seed=3)
    reader = store.reader()
    with reader.read(client, client.hashes(tokens)) as read:
        damage(store.data_dir, read.spans[5].offset + 7)
    dest = np.zeros_like(blocks)
    result = restore(client, tokens, dest, reader=reader)
    assert (result.path, result.blocks, result.corrupt) == ("direct-cpu", 5, [5])
    assert (dest[:5] == blocks[:5]).all()
    assert client.stats().corrupt_blocks == 1  # reported, checked again and dropped by the server
    assert restore(client, tokens, np.zeros_like(blocks), path="grpc").blocks == 5


def test_a_reader_of_another_store_falls_back_to_the_servers_path(store: Store, new_store) -> None:
    client, tokens, blocks = stored(store)
    other = new_store("other")
    other.start()  # a live store beside it, holding none of these blocks
    wrong = other.reader()
    dest = np.zeros_like(blocks)
    result = restore(client, tokens, dest, reader=wrong)
    assert result.path == "shm" and "does not hold" in result.reason
    assert (dest == blocks).all()
    with pytest.raises(FailedPrecondition, match="does not hold"):
        restore(client, tokens, np.zeros_like(blocks), path="direct-cpu", reader=wrong)


def test_nothing_to_restore(store: Store) -> None:
    client = store.client()
    reader = store.reader()
    assert restore(client, [1, 2, 3], bytearray(), reader=reader).blocks == 0  # shorter than a block
    result = restore(client, prompt(random.Random(5), 2), np.zeros((2, client.block_bytes), np.uint8))
    assert (result.blocks, result.tokens) == (0, 0)


def test_bad_input_gives_typed_errors(store: Store) -> None:
    client, tokens, blocks = stored(store, n=2)
    reader = store.reader()
    ok = np.zeros_like(blocks)
    bad_calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((client, tokens, ok), {"path": "fastest"}),
        ((client, "tokens", ok), {}),
        ((client, 7, ok), {}),
        ((client, [b"short"], ok), {}),
        ((client, [-1] * 32, ok), {}),
        ((client, tokens, np.zeros((1, client.block_bytes), np.uint8)), {}),   # too small
        ((client, tokens, bytes(blocks.nbytes)), {}),                          # read-only
        ((client, tokens, "dest"), {}),
        ((client, tokens, ok), {"reader": "a reader"}),
        (("a client", tokens, ok), {}),
        ((client, tokens, CudaLike(1, client.block_bytes)), {"reader": reader}),
    ]
    for args, kwargs in bad_calls:
        with pytest.raises(InvalidArgument):
            restore(*args, **kwargs)
    assert set(PATHS) == {"direct-gpu", "direct-cpu", "shm", "grpc"}


def test_direct_gpu_copies_while_the_lookup_is_in_flight_and_cuts_at_its_answer(new_store, monkeypatch) -> None:
    client, hashes, blocks, s = _evicted_under_the_read(new_store, monkeypatch, seed=31, newcomers=3)
    reader = s.reader()
    candidates: list[int] = []

    class Gatherer:
        """Does what GpuGather.gather does, on the CPU: copy every span it is given, then read
        `found_blocks` (the Lookup's answer) and cut the usable prefix there."""

        def gather(self, read: MappedRead, out: CudaLike) -> tuple[CudaLike, SimpleNamespace]:
            candidates.append(len(read.offsets))
            for k in range(len(read.offsets)):
                out.cpu[k] = torch.frombuffer(bytearray(read.view(k)), dtype=torch.uint8)
            bad = [k for k, ok in enumerate(read.verify()) if not ok]
            return out, SimpleNamespace(blocks=min([*bad, len(read.offsets), read.found_blocks]), corrupt=bad)

    dest = CudaLike(8, client.block_bytes)
    result = restore(client, hashes, dest, reader=reader, gpu=Gatherer())
    found = client.lookup_hashes(hashes).found_blocks
    assert candidates == [8] and found < 8  # it copied all eight, the Lookup (evicting first) found fewer
    assert (result.path, result.blocks, result.corrupt) == ("direct-gpu", found, [])
    assert (dest.cpu.numpy()[:found] == blocks[:found]).all()
