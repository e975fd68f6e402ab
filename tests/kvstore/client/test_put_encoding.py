"""A Put's request is serialized by the client itself (kvstore.client.puts.encode), each block copied
once: the same bytes protobuf writes for the same message, whatever fields it holds."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from kvstore.client.puts import encode
from kvstore.v1 import kvstore_pb2 as pb


def test_encode_writes_protobufs_bytes_for_any_request() -> None:
    rng = random.Random(2)
    for _ in range(60):
        fields: dict[str, Any] = {"geometry": "v4.1-flash", "namespace": rng.choice(["", "team-a"]),
                  "parent_hash": os.urandom(32) if rng.random() < 0.8 else b"",
                  "token_ids": [rng.randrange(1 << 32) for _ in range(rng.randrange(0, 300))],
                  "extra_keys": [os.urandom(rng.randrange(1, 40)) for _ in range(rng.randrange(0, 3))],
                  "first_block": rng.choice([0, 7, 1 << 20]), "run_key": rng.choice([b"", os.urandom(32)]),
                  "run_bridge": rng.choice([b"", os.urandom(32)]), "keep_until_s": rng.choice([0.0, 1.9e9])}
        # Blocks of several sizes (each its own length prefix), bytes and views alike.
        blocks = [os.urandom(rng.choice([0, 1, 127, 128, 16_384, 56_960])) for _ in range(rng.randrange(0, 6))]
        given = [memoryview(b) if rng.random() < 0.3 else b for b in blocks]
        want = pb.PutRequest(**fields, blocks=blocks).SerializeToString()
        assert encode(pb.PutRequest(**fields), given) == want


def test_encode_takes_the_blocks_apart_from_the_request() -> None:
    with pytest.raises(ValueError, match="apart"):
        encode(pb.PutRequest(blocks=[b"x"]), [b"y"])
