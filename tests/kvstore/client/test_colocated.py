"""The same-host reader (kvstore.client.colocated) against a real `kvstore serve` and its real LMDB file."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore.client.colocated import BlockSpan, ColocatedReader
from kvstore.errors import ConfigError, FailedPrecondition, InvalidArgument, Unavailable
from kvstore.native import blockcopy
from tests.children import START_DEADLINE_S
from tests.kvstore.client.test_colocated_support import Store, damage, payload, prompt

#: The `store` and `new_store` fixtures (a test module cannot import a conftest under importlib mode).
pytest_plugins = ["tests.kvstore.client.test_colocated_support"]


def test_reads_equal_the_servers_get_for_random_block_sets(store: Store) -> None:
    rng = random.Random(14)
    client = store.client()
    stored = []
    for n in (3, 9, 1, 17):
        tokens = prompt(rng, n)
        client.put(tokens, payload(rng, n, client.block_bytes))
        stored.append(client.hashes(tokens))
    reader = store.reader(threads=3)
    lookups_before = client.stats().lookups
    for _ in range(12):
        chain = rng.choice(stored)
        # A stored prefix, sometimes followed by blocks never stored: the read is the found prefix.
        asked = chain[: rng.randint(1, len(chain))] + [rng.randbytes(32) for _ in range(rng.randint(0, 2))]
        want = client.get_hashes(asked)
        with reader.read(client, asked) as read:
            assert read.found_blocks == want.found_prefix_blocks == len(read.spans)
            assert [s.index for s in read.spans] == list(range(len(read.spans)))
            for span, block in zip(read.spans, want.blocks, strict=False):
                assert isinstance(span, BlockSpan) and span.size == client.block_bytes
                assert span.checksum == xxhash.xxh3_64_intdigest(block)
                assert bytes(read.view(span.index)) == block
                assert span.offset + span.size <= read.map_length
            assert read.verify() == [True] * len(read.spans)
            out = bytearray(len(read.spans) * client.block_bytes)
            assert read.copy_into(out) == []
            assert bytes(out) == b"".join(b for b in want.blocks[: len(read.spans)] if b is not None)
    assert client.stats().lookups == lookups_before + 12  # each read is a Lookup: a use the server counts


def test_spans_are_offsets_into_this_processs_mapping(store: Store) -> None:
    """What the GPU path reads: base_address + offset is the block, in place."""
    import ctypes

    rng = random.Random(2)
    client = store.client()
    tokens = prompt(rng, 4)
    blocks = payload(rng, 4, client.block_bytes)
    client.put(tokens, blocks)
    with store.reader().read(client, client.hashes(tokens)) as read:
        for span in read.spans:
            assert ctypes.string_at(read.base_address + span.offset, span.size) == blocks[span.index].tobytes()
        # The offset is the block's offset in the file, too.
        with open(store.data_dir / "data.mdb", "rb") as f:
            f.seek(read.spans[2].offset)
            assert f.read(read.spans[2].size) == blocks[2].tobytes()


def test_a_block_evicted_and_rewritten_while_a_read_is_open_keeps_the_leased_bytes(new_store) -> None:
    rng = random.Random(3)
    s = new_store("small", capacity_bytes=8 * 14_240)  # room for 8 blocks
    s.start()
    client = s.client()
    tokens = prompt(rng, 8)
    old = payload(rng, 8, client.block_bytes)
    client.put(tokens, old)
    hashes = client.hashes(tokens)
    reader = s.reader()
    read = reader.read(client, hashes, lease_ms=1)
    assert len(read.spans) == 8
    s.clock.advance(73 * 3600)  # past the 1 ms lease and the 72 h retention: eviction may take the blocks
    client.put(prompt(rng, 8), payload(rng, 8, client.block_bytes))  # evicts the whole first chain
    assert client.lookup(tokens).found_blocks == 0
    s.clock.advance(73 * 3600)
    new = payload(rng, 8, client.block_bytes)
    client.put(tokens, new)  # the same hashes, other bytes, written where LMDB finds free pages
    assert client.get_hashes(hashes).blocks[0] == new[0].tobytes()
    # The open read still sees what it leased: its txn keeps those pages from reuse.
    assert read.verify() == [True] * 8
    out = np.zeros_like(old)
    assert read.copy_into(out) == []
    assert (out == old).all()
    read.close()
    with reader.read(client, hashes) as fresh:
        out2 = np.zeros_like(new)
        assert fresh.copy_into(out2) == [] and (out2 == new).all()


def test_a_corrupt_block_is_a_miss_reported_dropped_and_counted_by_the_server(store: Store) -> None:
    rng = random.Random(4)
    client = store.client()
    tokens = prompt(rng, 6)
    client.put(tokens, payload(rng, 6, client.block_bytes))
    hashes = client.hashes(tokens)
    reader = store.reader()
    with reader.read(client, hashes) as read:
        offset = read.spans[3].offset
    damage(store.data_dir, offset + 100)
    assert client.stats().corrupt_blocks == 0
    with reader.read(client, hashes) as read:
        assert read.verify() == [True, True, True, False, True, True]
        out = np.zeros((6, client.block_bytes), dtype=np.uint8)
        assert read.copy_into(out) == [3]
        assert not out[3].any()  # a corrupt block's rows are left as they were
        read.report_corrupt([3])
        assert read.reported == {3: "corrupt"}
    assert client.stats().corrupt_blocks == 1
    assert client.lookup(tokens).found_blocks == 3  # it and its descendants are gone


def test_a_lying_report_drops_nothing(store: Store) -> None:
    rng = random.Random(5)
    client = store.client()
    tokens = prompt(rng, 4)
    client.put(tokens, payload(rng, 4, client.block_bytes))
    with store.reader().read(client, client.hashes(tokens)) as read:
        read.report_corrupt([0, 2])  # intact blocks: the server checks them itself
        assert read.reported == {0: "found", 2: "found"}
    assert client.stats().corrupt_blocks == 0
    assert client.lookup(tokens).found_blocks == 4


def test_a_report_reaches_only_the_callers_own_tenant(store: Store) -> None:
    rng = random.Random(6)
    mine, other = store.client(), store.client(namespace="other")
    tokens = prompt(rng, 3)
    mine.put(tokens, payload(rng, 3, mine.block_bytes))
    reader = store.reader()
    with reader.read(mine, mine.hashes(tokens)) as read:
        damage(store.data_dir, read.spans[1].offset + 10)
    with reader.read(other, other.hashes(tokens)) as read:  # the other tenant has none of these blocks
        assert read.spans == []
        read.report_corrupt([1])
        assert read.reported == {1: "missing"}
    assert mine.stats().corrupt_blocks == 0 and mine.lookup(tokens).found_blocks == 3


def test_the_server_restarting_during_a_read(store: Store) -> None:
    rng = random.Random(7)
    client = store.client()
    tokens = prompt(rng, 5)
    blocks = payload(rng, 5, client.block_bytes)
    client.put(tokens, blocks)
    reader = store.reader()
    read = reader.read(client, client.hashes(tokens))
    assert store.server is not None and store.server.stop() == 0
    # The read holds its own txn in this process: its bytes stay readable with the server gone.
    assert read.verify() == [True] * 5
    out = np.zeros_like(blocks)
    assert read.copy_into(out) == [] and (out == blocks).all()
    with pytest.raises(Unavailable):
        reader.read(client, client.hashes(tokens))  # the Lookup cannot be asked: a typed, retryable error
    store.start()  # the new server opens the store beside this process's reader
    read.close()  # its lease died with the old server: closing is still clean
    client2 = store.client()
    with reader.read(client2, client2.hashes(tokens)) as again:
        out2 = np.zeros_like(blocks)
        assert again.copy_into(out2) == [] and (out2 == blocks).all()


def test_the_data_dir_lock_stops_a_second_server_but_lets_readers_in(store: Store, tmp_path: Path) -> None:
    reader = store.reader()  # a reader beside the running server
    second = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--data-dir",
                             str(store.data_dir), "--config", str(store.config)],
                            capture_output=True, text=True, timeout=START_DEADLINE_S, check=False)
    assert second.returncode == 2 and "in use by another kvstore process" in second.stderr
    # The lock is the server's alone: a second reader process gets in too.
    code = ("import sys; from kvstore.client.colocated import ColocatedReader; "
            f"r = ColocatedReader({str(store.data_dir)!r}); r.close(); print('ok')")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=START_DEADLINE_S, check=False)
    assert other.stdout.strip() == "ok", other.stderr
    client = store.client()
    with reader.read(client, [bytes(32)]) as read:
        assert read.spans == []


def test_bad_input_gives_typed_errors(store: Store, tmp_path: Path) -> None:
    rng = random.Random(8)
    with pytest.raises(ConfigError):
        ColocatedReader(tmp_path / "nothing-here")
    with pytest.raises(InvalidArgument):
        ColocatedReader(123)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        ColocatedReader(store.data_dir, threads=0)
    client = store.client()
    tokens = prompt(rng, 2)
    client.put(tokens, payload(rng, 2, client.block_bytes))
    reader = store.reader()
    with pytest.raises(InvalidArgument):
        reader.read(client, [b"short"])
    with pytest.raises(InvalidArgument):
        reader.read("not a client", [bytes(32)])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        reader.read(client, [bytes(32)], lease_ms=-1)
    read = reader.read(client, client.hashes(tokens))
    with pytest.raises(InvalidArgument):
        read.verify([2])
    with pytest.raises(InvalidArgument):
        read.verify(["0"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        read.copy_into(bytes(2 * client.block_bytes))  # read-only
    with pytest.raises(InvalidArgument):
        read.copy_into(bytearray(client.block_bytes))  # too small
    with pytest.raises(InvalidArgument):
        read.report_corrupt([5])
    read.close()
    with pytest.raises(FailedPrecondition):
        read.verify()
    reader.close()
    with pytest.raises(FailedPrecondition):
        reader.read(client, client.hashes(tokens))


def test_closing_the_reader_closes_its_reads_and_runs_its_hooks(store: Store) -> None:
    reader = store.reader()
    client = store.client()
    ran: list[str] = []
    reader.on_close(lambda: ran.append("hook"))
    read = reader.read(client, [bytes(32)])
    reader.close()
    assert ran == ["hook"]
    with pytest.raises(FailedPrecondition):
        read.verify()


@pytest.mark.parametrize("native", [True, False])
def test_verify_many_flags_exactly_the_bad_blocks(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if native and not blockcopy.NATIVE_VERIFY:
        pytest.skip("kvstore.native._blockcopy is not built")
    if not native:
        monkeypatch.setattr(blockcopy, "verify", blockcopy.verify_python)
        monkeypatch.setattr(blockcopy, "NATIVE_VERIFY", False)
    rng = random.Random(9)
    datas = [rng.randbytes(rng.randint(1, 70_000)) for _ in range(100)]
    sums = [xxhash.xxh3_64_intdigest(d) for d in datas]
    bad = {3, 50, 99}
    for i in bad:
        sums[i] ^= 1
    assert blockcopy.verify_many(datas, sums, threads=4) == [i not in bad for i in range(100)]
    assert blockcopy.verify_many([None], [0]) == [False]
    with pytest.raises(ValueError):
        blockcopy.verify_many(datas, sums[:-1])


def test_the_native_verify_and_addresses_match_their_python_forms() -> None:
    if not blockcopy.NATIVE_VERIFY:
        pytest.skip("kvstore.native._blockcopy is not built")
    datas = [b"abc", None, bytes(60_000)]
    sums = [xxhash.xxh3_64_intdigest(b"abc"), 0, 7]
    assert blockcopy.verify(datas, sums) == blockcopy.verify_python(datas, sums) == b"\x01\x00\x00"
    arrays = [np.arange(10, dtype=np.uint8), None, memoryview(b"xyz")]
    assert blockcopy.addresses(arrays) == blockcopy.addresses_python(arrays)
    with pytest.raises(TypeError):
        blockcopy.addresses([1])


def test_a_reader_refuses_to_read_once_the_store_file_was_replaced(store: Store) -> None:
    """`kvstore check --repair` may swap in a rebuilt data.mdb: the old mapping must not be trusted."""
    import shutil

    reader = store.reader()
    assert store.server is not None and store.server.stop() == 0
    shutil.copyfile(store.data_dir / "data.mdb", store.data_dir / "data.mdb.new")
    (store.data_dir / "data.mdb.new").replace(store.data_dir / "data.mdb")
    store.start()
    with pytest.raises(FailedPrecondition, match="was replaced"):
        reader.read(store.client(), [bytes(32)])


@pytest.mark.parametrize("native", [True, False])
def test_copy_many_checks_and_copies_every_block(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.native.records import META_STRUCT

    if native and not blockcopy.NATIVE_VERIFY:
        pytest.skip("kvstore.native._blockcopy is not built")
    if not native:
        monkeypatch.setattr(blockcopy, "verify_copy", blockcopy.verify_copy_python)
        monkeypatch.setattr(blockcopy, "NATIVE_VERIFY", False)
    rng = random.Random(10)
    datas = [rng.randbytes(1000) for _ in range(40)]
    metas = [META_STRUCT.pack(bytes(32), 1, len(d), xxhash.xxh3_64_intdigest(d), 0.0, 0.0) for d in datas]
    metas[7] = META_STRUCT.pack(bytes(32), 1, 1000, 1, 0.0, 0.0)  # a wrong checksum
    out = bytearray(40 * 1000)
    view = memoryview(out)
    codes = blockcopy.copy_many(metas, datas, [view[i * 1000:(i + 1) * 1000] for i in range(40)], threads=3)
    assert [i for i, c in enumerate(codes) if c != blockcopy.FOUND] == [7]
    assert out[7000:8000] == bytes(1000)  # never copied
    assert out[:7000] == b"".join(datas[:7]) and out[8000:] == b"".join(datas[8:])


def test_the_native_record_search_finds_what_lmdbs_gets_find(new_store) -> None:
    """1,200 blocks: a records tree three levels deep; random prefixes and strays, both ways equal."""
    if blockcopy.resolve is None:
        pytest.skip("kvstore.native._blockcopy is not built")
    rng = random.Random(11)
    s = new_store("deep")
    s.start()
    client = s.client()
    chains = []
    for n in (700, 500):
        tokens = prompt(rng, n)
        client.put(tokens, payload(rng, n, client.block_bytes))
        chains.append(client.hashes(tokens))
    native, plain = s.reader(), None
    for _ in range(6):
        chain = rng.choice(chains)
        asked = [*chain[: rng.randint(1, len(chain))], rng.randbytes(32)]
        with native.read(client, asked) as a:
            assert a.resolved_by == "native" and len(a) == len(asked) - 1
            got = (a.offsets.tolist(), a.sizes.tolist(), a.checksums.tolist())
            assert all(a.verify())
            sample = rng.sample(range(len(a)), 5)
            blocks = client.get_hashes([asked[i] for i in sample]).blocks
            assert [bytes(a.view(i)) for i in sample] == blocks
        native.close()  # one environment per process: reopen it without the native search
        plain = s.reader(native=False)
        with plain.read(client, asked) as b:
            assert b.resolved_by == "lmdb"
            assert (b.offsets.tolist(), b.sizes.tolist(), b.checksums.tolist()) == got
        plain.close()
        native = s.reader()


def test_the_native_search_refuses_what_it_cannot_trust(store: Store) -> None:
    if blockcopy.resolve is None:
        pytest.skip("kvstore.native._blockcopy is not built")
    import ctypes

    junk = ctypes.create_string_buffer(64 * 4096)
    with pytest.raises(ValueError):  # a root that is no B-tree page
        blockcopy.resolve(ctypes.addressof(junk), len(junk), 4096, 5, b"p" * 16, [bytes(32)])
    with pytest.raises(ValueError):
        blockcopy.resolve(ctypes.addressof(junk), len(junk), 4096, 5, b"p", [bytes(32), bytes(31)])
    reader = store.reader()
    client = store.client()
    tokens = prompt(random.Random(12), 1)
    client.put(tokens, payload(random.Random(12), 1, client.block_bytes))
    with reader.read(client, client.hashes(tokens)) as read:
        assert read.resolved_by == "native"
        txn_id = read._txn.id()  # type: ignore[union-attr]
        psize = 4096
        assert blockcopy.named_root(read.base_address, read.map_length, psize, txn_id, b"records") is not None
        # Another snapshot's id (as after two commits): the meta pages no longer tell, so no root.
        assert blockcopy.named_root(read.base_address, read.map_length, psize, txn_id + 7, b"records") is None
        assert blockcopy.named_root(read.base_address, read.map_length, psize, txn_id, b"nosuch") is None


def test_verify_spans_checks_blocks_in_place() -> None:
    if blockcopy.resolve is None:
        pytest.skip("kvstore.native._blockcopy is not built")
    import ctypes

    rng = random.Random(13)
    buf = ctypes.create_string_buffer(rng.randbytes(100_000), 100_000)
    base = ctypes.addressof(buf)
    offsets = np.array([0, 5_000, 60_000, 99_990, 99_995], dtype=np.int64)
    sizes = np.array([1_000, 50_000, 30_000, 10, 10], dtype=np.int64)  # the last runs past the end
    sums = np.array([xxhash.xxh3_64_intdigest(buf.raw[o:o + z]) for o, z in zip(offsets, sizes, strict=True)],
                    dtype=np.uint64)
    sums[2] ^= np.uint64(1)
    assert blockcopy.verify_spans(base, 100_000, offsets, sizes, sums, threads=2) == [True, True, False, True, False]
