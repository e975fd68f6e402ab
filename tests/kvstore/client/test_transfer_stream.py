"""`FetchReply.parse`: the stream path reads Fetch replies from their wire bytes itself
(kvstore/client/transfer_stream.py), so it must read every valid encoding as protobuf does."""

from __future__ import annotations

import pytest

from kvstore.client.transfer_stream import FetchReply
from kvstore.errors import Internal
from kvstore.v1 import transfer_pb2 as pb


def test_parse_reads_what_protobuf_writes_in_any_field_order() -> None:
    message = pb.FetchReply(statuses=b"\x01\x04\x02", data=b"\x09" * 1000,
                            failures=[pb.DescriptorFailure(index=1, code="DATA_LOSS", reason="checksum")])
    wire = message.SerializeToString()
    unknown = b"\x20\x96\x01" + b"\x29" + bytes(8)  # field 4 varint, field 5 fixed64: skipped
    failure = pb.FetchReply(failures=message.failures).SerializeToString()
    for encoded in (wire, unknown + wire, pb.FetchReply(data=message.data).SerializeToString() + failure
                    + pb.FetchReply(statuses=message.statuses).SerializeToString()):
        got = FetchReply.parse(encoded)
        assert (got.statuses, bytes(got.data), list(got.failures)) == \
            (message.statuses, message.data, list(message.failures))


@pytest.mark.parametrize("cut", [1, 3, 500])
def test_a_cut_reply_raises_internal(cut: int) -> None:
    wire = pb.FetchReply(statuses=b"\x01", data=b"\x09" * 1000).SerializeToString()
    with pytest.raises(Internal, match="Fetch reply"):
        FetchReply.parse(wire[:-cut])
