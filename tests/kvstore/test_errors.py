"""One table maps kvstore errors to gRPC status, both ways."""

from __future__ import annotations

import grpc

from kvstore import errors


def test_every_error_maps_and_round_trips() -> None:
    for cls, code in errors.STATUS_CODES.items():
        err = cls("boom")
        assert errors.to_status(err) == code
        back = errors.from_status(code, "boom")
        assert errors.to_status(back) == code and back.message == "boom"


def test_unknown_status_is_internal() -> None:
    assert isinstance(errors.from_status(grpc.StatusCode.DATA_LOSS, ""), errors.Internal)


def test_retryable_flags() -> None:
    assert errors.ResourceExhausted("x").retryable and errors.Unavailable("x").retryable
    assert not errors.InvalidArgument("x").retryable
