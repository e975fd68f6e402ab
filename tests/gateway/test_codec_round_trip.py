"""The codec through the service: per-layer tensors -> FP4 block bytes -> Put -> Get -> tensors, exact."""

from __future__ import annotations

import torch

from kvstore.client import Client
from kvstore.codec import block_codec
from kvstore.geometry import V4_1_FLASH


def layers(block_tokens: int, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {g.layer: {c.name: torch.randn(block_tokens // g.tokens_per_entry, c.channels, generator=gen) * 3
                      for c in g.components}
            for g in V4_1_FLASH.global_layers}


def test_fp4_blocks_survive_the_service_bit_for_bit(client: Client) -> None:
    bt = client.block_tokens
    tokens = list(range(1000, 1000 + bt * 3))
    originals = [layers(bt, seed) for seed in range(3)]
    encoded = torch.stack([block_codec.encode_block(V4_1_FLASH, bt, block) for block in originals])
    assert encoded.shape == (3, client.block_bytes)
    client.put(tokens, encoded)
    fetched, filled = client.get_tensor(tokens)
    assert filled == 3 and torch.equal(fetched, encoded)
    for row, block in zip(fetched, originals, strict=True):
        decoded = block_codec.decode_block(V4_1_FLASH, bt, row)
        # Exact on the FP4 grid: what comes back re-encodes to the very same bytes.
        assert torch.equal(block_codec.encode_block(V4_1_FLASH, bt, decoded), row)
        for layer, comps in block.items():
            for name, x in comps.items():
                rel = ((decoded[layer][name] - x).norm() / x.norm()).item()
                assert rel < 0.2, (layer, name, rel)
