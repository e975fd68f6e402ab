"""Block codec: tensors of every global layer <-> exactly one block's bytes in the geometry's layout."""

from __future__ import annotations

import pytest
import torch

from kvstore.codec import block_codec, fp4
from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH, ModelGeometry


def make_block(geometry: ModelGeometry, block_tokens: int, seed: int = 0,
               dtype: torch.dtype = torch.bfloat16) -> dict[int, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {g.layer: {c.name: (torch.randn(block_tokens // g.tokens_per_entry, c.channels, generator=gen) * 2)
                      .to(dtype) for c in g.components}
            for g in V4_1_FLASH.global_layers}


@pytest.mark.parametrize("block_tokens", [2, 64])
def test_encoded_block_has_exactly_block_bytes(block_tokens: int) -> None:
    data = block_codec.encode_block(V4_1_FLASH, block_tokens, make_block(V4_1_FLASH, block_tokens))
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert data.numel() == V4_1_FLASH.block_bytes(block_tokens) == 890 * block_tokens


def test_sections_hold_each_component_at_its_layout_offset() -> None:
    block = make_block(V4_1_FLASH, 64)
    data = block_codec.encode_block(V4_1_FLASH, 64, block)
    for s in V4_1_FLASH.block_layout(64):
        x = block[s.layer][s.component]
        values, scales = (fp4.quantize(x) if s.component == "main_kv" else fp4.quantize_per_vector(x))
        expected = values if s.part == "values" else scales.view(torch.uint8)
        assert torch.equal(data[s.offset:s.offset + s.size_bytes], expected.reshape(-1)), s


def test_decode_then_encode_gives_the_same_bytes() -> None:
    data = block_codec.encode_block(V4_1_FLASH, 64, make_block(V4_1_FLASH, 64))
    decoded = block_codec.decode_block(V4_1_FLASH, 64, bytes(data.numpy()))
    assert decoded[2]["main_kv"].shape == (32, 512) and decoded[20]["main_kv"].shape == (64, 512)
    assert decoded[20]["indexer_key"].dtype == torch.float32
    assert torch.equal(block_codec.encode_block(V4_1_FLASH, 64, decoded), data)


def test_decode_is_close_to_the_input() -> None:
    block = make_block(V4_1_FLASH, 64, dtype=torch.float32)
    decoded = block_codec.decode_block(V4_1_FLASH, 64, block_codec.encode_block(V4_1_FLASH, 64, block))
    for layer, comps in block.items():
        for name, x in comps.items():
            rel = ((decoded[layer][name] - x).norm() / x.norm()).item()
            assert rel < (0.11 if name == "main_kv" else 0.18), (layer, name, rel)


def test_every_buffer_type_decodes_alike() -> None:
    data = block_codec.encode_block(V4_1_FLASH, 4, make_block(V4_1_FLASH, 4))
    raw = bytes(data.numpy())
    expected = block_codec.decode_block(V4_1_FLASH, 4, data)
    for buf in (raw, bytearray(raw), memoryview(raw)):
        got = block_codec.decode_block(V4_1_FLASH, 4, buf)
        assert all(torch.equal(got[k][n], expected[k][n]) for k in expected for n in expected[k])


def test_views_alias_the_buffer() -> None:
    data = bytearray(block_codec.encode_block(V4_1_FLASH, 4, make_block(V4_1_FLASH, 4)).numpy().tobytes())
    views = block_codec.view_block(V4_1_FLASH, 4, data)
    main = views[2]["main_kv"]
    assert main.values.shape == (2, 256) and main.scales.shape == (2, 32)
    assert views[2]["indexer_key"].scales.dtype == torch.float32
    data[0] ^= 0xFF  # a change to the buffer shows through the view: no copy was made
    assert main.values[0, 0].item() == data[0]


def test_bad_input_names_what_was_expected() -> None:
    block = make_block(V4_1_FLASH, 4)
    with pytest.raises(InvalidArgument, match="multiple of 2"):
        block_codec.encode_block(V4_1_FLASH, 3, block)
    with pytest.raises(InvalidArgument, match=r"expected layers \[2, 8, 14, 20\]"):
        block_codec.encode_block(V4_1_FLASH, 4, {k: v for k, v in block.items() if k != 8})
    block[20]["main_kv"] = torch.zeros(2, 512)
    with pytest.raises(InvalidArgument, match=r"layer 20 main_kv: expected a tensor of shape \(4, 512\)"):
        block_codec.encode_block(V4_1_FLASH, 4, block)
    with pytest.raises(InvalidArgument, match="expected 3560 bytes, got 10"):
        block_codec.decode_block(V4_1_FLASH, 4, b"\0" * 10)
    with pytest.raises(InvalidArgument, match="uint8 tensor"):
        block_codec.view_block(V4_1_FLASH, 4, torch.zeros(3560, dtype=torch.int16))


def test_nan_in_any_layer_raises() -> None:
    block = make_block(V4_1_FLASH, 4, dtype=torch.float32)
    block[14]["indexer_key"][1, 3] = float("nan")
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        block_codec.encode_block(V4_1_FLASH, 4, block)
