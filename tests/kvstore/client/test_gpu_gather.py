"""The direct GPU restore on a CUDA device: gather, scatter, checksums, the pinned budget.

Marked gpu; skipped without CUDA (CI). On the H200 (scripts/device_direct.sh)
these run over a file laid out as LMDB lays out large values, mapped read-only
and registered with CUDA as the store's data file is
(`kvstore.bench.direct_sweep.MappedFile`), and, in
test_gpu_gather_store.py, over a real `kvstore serve` child's store.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.bench.direct_sweep import MappedFile  # noqa: E402
from kvstore.codec.block_codec import split_blocks  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402
from kvstore.geometry import V4_1_FLASH  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCK = V4_1_FLASH.block_bytes(64)
MIB = 1 << 20


@pytest.fixture
def gather():  # type: ignore[no-untyped-def]
    from kvstore.client.gpu_gather import GpuGather

    with GpuGather() as g:
        yield g


def test_gather_equals_the_blocks_in_request_order(gather, tmp_path) -> None:  # type: ignore[no-untyped-def]
    for seed, n in ((1, 1), (2, 37), (3, 700)):
        with MappedFile(n, BLOCK, seed=seed, folder=str(tmp_path)) as f:
            out = torch.full((n, BLOCK), 0xAB, dtype=torch.uint8, device="cuda")  # poisoned
            _, result = gather.gather(f, out)
            assert torch.equal(out.cpu(), torch.from_numpy(f.expected()))
            assert (result.blocks, result.copied, result.corrupt, result.rounds) == (n, n, [], 1)
            assert f.reported == []
    assert gather.registry.used_bytes <= gather.registry.budget_bytes


def test_gather_into_a_larger_out_leaves_the_rest(gather, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with MappedFile(5, BLOCK, seed=4, folder=str(tmp_path)) as f:
        out = torch.zeros((8, BLOCK), dtype=torch.uint8, device="cuda")
        gather.gather(f, out)
        assert torch.equal(out[:5].cpu(), torch.from_numpy(f.expected()))
        assert not out[5:].any()


def test_scatter_writes_each_layer_rows_at_the_given_slots(gather, tmp_path) -> None:  # type: ignore[no-untyped-def]
    geo, n, pages = V4_1_FLASH, 50, 80
    slots = torch.randperm(pages)[:n]
    layers = {layer: (torch.full((pages, geo.block_rows(layer, 64), geo.compressed_kv_row_bytes), 7,
                                 dtype=torch.uint8, device="cuda"),
                      torch.full((pages, geo.block_rows(layer, 64), geo.indexer_row_bytes), 7,
                                 dtype=torch.uint8, device="cuda"))
              for layer in geo.kv_source_layers}
    with MappedFile(n, BLOCK, seed=5, folder=str(tmp_path)) as f:
        result = gather.scatter(f, layers, slots)
        expected = split_blocks(geo, torch.from_numpy(f.expected()), 64)
    assert result.blocks == n
    untouched = torch.ones(pages, dtype=torch.bool)
    untouched[slots] = False
    for layer, (kv, index) in layers.items():
        assert torch.equal(kv[slots].cpu(), expected[layer][0]), layer
        assert torch.equal(index[slots].cpu(), expected[layer][1]), layer
        assert (kv[untouched] == 7).all() and (index[untouched] == 7).all()


def test_scatter_refuses_bad_destinations(gather, tmp_path) -> None:  # type: ignore[no-untyped-def]
    geo = V4_1_FLASH
    good = {layer: (torch.empty((4, geo.block_rows(layer, 64), 288), dtype=torch.uint8, device="cuda"),
                    torch.empty((4, geo.block_rows(layer, 64), 68), dtype=torch.uint8, device="cuda"))
            for layer in geo.kv_source_layers}
    with MappedFile(3, BLOCK, seed=6, folder=str(tmp_path)) as f:
        with pytest.raises(InvalidArgument, match="expected"):
            gather.scatter(f, {2: good[2]})
        wrong = dict(good)
        wrong[8] = (good[8][0].cpu(), good[8][1])
        with pytest.raises(InvalidArgument, match="layer 8 compressed_kv"):
            gather.scatter(f, wrong)
        with pytest.raises(InvalidArgument, match="slots must be in"):
            gather.scatter(f, good, [0, 1, 4])
        strided = dict(good)
        strided[20] = (good[20][0], good[20][1].transpose(1, 2).contiguous().transpose(1, 2))
        with pytest.raises(InvalidArgument, match="contiguous rows"):
            gather.scatter(f, strided)


@pytest.mark.parametrize("where", ["gpu", "cpu"])
def test_a_corrupt_block_is_a_miss_and_reported(where, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvstore.client.gpu_gather import GpuGather

    n = 40
    with MappedFile(n, BLOCK, seed=7, folder=str(tmp_path)) as f, GpuGather(checksums_on=where) as gather:
        f.corrupt(25)
        f.corrupt(31)
        out = torch.empty((n, BLOCK), dtype=torch.uint8, device="cuda")
        _, result = gather.gather(f, out)
        assert result.blocks == 25 and result.corrupt == [25, 31] and f.reported == [25, 31]
        assert result.verify_s > 0
        assert torch.equal(out[:25].cpu(), torch.from_numpy(f.expected()[:25]))
        _, unchecked = gather.gather(f, out, verify=False)
        assert unchecked.blocks == n and unchecked.corrupt == []


def test_gpu_checksums_equal_xxh3_on_random_rows() -> None:
    import xxhash

    from kvstore.client.gpu_gather import GpuGather

    class Rows:  # a read whose checksums are xxh3 of the rows, one wrong per size
        def __init__(self, rows: np.ndarray) -> None:
            self.checksums = np.array([xxhash.xxh3_64_intdigest(r.tobytes()) for r in rows], dtype=np.uint64)
            self.checksums[3] ^= np.uint64(1 << 40)

    rng = np.random.default_rng(12)
    with GpuGather() as g:
        for size in (BLOCK, 248, 1024 * 5 + 8, 4096):
            rows = rng.integers(0, 256, (9, size), dtype=np.uint8)
            rounds = g._rounds
            bad, _ = rounds.hash_on_gpu(rounds.stored(Rows(rows)), torch.from_numpy(rows).cuda(), size)  # type: ignore[arg-type]
            assert bad == [3], size


def test_lru_unregistration_under_a_small_budget(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvstore.client.gpu_gather import GpuGather

    n = 120  # about 6.7 MiB of blocks in shuffled order, chunks of 256 KiB, budget 1 MiB: many rounds
    with MappedFile(n, BLOCK, seed=8, folder=str(tmp_path)) as f, \
            GpuGather(budget_bytes=MIB, chunk_bytes=256 << 10) as g:
        out = torch.full((n, BLOCK), 0xCD, dtype=torch.uint8, device="cuda")
        _, result = g.gather(f, out)
        assert torch.equal(out.cpu(), torch.from_numpy(f.expected()))
        assert result.rounds > 1 and result.blocks == n
        assert g.stats.unregistrations > 0 and g.stats.peak_bytes <= MIB
        assert g.registry.used_bytes <= MIB
        before = g.stats.registrations
        # A second request for the blocks of the chunks still registered registers nothing.
        held = set(g.registry.registered())
        inside = [k for k, s in enumerate(f.spans)
                  if {s.offset // (256 << 10), (s.offset + s.size - 1) // (256 << 10)} <= held]
        assert inside
        f.spans = [f.spans[k] for k in inside]
        g.gather(f, out)
        assert g.stats.registrations == before
        assert torch.equal(out[:len(inside)].cpu(), torch.from_numpy(f.expected()[inside]))
    # Closed: every chunk unregistered.
    assert g.registry.used_bytes == 0


def test_a_refused_registration_is_the_typed_error_and_cuda_still_works() -> None:
    from kvstore.client.gpu_pinned import CudaHost, DirectGpuUnavailable

    m = mmap.mmap(-1, 8192)
    address = int(np.frombuffer(m, dtype=np.uint8).ctypes.data)
    host = CudaHost()
    host.register(address, 4096)
    with pytest.raises(DirectGpuUnavailable, match="cudaHostRegister"):
        host.register(address, 8192)  # overlaps what is registered, and is longer: CUDA refuses
    host.unregister(address)
    assert torch.ones(3, device="cuda").sum().item() == 3  # the error was cleared, not left sticky


def test_two_gathers_over_one_mapping_share_its_registration(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The restore's gatherer for a reader and a caller's own GpuGather in one process: CUDA refuses a
    # second registration of the same pages, so they share it, and one closing leaves the other's intact.
    from kvstore.client.gpu_gather import GpuGather

    with MappedFile(9, BLOCK, seed=11, folder=str(tmp_path)) as f:
        first, second = GpuGather(), GpuGather()
        out, result = first.gather(f)
        assert result.blocks == 9
        out2, result2 = second.gather(f)
        assert result2.blocks == 9 and torch.equal(out2, out)
        first.close()
        out3, result3 = second.gather(f)
        assert result3.blocks == 9 and torch.equal(out3.cpu(), torch.from_numpy(f.expected()))
        second.close()
        assert first.registry.used_bytes == second.registry.used_bytes == 0


def test_warm_up_compiles_and_leaves_nothing_registered(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvstore.client.gpu_gather import GpuGather

    with GpuGather() as g:
        assert g.warm_up() > 0
        assert g.registry.used_bytes == 0 and g.stats.registrations == 1  # one scratch chunk, both kernels
        with MappedFile(9, BLOCK, seed=9, folder=str(tmp_path)) as f:
            out, result = g.gather(f)
            assert result.blocks == 9 and torch.equal(out.cpu(), torch.from_numpy(f.expected()))


def test_scatter_in_rounds_under_a_small_budget(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvstore.client.gpu_gather import GpuGather

    geo, n = V4_1_FLASH, 60
    layers = {layer: (torch.zeros((n, geo.block_rows(layer, 64), 288), dtype=torch.uint8, device="cuda"),
                      torch.zeros((n, geo.block_rows(layer, 64), 68), dtype=torch.uint8, device="cuda"))
              for layer in geo.kv_source_layers}
    with MappedFile(n, BLOCK, seed=10, folder=str(tmp_path)) as f, \
            GpuGather(budget_bytes=MIB, chunk_bytes=256 << 10) as g:
        result = g.scatter(f, layers)
        expected = split_blocks(geo, torch.from_numpy(f.expected()), 64)
    assert result.rounds > 1 and result.blocks == n
    for layer, (kv, index) in layers.items():
        assert torch.equal(kv.cpu(), expected[layer][0]) and torch.equal(index.cpu(), expected[layer][1])


def test_threads_sharing_one_gather_each_get_their_blocks(gather, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from concurrent.futures import ThreadPoolExecutor

    with MappedFile(200, BLOCK, seed=11, folder=str(tmp_path)) as f:
        expected = torch.from_numpy(f.expected())
        outs = [torch.zeros((200, BLOCK), dtype=torch.uint8, device="cuda") for _ in range(4)]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda out: gather.gather(f, out)[1], outs))
        assert all(r.blocks == 200 for r in results)
        for out in outs:
            assert torch.equal(out.cpu(), expected)
