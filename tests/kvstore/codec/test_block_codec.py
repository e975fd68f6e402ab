"""Blocks are the model's rows: per source layer, compressed-KV rows then indexer rows, in position order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.codec import block_codec, rows
from kvstore.errors import InvalidArgument
from kvstore.geometry import TINY, V4_1_FLASH, ModelGeometry

LayerRows = dict[int, tuple[torch.Tensor, torch.Tensor]]


def random_rows(geometry: ModelGeometry, block_tokens: int = 64, n: int = 1, seed: int = 0) -> LayerRows:
    """Random row bytes, `[n * rows, row_bytes]` per layer and kind."""
    gen = torch.Generator().manual_seed(seed)

    def make(count: int, width: int) -> torch.Tensor:
        return torch.randint(0, 256, (count, width), generator=gen, dtype=torch.uint8)

    return {layer: (make(n * geometry.block_rows(layer, block_tokens), geometry.compressed_kv_row_bytes),
                    make(n * geometry.block_rows(layer, block_tokens), geometry.indexer_row_bytes))
            for layer in geometry.kv_source_layers}


def spec_offsets(geometry: ModelGeometry, block_tokens: int) -> dict[tuple[int, str], int]:
    """Where each run of rows starts, computed from the rule in words (not from block_layout)."""
    out, offset = {}, 0
    for layer in geometry.kv_source_layers:
        count = block_tokens // geometry.compress_ratios[layer]
        out[layer, "kv"] = offset
        offset += count * geometry.compressed_kv_row_bytes
        out[layer, "index"] = offset
        offset += count * geometry.indexer_row_bytes
    assert offset == geometry.block_bytes(block_tokens)
    return out


@pytest.mark.parametrize(("geometry", "block_tokens"), [(V4_1_FLASH, 64), (V4_1_FLASH, 2), (TINY, 64), (TINY, 8)])
def test_every_row_lands_where_the_spec_says(geometry: ModelGeometry, block_tokens: int) -> None:
    layers = random_rows(geometry, block_tokens)
    block = block_codec.join_block(geometry, layers, block_tokens)
    assert block.dtype == torch.uint8 and block.shape == (geometry.block_bytes(block_tokens),)
    offsets = spec_offsets(geometry, block_tokens)
    kv_w, ix_w = geometry.compressed_kv_row_bytes, geometry.indexer_row_bytes
    for layer, (kv, index) in layers.items():
        for j in range(kv.shape[0]):
            at = offsets[layer, "kv"] + j * kv_w
            assert torch.equal(block[at:at + kv_w], kv[j]), (layer, "kv", j)
            at = offsets[layer, "index"] + j * ix_w
            assert torch.equal(block[at:at + ix_w], index[j]), (layer, "index", j)


def test_v4_1_flash_block_offsets() -> None:
    offsets = spec_offsets(V4_1_FLASH, 64)
    assert [offsets[layer, kind] for layer in (2, 8, 14, 20) for kind in ("kv", "index")] == [
        0, 9216, 11392, 20608, 22784, 32000, 34176, 52608]
    assert V4_1_FLASH.block_bytes(64) == 56_960


@pytest.mark.parametrize("geometry", [V4_1_FLASH, TINY])
def test_split_gives_back_the_rows(geometry: ModelGeometry) -> None:
    layers = random_rows(geometry)
    block = block_codec.join_block(geometry, layers)
    raw = bytes(block.numpy())
    for buf in (block, raw, bytearray(raw), memoryview(raw)):
        back = block_codec.split_block(geometry, buf)
        assert list(back) == list(geometry.kv_source_layers)
        for layer, (kv, index) in layers.items():
            assert torch.equal(back[layer][0], kv) and torch.equal(back[layer][1], index)
            assert back[layer][0].is_contiguous() and back[layer][1].is_contiguous()


def test_split_block_returns_views_not_copies() -> None:
    data = bytearray(block_codec.join_block(V4_1_FLASH, random_rows(V4_1_FLASH)).numpy().tobytes())
    views = block_codec.split_block(V4_1_FLASH, data)
    kv20, index20 = views[20]
    assert kv20.shape == (64, 288) and index20.shape == (64, 68) and views[2][0].shape == (32, 288)
    data[34176] ^= 0xFF  # layer 20's first kv byte: the change shows through the view
    data[-1] ^= 0xFF
    assert kv20[0, 0].item() == data[34176] and index20[-1, -1].item() == data[-1]
    block = block_codec.join_block(V4_1_FLASH, random_rows(V4_1_FLASH))
    assert block_codec.split_block(V4_1_FLASH, block)[8][1].data_ptr() == block.data_ptr() + 20608


def test_join_blocks_is_join_block_per_block() -> None:
    n = 3
    layers = random_rows(V4_1_FLASH, n=n, seed=1)
    blocks = block_codec.join_blocks(V4_1_FLASH, layers)
    assert blocks.shape == (n, 56_960)
    for i in range(n):
        one = {layer: (kv[i * kv.shape[0] // n:(i + 1) * kv.shape[0] // n],
                       index[i * index.shape[0] // n:(i + 1) * index.shape[0] // n])
               for layer, (kv, index) in layers.items()}
        assert torch.equal(blocks[i], block_codec.join_block(V4_1_FLASH, one))
    as_3d = {layer: (kv.view(n, -1, 288), index.view(n, -1, 68)) for layer, (kv, index) in layers.items()}
    assert torch.equal(block_codec.join_blocks(V4_1_FLASH, as_3d), blocks)
    out = torch.zeros(n, 56_960, dtype=torch.uint8)
    assert block_codec.join_blocks(V4_1_FLASH, layers, out=out) is out and torch.equal(out, blocks)


@pytest.mark.parametrize("geometry", [V4_1_FLASH, TINY])
def test_split_blocks_inverts_join_blocks_with_views(geometry: ModelGeometry) -> None:
    n = 4
    layers = random_rows(geometry, n=n, seed=2)
    blocks = block_codec.join_blocks(geometry, layers)
    back = block_codec.split_blocks(geometry, blocks)
    for layer, (kv, index) in layers.items():
        got_kv, got_index = back[layer]
        assert got_kv.shape == (n, geometry.block_rows(layer, 64), geometry.compressed_kv_row_bytes)
        assert torch.equal(got_kv.reshape(-1, kv.shape[1]), kv)
        assert torch.equal(got_index.reshape(-1, index.shape[1]), index)
        assert got_kv.untyped_storage().data_ptr() == blocks.untyped_storage().data_ptr()  # a view
    flat = bytes(blocks.numpy())
    assert all(torch.equal(a, b) for layer in back
               for a, b in zip(back[layer], block_codec.split_blocks(geometry, flat)[layer], strict=True))
    blocks[1, 0] ^= 0xFF
    first = geometry.kv_source_layers[0]
    assert back[first][0][1, 0, 0].item() == blocks[1, 0].item()


def test_bad_rows_raise_invalid_argument() -> None:
    good = random_rows(V4_1_FLASH)
    cases: list[tuple[object, str]] = [
        ({k: v for k, v in good.items() if k != 8}, r"expected layers \[2, 8, 14, 20\], got \[2, 14, 20\]"),
        ({**good, 3: good[2]}, r"expected layers \[2, 8, 14, 20\]"),
        ([1, 2], "expected a dict"),
        ({**good, 20: good[20][0]}, r"layer 20: expected a pair"),
        ({**good, 2: (good[2][0].float(), good[2][1])}, "layer 2 compressed_kv: expected uint8, got float32"),
        ({**good, 2: (good[2][0], good[2][1][:, :64])}, r"layer 2 indexer: expected shape .*got \(32, 64\)"),
        ({**good, 20: (good[20][0][:63], good[20][1])}, r"layer 20 compressed_kv: expected shape \[n \* 64, 288\]"),
        ({**good, 20: (good[20][0].view(1, 1, 64, 288), good[20][1])}, "layer 20 compressed_kv: expected shape"),
        ({**good, 14: (good[14][0].tolist(), good[14][1])},
         r"layer 14 compressed_kv: expected uint8 \[n \* 32, 288\] .*as a torch tensor, a numpy array, bytes, "
         r"bytearray or memoryview; got list"),
        ({**good, 14: (bytes(288 * 33), good[14][1])},
         r"layer 14 compressed_kv: expected a buffer of whole blocks of rows, n \* 32 x 288 = n \* 9216 bytes, "
         r"got 9504 bytes"),
        ({**good, 20: (torch.cat([good[20][0]] * 2), torch.cat([good[20][1]] * 2))}, "different numbers of blocks"),
        ({**good, 8: (good[8][0].to("meta"), good[8][1])}, r"rows are on several devices: \['cpu', 'meta'\]"),
    ]
    for layers, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            block_codec.join_blocks(V4_1_FLASH, layers)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="multiple of 2"):
        block_codec.join_block(V4_1_FLASH, good, 63)
    two = random_rows(V4_1_FLASH, n=2)
    with pytest.raises(InvalidArgument, match=r"these hold 2 \(use join_blocks\)"):
        block_codec.join_block(V4_1_FLASH, two)
    with pytest.raises(InvalidArgument, match=r"out: expected a uint8 tensor \[2, 56960\]"):
        block_codec.join_blocks(V4_1_FLASH, two, out=torch.empty(2, 56_961, dtype=torch.uint8))
    with pytest.raises(InvalidArgument, match=r"out: expected .*contiguous rows"):
        block_codec.join_blocks(V4_1_FLASH, two, out=torch.empty(56_960, 2, dtype=torch.uint8).t())


def test_bad_blocks_raise_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="expected 56960 bytes, got 10"):
        block_codec.split_block(V4_1_FLASH, b"\0" * 10)
    with pytest.raises(InvalidArgument, match="uint8 tensor"):
        block_codec.split_block(V4_1_FLASH, torch.zeros(56_960, dtype=torch.int16))
    with pytest.raises(InvalidArgument, match="multiple of 2"):
        block_codec.split_block(V4_1_FLASH, bytes(890 * 63), 63)
    with pytest.raises(InvalidArgument, match="expected a whole number of 56960-byte blocks, got 56961 bytes"):
        block_codec.split_blocks(V4_1_FLASH, bytes(56_961))
    with pytest.raises(InvalidArgument, match=r"blocks: expected a uint8 tensor or array \[n, 56960\]"):
        block_codec.split_blocks(V4_1_FLASH, torch.zeros(2, 56_960, dtype=torch.int8))
    with pytest.raises(InvalidArgument, match="expected a whole number of 56960-byte blocks, got str"):
        block_codec.split_blocks(V4_1_FLASH, "x" * 56_960)


def float_layers(geometry: ModelGeometry, n: int = 1, seed: int = 3) -> LayerRows:
    gen = torch.Generator().manual_seed(seed)
    return {layer: (torch.randn(n * geometry.block_rows(layer, 64), geometry.head_dim, generator=gen) * 2,
                    torch.randn(n * geometry.block_rows(layer, 64), geometry.index_head_dim, generator=gen))
            for layer in geometry.kv_source_layers}


@pytest.mark.parametrize("geometry", [V4_1_FLASH, TINY])
def test_encode_blocks_quantizes_with_the_models_rows(geometry: ModelGeometry) -> None:
    values = float_layers(geometry, n=2)
    blocks = block_codec.encode_blocks(geometry, values)
    expected = {layer: (rows.compressed_kv_rows(kv), rows.indexer_key_rows(index))
                for layer, (kv, index) in values.items()}
    assert torch.equal(blocks, block_codec.join_blocks(geometry, expected))
    decoded = block_codec.decode_blocks(geometry, blocks)
    for layer, (kv, index) in expected.items():
        assert torch.equal(decoded[layer][0].reshape(kv.shape[0], -1), rows.decode_compressed_kv_rows(kv))
        assert torch.equal(decoded[layer][1].reshape(index.shape[0], -1), rows.decode_indexer_key_rows(index))
    one = block_codec.encode_block(geometry, float_layers(geometry, n=1))
    assert one.shape == (geometry.block_bytes(64),)
    decoded_one = block_codec.decode_block(geometry, one)
    again = block_codec.decode_block(geometry, block_codec.encode_block(geometry, decoded_one))
    for layer, (kv, index) in decoded_one.items():  # decoded values re-encode to the very same values
        assert torch.equal(again[layer][0], kv) and torch.equal(again[layer][1], index)


def test_encode_refuses_bad_values() -> None:
    values = float_layers(V4_1_FLASH)
    with pytest.raises(InvalidArgument, match="layer 2 compressed_kv: expected float32 or bfloat16 or float16"):
        block_codec.encode_block(V4_1_FLASH, {**values, 2: (values[2][0].to(torch.uint8), values[2][1])})
    with pytest.raises(InvalidArgument, match=r"layer 8 indexer: expected shape \[n \* 32, 128\]"):
        block_codec.encode_block(V4_1_FLASH, {**values, 8: (values[8][0], values[8][1][:, :64])})
    values[14][1][3, 5] = float("nan")
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        block_codec.encode_block(V4_1_FLASH, values)
    with pytest.raises(InvalidArgument, match="these hold 2"):
        block_codec.encode_block(V4_1_FLASH, float_layers(V4_1_FLASH, n=2))


# -- numpy arrays and buffers (kvstore.codec.arrays): what Client.put takes ---------------

def numpy_rows(layers: LayerRows) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    return {layer: (kv.numpy(), index.numpy()) for layer, (kv, index) in layers.items()}


@pytest.mark.parametrize("geometry", [V4_1_FLASH, TINY])
def test_join_blocks_of_numpy_rows_gives_numpy_blocks_equal_to_the_tensors(geometry: ModelGeometry) -> None:
    layers = random_rows(geometry, n=3, seed=4)
    expected = block_codec.join_blocks(geometry, layers).numpy()
    got = block_codec.join_blocks(geometry, numpy_rows(layers))
    assert isinstance(got, np.ndarray) and got.dtype == np.uint8 and np.array_equal(got, expected)
    as_3d = {layer: (kv.reshape(3, -1, kv.shape[1]), ix.reshape(3, -1, ix.shape[1]))
             for layer, (kv, ix) in numpy_rows(layers).items()}
    assert np.array_equal(block_codec.join_blocks(geometry, as_3d), expected)
    one = random_rows(geometry, seed=5)
    single = block_codec.join_block(geometry, numpy_rows(one))
    assert isinstance(single, np.ndarray) and np.array_equal(single, block_codec.join_block(geometry, one).numpy())


def test_join_blocks_of_flat_buffers_reads_whole_rows() -> None:
    layers = random_rows(V4_1_FLASH, n=2, seed=6)
    expected = block_codec.join_blocks(V4_1_FLASH, layers)
    for kind in (bytes, bytearray, memoryview):
        flat = {layer: (kind(kv.numpy().tobytes()), kind(ix.numpy().tobytes())) for layer, (kv, ix) in layers.items()}
        got = block_codec.join_blocks(V4_1_FLASH, flat)  # type: ignore[arg-type]
        assert isinstance(got, torch.Tensor) and torch.equal(got, expected), kind


def test_join_blocks_of_numpy_and_tensors_mixed_gives_a_tensor() -> None:
    layers = random_rows(V4_1_FLASH, n=1, seed=7)
    mixed = {**layers, 2: (layers[2][0].numpy(), layers[2][1])}
    got = block_codec.join_blocks(V4_1_FLASH, mixed)  # type: ignore[arg-type]
    assert isinstance(got, torch.Tensor) and torch.equal(got, block_codec.join_blocks(V4_1_FLASH, layers))


def test_join_blocks_writes_into_a_numpy_out_and_refuses_a_read_only_one() -> None:
    layers = random_rows(V4_1_FLASH, n=2, seed=8)
    out = np.zeros((2, 56_960), dtype=np.uint8)
    assert block_codec.join_blocks(V4_1_FLASH, layers, out=out) is out
    assert np.array_equal(out, block_codec.join_blocks(V4_1_FLASH, layers).numpy())
    out.flags.writeable = False
    with pytest.raises(InvalidArgument, match=r"out: expected a uint8 tensor \[2, 56960\] .*read-only numpy array"):
        block_codec.join_blocks(V4_1_FLASH, layers, out=out)
    with pytest.raises(InvalidArgument, match=r"out: expected .*got float32 \(2, 56960\)"):
        block_codec.join_blocks(V4_1_FLASH, layers, out=np.zeros((2, 56_960), dtype=np.float32))


@pytest.mark.parametrize("geometry", [V4_1_FLASH, TINY])
def test_split_of_numpy_blocks_gives_numpy_views(geometry: ModelGeometry) -> None:
    layers = random_rows(geometry, n=3, seed=9)
    blocks = block_codec.join_blocks(geometry, numpy_rows(layers))
    back = block_codec.split_blocks(geometry, blocks)
    for layer, (kv, index) in layers.items():
        got_kv, got_index = back[layer]
        assert isinstance(got_kv, np.ndarray) and np.shares_memory(got_kv, blocks)
        assert np.array_equal(got_kv.reshape(-1, kv.shape[1]), kv.numpy())
        assert np.array_equal(got_index.reshape(-1, index.shape[1]), index.numpy())
    one = block_codec.split_block(geometry, blocks[1])
    first = geometry.kv_source_layers[0]
    assert isinstance(one[first][0], np.ndarray) and np.shares_memory(one[first][0], blocks)
    assert np.array_equal(one[first][0], back[first][0][1])
    blocks[1, 0] ^= 0xFF  # a view: the change shows through
    assert one[first][0][0, 0] == blocks[1, 0] == back[first][0][1, 0, 0]


def test_split_of_a_read_only_array_gives_read_only_views() -> None:
    data = np.frombuffer(block_codec.join_block(V4_1_FLASH, random_rows(V4_1_FLASH)).numpy().tobytes(), np.uint8)
    assert not data.flags.writeable
    for back in (block_codec.split_block(V4_1_FLASH, data), block_codec.split_blocks(V4_1_FLASH, data[None])):
        assert not any(a.flags.writeable for pair in back.values() for a in pair)


def test_split_refuses_numpy_it_cannot_view() -> None:
    block = block_codec.join_block(V4_1_FLASH, numpy_rows(random_rows(V4_1_FLASH)))
    with pytest.raises(InvalidArgument, match="negative stride"):
        block_codec.split_block(V4_1_FLASH, block[::-1])
    with pytest.raises(InvalidArgument, match=r"block: expected a 1-D contiguous uint8 array .*got int16"):
        block_codec.split_block(V4_1_FLASH, np.zeros(56_960, dtype=np.int16))
    with pytest.raises(InvalidArgument, match=r"blocks: expected a uint8 tensor or array \[n, 56960\] .*int8"):
        block_codec.split_blocks(V4_1_FLASH, np.zeros((2, 56_960), dtype=np.int8))
    with pytest.raises(InvalidArgument, match=r"block: expected 56960 bytes, as a torch tensor, a numpy array, "
                                              r"bytes, bytearray or memoryview; got list"):
        block_codec.split_block(V4_1_FLASH, [0] * 56_960)  # type: ignore[call-overload]


def test_encode_and_decode_of_numpy_values_give_numpy() -> None:
    values = float_layers(V4_1_FLASH, n=2, seed=10)
    expected = block_codec.encode_blocks(V4_1_FLASH, values)
    got = block_codec.encode_blocks(V4_1_FLASH, numpy_rows(values))
    assert isinstance(got, np.ndarray) and np.array_equal(got, expected.numpy())
    decoded = block_codec.decode_blocks(V4_1_FLASH, got)
    for layer, (kv, index) in block_codec.decode_blocks(V4_1_FLASH, expected).items():
        assert isinstance(decoded[layer][0], np.ndarray) and np.array_equal(decoded[layer][0], kv.numpy())
        assert np.array_equal(decoded[layer][1], index.numpy())
    one = block_codec.encode_block(V4_1_FLASH, numpy_rows(float_layers(V4_1_FLASH, seed=11)))
    assert isinstance(one, np.ndarray) and one.shape == (56_960,)
    back = block_codec.decode_block(V4_1_FLASH, one, dtype=torch.float16)
    assert back[20][0].dtype == np.float16 and back[20][0].shape == (64, 512)
    with pytest.raises(InvalidArgument, match="numpy has no bfloat16"):
        block_codec.decode_block(V4_1_FLASH, one, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgument, match="layer 2 compressed_kv: expected float32 or bfloat16 or float16, "
                                              "got float64"):
        block_codec.encode_block(V4_1_FLASH, {layer: (kv.astype(np.float64), ix)
                                              for layer, (kv, ix) in numpy_rows(float_layers(V4_1_FLASH)).items()})
    with pytest.raises(InvalidArgument, match=r"layer 2 compressed_kv: expected .* as a torch tensor or a numpy "
                                              r"array; got bytes"):
        block_codec.encode_block(V4_1_FLASH, {**float_layers(V4_1_FLASH), 2: (b"x" * 4, b"y")})  # type: ignore[dict-item]
