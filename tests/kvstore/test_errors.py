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


def test_data_loss_round_trips() -> None:
    err = errors.DataLoss("page 12 of data.mdb is damaged")
    assert errors.to_status(err) == grpc.StatusCode.DATA_LOSS
    back = errors.from_status(grpc.StatusCode.DATA_LOSS, "page 12 of data.mdb is damaged")
    assert type(back) is errors.DataLoss and back.message == "page 12 of data.mdb is damaged"
    assert not back.retryable and back.hint == ""  # the server's hint is in its message: no default added
    assert "kvstore check" in err.hint  # a damaged block the store dropped


def test_unknown_status_is_internal() -> None:
    assert isinstance(errors.from_status(grpc.StatusCode.UNIMPLEMENTED, ""), errors.Internal)


def test_retryable_flags() -> None:
    assert errors.ResourceExhausted("x").retryable and errors.Unavailable("x").retryable
    assert not errors.InvalidArgument("x").retryable


def test_store_full_names_what_can_be_done() -> None:
    """Retention cannot be shortened (72 h is a floor): the hint names capacity, leases and the wait."""
    for err in (errors.ResourceExhausted("store full"), errors.StoreFull("store full"),
                errors.StoreFull("store full", soonest_evictable_s=5400.0)):
        assert "store.capacity_bytes" in err.hint and "release leases" in err.hint
        assert "shorten" not in err.hint and err.retryable
        assert errors.to_status(err) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry in 1.5 h" in errors.StoreFull("full", soonest_evictable_s=5400.0).hint
    assert "pass their retention" in errors.StoreFull("full").hint
