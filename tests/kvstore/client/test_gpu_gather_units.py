"""The direct GPU restore's pure-Python parts, on CPU: chunking, rounds, the LRU registry, typed errors.

The registry is driven by recording register / unregister calls, so every rule
(page-aligned chunks clipped to the file, least recently used unregistered
first, a grown file re-registered, a new mapping clearing the old, the budget
never exceeded) is checked without CUDA. The GPU tests are in
test_gpu_gather.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.client.gpu_pinned import (
    PAGE_BYTES,
    Chunk,
    DirectGpuUnavailable,
    PinnedRegistry,
    SharedRegistrations,
    chunk_bytes_checked,
    chunks_of,
    plan_rounds,
)
from kvstore.errors import FailedPrecondition, InvalidArgument

MIB = 1 << 20


@dataclass(frozen=True)
class Span:
    index: int
    offset: int
    size: int


class Recorder:
    """register / unregister calls, and what is registered now (overlaps are refused, as CUDA does)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.live: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []
        self.fail_at = fail_at

    def register(self, address: int, length: int) -> None:
        if self.fail_at is not None and address == self.fail_at:
            raise DirectGpuUnavailable("refused")
        for start, size in self.live.items():
            assert address + length <= start or start + size <= address, "overlapping registration"
        assert address % PAGE_BYTES == 0 and length % PAGE_BYTES == 0
        self.live[address] = length
        self.calls.append(("register", address, length))

    def unregister(self, address: int) -> None:
        self.live.pop(address)
        self.calls.append(("unregister", address, 0))


def test_chunks_are_page_aligned_and_clipped_to_the_file() -> None:
    chunk = 4 * MIB
    map_length = 10 * MIB + 3 * PAGE_BYTES  # the file's length: the last chunk ends there, not at 12 MiB
    assert chunks_of(Span(0, 16, 56_960), map_length, chunk) == [Chunk(0, 0, chunk)]
    straddle = Span(0, chunk - 100, 56_960)
    assert [c.index for c in chunks_of(straddle, map_length, chunk)] == [0, 1]
    last = chunks_of(Span(0, 10 * MIB + 16, 1000), map_length, chunk)
    assert last == [Chunk(2, 8 * MIB, 2 * MIB + 3 * PAGE_BYTES)]


def test_a_file_length_off_a_page_rounds_up_to_whole_pages() -> None:
    (c,) = chunks_of(Span(0, 16, 100), 5000, 4 * MIB)
    assert c.length == 2 * PAGE_BYTES


@pytest.mark.parametrize("span", [Span(0, -1, 10), Span(0, 100, 0), Span(0, 1000, 200)])
def test_a_block_outside_the_mapped_file_is_invalid(span: Span) -> None:
    with pytest.raises(InvalidArgument, match="outside"):
        chunks_of(span, 1100, 4 * MIB)


@pytest.mark.parametrize("bad", [0, -4096, 1000, 4096 + 1])
def test_chunk_bytes_must_be_whole_pages(bad: int) -> None:
    with pytest.raises(InvalidArgument, match="multiple of 4096"):
        chunk_bytes_checked(bad)


def test_one_round_when_everything_fits() -> None:
    spans = [Span(i, 16 + i * 57_344, 56_960) for i in range(100)]
    rounds = plan_rounds(spans, 100 * 57_344 + 4096, MIB, 64 * MIB)
    assert len(rounds) == 1
    members, chunks = rounds[0]
    assert members == list(range(100))
    assert sorted(chunks) == list(range(6))  # 5.5 MiB of blocks: chunks 0..5


def test_rounds_split_in_order_and_each_fits_the_budget() -> None:
    chunk = MIB
    spans = [Span(i, 16 + k * 57_344, 56_960) for i, k in enumerate([5, 200, 6, 300, 7, 201])]
    length = 400 * 57_344
    rounds = plan_rounds(spans, length, chunk, 2 * MIB)
    assert [m for r in rounds for m in r[0]] == list(range(6))  # every block once, in order
    for members, chunks in rounds:
        assert sum(c.length for c in chunks.values()) <= 2 * MIB
        for m in members:  # each block's chunks are in its round
            assert {c.index for c in chunks_of(spans[m], length, chunk)} <= set(chunks)
    assert len(rounds) > 1


def test_a_block_larger_than_the_budget_is_a_typed_error() -> None:
    with pytest.raises(DirectGpuUnavailable, match="over the pinned budget") as info:
        plan_rounds([Span(0, MIB - 10, 56_960)], 4 * MIB, MIB, MIB)  # straddles: needs 2 MiB
    assert isinstance(info.value, FailedPrecondition)  # the facade's CPU fallback catches this class


def test_registry_keeps_chunks_and_unregisters_least_recently_used_first() -> None:
    rec = Recorder()
    reg = PinnedRegistry(rec.register, rec.unregister, budget_bytes=3 * MIB)
    base = 1 << 40
    c = {i: Chunk(i, i * MIB, MIB) for i in range(6)}
    reg.ensure(base, [c[0], c[1]])
    reg.ensure(base, [c[2]])
    assert reg.used_bytes == 3 * MIB and rec.calls.count(("register", base, MIB)) == 1
    reg.ensure(base, [c[0]])  # already registered: no call, now most recent
    assert len(rec.calls) == 3
    reg.ensure(base, [c[3]])  # full: the least recently used (chunk 1) goes, not chunk 0
    assert rec.calls[-2:] == [("unregister", base + MIB, 0), ("register", base + 3 * MIB, MIB)]
    assert list(reg.registered()) == [2, 0, 3]
    reg.ensure(base, [c[4], c[5], c[0]])  # 2 and 3 go; 0 stays (asked for)
    assert sorted(reg.registered()) == [0, 4, 5]
    assert reg.used_bytes <= reg.budget_bytes and reg.stats.peak_bytes <= reg.budget_bytes
    assert reg.stats.registrations == 6 and reg.stats.unregistrations == 3
    assert sum(rec.live.values()) == reg.used_bytes


def test_registry_reregisters_a_chunk_when_the_file_grew() -> None:
    rec = Recorder()
    reg = PinnedRegistry(rec.register, rec.unregister, budget_bytes=8 * MIB)
    reg.ensure(0x10000000, [Chunk(0, 0, 2 * PAGE_BYTES)])
    reg.ensure(0x10000000, [Chunk(0, 0, 5 * PAGE_BYTES)])
    assert rec.calls == [("register", 0x10000000, 2 * PAGE_BYTES), ("unregister", 0x10000000, 0),
                         ("register", 0x10000000, 5 * PAGE_BYTES)]
    reg.ensure(0x10000000, [Chunk(0, 0, 2 * PAGE_BYTES)])  # shorter than registered: nothing to do
    assert len(rec.calls) == 3


def test_a_new_mapping_unregisters_the_old_one_first() -> None:
    rec = Recorder()
    reg = PinnedRegistry(rec.register, rec.unregister, budget_bytes=8 * MIB)
    reg.ensure(0x10000000, [Chunk(0, 0, MIB), Chunk(1, MIB, MIB)])
    reg.ensure(0x20000000, [Chunk(0, 0, MIB)])
    assert rec.live == {0x20000000: MIB}
    reg.clear()
    assert rec.live == {} and reg.used_bytes == 0 and reg.base is None


def test_registry_refuses_a_request_over_budget_and_registers_nothing() -> None:
    rec = Recorder()
    reg = PinnedRegistry(rec.register, rec.unregister, budget_bytes=2 * MIB)
    with pytest.raises(DirectGpuUnavailable, match="exceed the pinned budget"):
        reg.ensure(0, [Chunk(i, i * MIB, MIB) for i in range(3)])
    assert rec.calls == []


def test_a_failed_registration_leaves_the_books_straight() -> None:
    base = 1 << 30
    rec = Recorder(fail_at=base + MIB)
    reg = PinnedRegistry(rec.register, rec.unregister, budget_bytes=8 * MIB)
    with pytest.raises(DirectGpuUnavailable):
        reg.ensure(base, [Chunk(0, 0, MIB), Chunk(1, MIB, MIB)])
    assert reg.registered() == {0: MIB} and rec.live == {base: MIB}


class OnePerProcess(Recorder):
    """CUDA's rule: memory registered once in a process is refused a second time (the typed error)."""

    def register(self, address: int, length: int) -> None:
        if any(address < start + size and start < address + length for start, size in self.live.items()):
            raise DirectGpuUnavailable("cudaErrorHostMemoryAlreadyRegistered (712)")
        super().register(address, length)


def test_two_registries_over_one_mapping_share_its_registrations() -> None:
    # The restore's gatherer for a reader and a caller's own GpuGather, over the same data file.
    base, cuda = 1 << 30, OnePerProcess()
    table = SharedRegistrations(cuda.register, cuda.unregister)
    first = PinnedRegistry(table.register, table.unregister, budget_bytes=8 * MIB)
    second = PinnedRegistry(table.register, table.unregister, budget_bytes=8 * MIB)
    first.ensure(base, [Chunk(0, 0, MIB), Chunk(1, MIB, MIB)])
    second.ensure(base, [Chunk(1, MIB, MIB), Chunk(2, 2 * MIB, MIB)])     # chunk 1 is shared, not refused
    assert cuda.live == {base: MIB, base + MIB: MIB, base + 2 * MIB: MIB} and table.holders(base + MIB) == 2
    first.clear()                                                          # the other still reads chunk 1
    assert cuda.live == {base + MIB: MIB, base + 2 * MIB: MIB} and table.holders(base + MIB) == 1
    second.clear()
    assert cuda.live == {} and [c[0] for c in cuda.calls].count("register") == 3


def test_a_longer_range_over_a_held_one_is_refused_and_the_holder_keeps_it() -> None:
    base, cuda = 1 << 30, OnePerProcess()
    table = SharedRegistrations(cuda.register, cuda.unregister)
    table.register(base, MIB)
    table.register(base, MIB // 2)                     # inside what is held: shared
    with pytest.raises(DirectGpuUnavailable, match="712"):
        table.register(base, 2 * MIB)                  # the file grew under another holder: CUDA refuses
    assert table.holders(base) == 2 and cuda.live == {base: MIB}


@pytest.mark.parametrize("budget", [0, 100, "4g"])
def test_budget_must_be_at_least_a_page(budget: object) -> None:
    with pytest.raises(InvalidArgument, match="budget_bytes"):
        PinnedRegistry(lambda a, n: None, lambda a: None, budget_bytes=budget)  # type: ignore[arg-type]


def test_without_cuda_gpu_gather_raises_the_typed_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from kvstore.client.gpu_gather import GpuGather

    with pytest.raises(DirectGpuUnavailable, match="no CUDA device"):
        GpuGather()


def test_array_planning_matches_the_span_loop() -> None:
    import numpy as np

    from kvstore.client.gpu_pinned import plan_rounds_array

    rng = np.random.default_rng(3)
    offsets = (rng.permutation(500)[:200] * 57_344 + 16).astype(np.int64)
    length = 500 * 57_344
    spans = [Span(i, int(o), 56_960) for i, o in enumerate(offsets)]
    for budget in (64 * MIB, 3 * MIB):
        fast = plan_rounds_array(offsets, 56_960, length, MIB, budget)
        slow = plan_rounds(spans, length, MIB, budget)
        assert [(list(m), c) for m, c in fast] == [(list(m), c) for m, c in slow]
    with pytest.raises(InvalidArgument, match="outside"):
        plan_rounds_array(offsets, 56_960, int(offsets.max()), MIB, 64 * MIB)
    assert plan_rounds_array(np.zeros(0, dtype=np.int64), 56_960, length, MIB, MIB) == []


def test_columns_come_from_the_reads_arrays_or_its_spans() -> None:
    import numpy as np

    from kvstore.client.gpu_layout import columns

    class Columns:
        offsets = np.array([16, 4112], dtype=np.int64)
        sizes = np.array([64, 64], dtype=np.int64)

    class Spans:
        spans = [Span(0, 16, 64), Span(1, 4112, 64)]

    for read in (Columns(), Spans()):
        offsets, size = columns(read)  # type: ignore[arg-type]
        assert offsets.tolist() == [16, 4112] and size == 64
    mixed = Spans()
    mixed.spans = [Span(0, 16, 64), Span(1, 4112, 68)]
    with pytest.raises(InvalidArgument, match="several sizes"):
        columns(mixed)  # type: ignore[arg-type]
    odd = Spans()
    odd.spans = [Span(0, 16, 66)]
    with pytest.raises(InvalidArgument, match="multiple of 4"):
        columns(odd)  # type: ignore[arg-type]


def test_the_bench_figures_skip_with_a_note_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    import argparse

    from kvstore.bench.report import Progress
    from kvstore.bench.transfer_direct import figures

    notes: dict[str, object] = {}
    assert figures(argparse.Namespace(tokens=1_000_000, block_tokens=64, repeat=3), Progress(False), notes=notes) == []
    assert "skipped: no CUDA device" in str(notes["direct gpu"])


def test_the_synthetic_mapping_is_laid_out_as_lmdb_overflow_values(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    from kvstore.bench.direct_sweep import MappedFile

    with MappedFile(6, 56_960, seed=2, folder=str(tmp_path)) as f:
        assert f.base_address % PAGE_BYTES == 0 and f.map_length == PAGE_BYTES + 6 * 14 * PAGE_BYTES
        assert all(s.offset % PAGE_BYTES == 16 for s in f.spans)
        view = np.frombuffer(Path(f.path).read_bytes(), dtype=np.uint8)
        for s, expected in zip(f.spans, f.expected(), strict=True):
            assert np.array_equal(view[s.offset:s.offset + s.size], expected)
        assert f.verify() == [True] * 6
        f.corrupt(4)
        assert f.verify() == [True, True, True, True, False, True]


def test_the_scatter_table_follows_the_block_layout_and_the_destinations() -> None:
    torch = pytest.importorskip("torch")
    from kvstore.client.gpu_layout import destinations
    from kvstore.geometry import V4_1_FLASH

    geo, cpu = V4_1_FLASH, torch.device("cpu")
    pages = 10
    layers = {layer: (torch.empty((pages, geo.block_rows(layer, 64), 288), dtype=torch.uint8),
                      torch.empty((pages, geo.block_rows(layer, 64) * 68), dtype=torch.uint8))
              for layer in geo.kv_source_layers}
    (src, words, dst, stride), base, slots, align = destinations(layers, [3, 1, 9], 3, geo, 64, cpu)
    layout = geo.block_layout(64)
    assert src.tolist() == [s.offset // 4 for s in layout]
    assert words.tolist() == [s.rows * s.row_bytes // 4 for s in layout]
    tensors = [layers[s.layer][0 if s.component == "compressed_kv" else 1] for s in layout]
    assert base == min(t.data_ptr() for t in tensors)
    assert dst.tolist() == [(t.data_ptr() - base) // 4 for t in tensors]
    assert stride.tolist() == [t.stride(0) // 4 for t in tensors]
    assert slots.tolist() == [3, 1, 9] and align == 4
    assert destinations(layers, None, 4, geo, 64, cpu)[2].tolist() == [0, 1, 2, 3]
    with pytest.raises(InvalidArgument, match="destinations hold"):
        destinations(layers, None, pages + 1, geo, 64, cpu)
    with pytest.raises(InvalidArgument, match="slots must be in"):
        destinations(layers, [0, pages], 2, geo, 64, cpu)
    with pytest.raises(InvalidArgument, match="expected 2 slot ids"):
        destinations(layers, [0], 2, geo, 64, cpu)
    with pytest.raises(InvalidArgument, match="layers"):
        destinations({2: layers[2]}, None, 1, geo, 64, cpu)
    odd = dict(layers)
    odd[14] = (layers[14][0][:, :, :287], layers[14][1])
    with pytest.raises(InvalidArgument, match="layer 14 compressed_kv"):
        destinations(odd, None, 1, geo, 64, cpu)
    shifted = dict(layers)
    shifted[20] = (layers[20][0], torch.empty(pages * 64 * 68 + 8, dtype=torch.uint8)[8:].view(pages, 64 * 68))
    assert destinations(shifted, None, 1, geo, 64, cpu)[3] == 1  # 8-byte aligned only: 4-byte accesses


def test_the_gpu_checksum_table_is_xxh3s_secret_and_primes() -> None:
    from kvstore.client.gpu_layout import XXH3_SECRET, checksums, xxh3_constants

    table = xxh3_constants()
    assert table.dtype.name == "uint64" and len(table) == 163
    # the default secret as in third_party/xxhash/xxhash.h (XXH3_kSecret)
    header = (Path(__file__).parents[3] / "third_party" / "xxhash" / "xxhash.h").read_text()
    body = header[header.index("XXH3_kSecret[XXH_SECRET_DEFAULT_SIZE] = {"):]
    body = body[body.index("{") + 1:body.index("}")]
    assert bytes(int(b, 16) for b in body.replace("\n", " ").split(",") if b.strip()) == XXH3_SECRET
    assert int(table[0]) == int.from_bytes(XXH3_SECRET[:8], "little")
    assert int(table[8 * 15 + 7]) == int.from_bytes(XXH3_SECRET[8 * 22:8 * 23], "little")
    assert [int(x) for x in table[152:160]] == [0xC2B2AE3D, 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                                                0x85EBCA77C2B2AE63, 0x85EBCA77, 0x27D4EB2F165667C5, 0x9E3779B1]

    @dataclass(frozen=True)
    class Checked:
        checksum: int

    class Spans:
        spans = [Checked(5), Checked(2**63)]

    class Columns(Spans):
        checksums = [7, 2**64 - 1]

    assert checksums(Spans()).tolist() == [5, 2**63]  # type: ignore[arg-type]
    assert checksums(Columns()).tolist() == [7, 2**64 - 1]  # type: ignore[arg-type]


def test_checksums_on_must_be_a_place() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from kvstore.client.gpu_gather import GpuGather

    with pytest.raises(InvalidArgument, match="checksums_on"):
        GpuGather(checksums_on="tpu")


def test_the_usable_prefix_ends_at_the_first_corrupt_block_and_at_the_lookups_count() -> None:
    from kvstore.client.gpu_layout import usable_prefix

    assert usable_prefix(10, [], None) == 10
    assert usable_prefix(10, [7, 3], None) == 3
    assert usable_prefix(10, [], 6) == 6
    assert usable_prefix(10, [8], 9) == 8
    assert usable_prefix(10, [], 12) == 10
    assert usable_prefix(10, [], True) == 10  # not a count
