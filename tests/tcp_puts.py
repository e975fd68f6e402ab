"""Watching which puts go over the one-copy TCP transport (docs/TRANSFER.md "Put over the one-copy TCP
transport"): the tests of the transport and of a kill during its puts share one watcher."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore.client import put_tcp


def watch_tcp_puts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every put, whatever its size, try the TCP transport; return the list of those that went over it.

    A put appends -1 when it begins over TCP (a put a kill cuts never returns); once answered the entry
    becomes its reply count; a put the transport declined (sent by gRPC instead) is removed.
    """
    monkeypatch.setattr(put_tcp, "TCP_PUT_MIN_BYTES", 1)
    monkeypatch.delenv(put_tcp.TRANSPORT_ENV, raising=False)
    sent: list[int] = []
    real = put_tcp.send

    def send(*args: Any, **kwargs: Any) -> Any:
        at = len(sent)
        sent.append(-1)
        replies = real(*args, **kwargs)
        if replies is None:
            del sent[at]
        else:
            sent[at] = len(replies)
        return replies

    monkeypatch.setattr(put_tcp, "send", send)
    return sent
