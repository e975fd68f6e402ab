"""The SWA direct client's error mapping and path choice, without a server (unit tier)."""

from __future__ import annotations

import pytest
from redis.exceptions import AuthenticationError, ConnectionError, NoPermissionError, ResponseError, TimeoutError

from kvstore.client.swa_direct import redis_error
from kvstore.errors import PermissionDenied, Unavailable


@pytest.mark.parametrize(("raised", "expected"), [
    (AuthenticationError("WRONGPASS invalid username-password pair"), PermissionDenied),
    (NoPermissionError("NOPERM this user has no permissions to access one of the keys"), PermissionDenied),
    (ResponseError("NOAUTH Authentication required."), PermissionDenied),
    (ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."), Unavailable),
    (TimeoutError("Timeout reading from socket"), Unavailable),
    (OSError("broken pipe"), Unavailable),
])
def test_every_redis_failure_is_a_kvstore_error(raised: Exception, expected: type) -> None:
    """A rotated-away user is PermissionDenied (re-open), anything else Unavailable (fall back):
    an AuthenticationError is a ConnectionError in redis-py, so the order of the checks matters."""
    error = redis_error(raised)
    assert type(error) is expected
    if expected is PermissionDenied:
        assert "re-open" in error.hint
