"""A Put's request read with its blocks left in the received bytes (gateway/put_request.py): the same
request protobuf parses, whatever the fields and their order; protobuf's verdict on bad bytes."""

from __future__ import annotations

import os
import random

import pytest
from google.protobuf.message import DecodeError

from gateway.put_request import BLOCKS_FIELD, PutRequestView, decode
from kvstore.client.puts import encode
from kvstore.protowire import length_delimited, varint
from kvstore.v1 import kvstore_pb2 as pb


def _random_request(rng: random.Random) -> tuple[pb.PutRequest, list[bytes]]:
    request = pb.PutRequest()
    if rng.random() < 0.8:
        request.geometry = rng.choice(["deepseek-v4.1-flash", "x", "é"])
    if rng.random() < 0.5:
        request.namespace = "tenant-" + str(rng.randrange(100))
    if rng.random() < 0.7:
        request.parent_hash = os.urandom(32)
    request.token_ids.extend(rng.randrange(1 << 32) for _ in range(rng.randrange(200)))
    request.extra_keys.extend(os.urandom(rng.randrange(1, 40)) for _ in range(rng.randrange(3)))
    if rng.random() < 0.5:
        request.keep_until_s = rng.random() * 2e9
    if rng.random() < 0.3:
        request.first_block = rng.randrange(1 << 20)
    blocks = [os.urandom(rng.choice([0, 1, 127, 128, 16_384, 56_960])) for _ in range(rng.randrange(6))]
    return request, blocks


def _same(view: PutRequestView, raw: bytes) -> None:
    want = pb.PutRequest.FromString(raw)
    assert [bytes(b) for b in view.blocks] == list(want.blocks)
    rest = pb.PutRequest()
    rest.CopyFrom(want)
    del rest.blocks[:]
    assert view.message == rest
    assert view.to_message() == want
    assert view.geometry == want.geometry and list(view.token_ids) == list(want.token_ids)


@pytest.mark.parametrize("seed", range(40))
def test_a_decoded_request_is_protobufs_with_its_blocks_as_views_of_the_message(seed: int) -> None:
    rng = random.Random(seed)
    request, blocks = _random_request(rng)
    for raw in (encode(request, blocks), _with_blocks(request, blocks).SerializeToString()):
        view = decode(raw)
        _same(view, raw)
        for block in view.blocks:  # not copied: views of the bytes gRPC handed over
            assert isinstance(block, memoryview) and block.obj is raw and block.readonly


def _with_blocks(request: pb.PutRequest, blocks: list[bytes]) -> pb.PutRequest:
    full = pb.PutRequest()
    full.CopyFrom(request)
    full.blocks.extend(blocks)
    return full


@pytest.mark.parametrize("seed", range(20))
def test_blocks_between_other_fields_and_fields_given_twice_mean_what_they_mean_to_protobuf(seed: int) -> None:
    rng = random.Random(1000 + seed)
    fields: list[bytes] = []
    for _ in range(rng.randrange(1, 12)):
        kind = rng.randrange(4)
        if kind == 0:
            data = os.urandom(rng.choice([0, 3, 300]))
            fields.append(length_delimited(BLOCKS_FIELD, len(data)) + data)
        elif kind == 1:  # a string field, repeated: the last one wins
            fields.append(pb.PutRequest(namespace="ns" + str(rng.randrange(9))).SerializeToString())
        elif kind == 2:  # an unknown varint field and an unknown fixed64 one: kept as protobuf keeps them
            fields.append(varint(99 << 3 | 0) + varint(rng.randrange(1 << 40)) + varint(98 << 3 | 1) + os.urandom(8))
        else:
            fields.append(pb.PutRequest(token_ids=[rng.randrange(1 << 20) for _ in range(5)]).SerializeToString())
    raw = b"".join(fields)
    _same(decode(raw), raw)


@pytest.mark.parametrize("raw", [
    b"\x22\x05abc",                      # a block running past the message
    b"\x22",                             # a length missing
    b"\x0a\x02\xff\xfe",                 # a geometry that is not UTF-8
    b"\x00\x01",                         # field number 0
    b"\x22\x01a\x0f",                    # a wire type protobuf refuses (7)
    b"\x22\x01a" + b"\xff" * 11,         # a varint past 64 bits
])
def test_bytes_that_are_no_put_request_are_refused_as_protobuf_refuses_them(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        pb.PutRequest.FromString(raw)
    with pytest.raises(DecodeError):
        decode(raw)


def test_a_group_is_left_to_protobuf_and_its_blocks_still_come_out() -> None:
    group = varint(50 << 3 | 3) + varint(1 << 3 | 0) + b"\x07" + varint(50 << 3 | 4)  # an unknown group
    raw = length_delimited(BLOCKS_FIELD, 3) + b"abc" + group
    view = decode(raw)
    _same(view, raw)
    assert [bytes(b) for b in view.blocks] == [b"abc"]
