"""The direct GPU restore over a real `kvstore serve` child's store, on a CUDA device.

Marked gpu; skipped without CUDA (CI runs the CPU side of the same reader in
test_colocated*.py and test_restore*.py). Each test reads the server's own
data file through `ColocatedReader` and checks what `GpuGather` put on the GPU
against the server's Get of the same prompt.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvstore.client import Client  # noqa: E402
from kvstore.codec.block_codec import split_blocks  # noqa: E402
from kvstore.geometry import V4_1_FLASH  # noqa: E402
from tests.children import Child  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BT = 64
BLOCK = V4_1_FLASH.block_bytes(BT)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Client, Path]]:
    data_dir = tmp_path / "store"
    server = Child("serve", ["serve", "--port", "0", "--data-dir", str(data_dir)], tmp_path / "logs")
    try:
        with Client(server.target) as client:
            yield client, data_dir
    finally:
        server.kill_if_alive()


def _prompts(client: Client, rng: random.Random, sizes: list[int]) -> list[list[int]]:
    """Store prompts of `sizes` blocks of random tokens and random bytes; return their tokens."""
    out = []
    for blocks in sizes:
        tokens = [rng.randrange(1 << 31) for _ in range(blocks * BT)]
        data = torch.randint(0, 256, (blocks, BLOCK), dtype=torch.uint8)
        client.put(tokens, data)
        out.append(tokens)
    return out


def test_random_block_sets_equal_the_servers_get(store: tuple[Client, Path]) -> None:
    from kvstore.client.colocated import ColocatedReader
    from kvstore.client.gpu_gather import GpuGather

    client, data_dir = store
    rng = random.Random(14)
    prompts = _prompts(client, rng, [3, 40, 130, 17])
    with ColocatedReader(data_dir) as reader, GpuGather() as gather:
        reader.on_close(gather.close)
        for _ in range(8):
            tokens = rng.choice(prompts)
            k = rng.randrange(1, len(tokens) // BT + 1)
            asked = tokens[:k * BT] + [rng.randrange(1 << 31) for _ in range(rng.choice([0, BT, 3 * BT]))]
            expected, found = client.get_tensor(tokens[:k * BT])
            with reader.read(client, client.hashes(asked)) as read:
                assert len(read.spans) == found == k
                out = torch.full((len(client.hashes(asked)), BLOCK), 0x5A, dtype=torch.uint8, device="cuda")
                _, result = gather.gather(read, out)
            assert result.blocks == k and result.corrupt == []
            assert torch.equal(out[:k].cpu(), expected[:k])


def test_scatter_from_the_store_fills_per_layer_pages(store: tuple[Client, Path]) -> None:
    from kvstore.client.colocated import ColocatedReader
    from kvstore.client.gpu_gather import GpuGather

    client, data_dir = store
    geo = V4_1_FLASH
    (tokens,) = _prompts(client, random.Random(15), [24])
    pages = torch.randperm(64)[:24]
    layers = {layer: (torch.zeros((64, geo.block_rows(layer, BT), geo.compressed_kv_row_bytes), dtype=torch.uint8,
                                  device="cuda"),
                      torch.zeros((64, geo.block_rows(layer, BT), geo.indexer_row_bytes), dtype=torch.uint8,
                                  device="cuda"))
              for layer in geo.kv_source_layers}
    with ColocatedReader(data_dir) as reader, GpuGather() as gather, \
            reader.read(client, client.hashes(tokens)) as read:
        result = gather.scatter(read, layers, pages)
    assert result.blocks == 24
    expected = split_blocks(geo, client.get_tensor(tokens)[0], BT)
    for layer, (kv, index) in layers.items():
        assert torch.equal(kv[pages].cpu(), expected[layer][0])
        assert torch.equal(index[pages].cpu(), expected[layer][1])


def test_a_corrupt_block_in_the_store_is_a_miss_reported_to_the_server(store: tuple[Client, Path]) -> None:
    from kvstore.client.colocated import ColocatedReader
    from kvstore.client.gpu_gather import GpuGather

    client, data_dir = store
    (tokens,) = _prompts(client, random.Random(16), [12])
    with ColocatedReader(data_dir) as reader, GpuGather() as gather:
        with reader.read(client, client.hashes(tokens)) as read:
            offset = read.spans[7].offset
        with open(data_dir / "data.mdb", "r+b") as f:  # the page cache both processes map
            f.seek(offset + 1000)
            byte = f.read(1)
            f.seek(offset + 1000)
            f.write(bytes([byte[0] ^ 0x01]))
        with reader.read(client, client.hashes(tokens)) as read:
            out = torch.empty((12, BLOCK), dtype=torch.uint8, device="cuda")
            _, result = gather.gather(read, out)
            assert result.blocks == 7 and result.corrupt == [7]
            assert read.reported == {7: "corrupt"}
    # The server checked it and dropped it: the chain now ends before it.
    assert client.lookup(tokens).found_blocks == 7


def test_the_restore_facade_takes_the_direct_gpu_path(store: tuple[Client, Path]) -> None:
    from kvstore.client.colocated import ColocatedReader
    from kvstore.client.restore import restore

    client, data_dir = store
    (tokens,) = _prompts(client, random.Random(17), [33])
    dest = torch.full((40, BLOCK), 0x11, dtype=torch.uint8, device="cuda")
    with ColocatedReader(data_dir) as reader:
        result = restore(client, tokens, dest, reader=reader)
        again = restore(client, tokens, dest, reader=reader, path="direct-gpu")  # the reader's GpuGather, reused
    assert (result.path, result.blocks, result.corrupt) == ("direct-gpu", 33, [])
    assert (again.path, again.blocks) == ("direct-gpu", 33)
    assert torch.equal(dest[:33].cpu(), client.get_tensor(tokens)[0])
    assert (dest[33:] == 0x11).all()
