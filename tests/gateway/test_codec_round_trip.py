"""Blocks through the service are the model's rows: float tensors -> rows -> blocks -> Put -> Get -> the same rows."""

from __future__ import annotations

import torch

from kvstore.client import Client
from kvstore.codec import block_codec, rows
from kvstore.geometry import V4_1_FLASH


def test_blocks_through_the_service_are_the_models_rows(client: Client) -> None:
    bt, n = client.block_tokens, 3
    assert client.block_bytes == V4_1_FLASH.block_bytes(bt)
    gen = torch.Generator().manual_seed(7)
    values = {layer: (torch.randn(n * V4_1_FLASH.block_rows(layer, bt), 512, generator=gen) * 3,
                      torch.randn(n * V4_1_FLASH.block_rows(layer, bt), 128, generator=gen))
              for layer in V4_1_FLASH.kv_source_layers}
    model_rows = {layer: (rows.compressed_kv_rows(kv), rows.indexer_key_rows(index))
                  for layer, (kv, index) in values.items()}
    blocks = block_codec.join_blocks(V4_1_FLASH, model_rows, bt)
    assert blocks.shape == (n, client.block_bytes)
    tokens = list(range(1000, 1000 + bt * n))
    client.put(tokens, blocks)
    fetched, filled = client.get_tensor(tokens)
    assert filled == n and torch.equal(fetched, blocks)
    back = block_codec.split_blocks(V4_1_FLASH, fetched, bt)
    for layer, (kv, index) in model_rows.items():
        assert torch.equal(back[layer][0].reshape(kv.shape), kv)  # byte for byte the model's rows
        assert torch.equal(back[layer][1].reshape(index.shape), index)
    decoded = block_codec.decode_blocks(V4_1_FLASH, fetched, bt)
    for layer, (kv, index) in values.items():
        for got, x in ((decoded[layer][0], kv), (decoded[layer][1], index)):
            rel = ((got.reshape(x.shape) - x).norm() / x.norm()).item()
            assert rel < 0.2, (layer, rel)
    # One block at a time, as bytes: the same rows.
    one = bytes(fetched[1].numpy())
    for layer, (kv, _) in model_rows.items():
        per_block = kv.shape[0] // n
        assert torch.equal(block_codec.split_block(V4_1_FLASH, one, bt)[layer][0], kv[per_block:2 * per_block])
