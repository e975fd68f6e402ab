"""`kvstore.native.ring.ask`, the client's side of one ring request in native code, against a thread
standing in for the server (the ring is an ordinary shared mapping here)."""

from __future__ import annotations

import ctypes
import mmap
import threading

import pytest

from kvstore.native import ring
from kvstore.transfer_ring import ANSWER_AT, ANSWERED, BUSY, HEADER_AT, REQUEST, REQUEST_AT, RING_BYTES, header_in

pytestmark = pytest.mark.skipif(not ring.NATIVE, reason="kvstore.native._ring is not built")


def mapped() -> tuple[mmap.mmap, memoryview, int]:
    m = mmap.mmap(-1, RING_BYTES)
    view = memoryview(m)
    probe = ctypes.c_char.from_buffer(view)
    address = ctypes.addressof(probe)
    del probe
    return m, view, address


def test_ask_writes_the_request_and_its_words_then_reports_no_answer() -> None:
    m, view, address = mapped()
    header = header_in(view)
    got = ring.ask(address, b"request!", 7, 0.0, 0.0, b"")
    assert got == ring.ASKED_NONE
    assert bytes(view[REQUEST_AT:REQUEST_AT + 8]) == b"request!"
    assert (header.state, header.seq, header.length) == (REQUEST, 7, 8) and header.client_cpu > 0
    view.release()
    m.close()


@pytest.mark.parametrize(("answer", "want"), [(b"expected", ring.ASKED_EXPECTED), (b"other!!!", ring.ASKED),
                                              (b"expected+", ring.ASKED)])
def test_ask_sees_the_answer_and_tells_the_expected_one(answer: bytes, want: int) -> None:
    m, view, address = mapped()
    header = header_in(view)

    def server() -> None:
        state = ring.wait(address + HEADER_AT, 0, 0.0, 0.0, 5.0)
        assert state == REQUEST and bytes(view[REQUEST_AT:REQUEST_AT + 3]) == b"req"
        header.state = BUSY
        view[ANSWER_AT:ANSWER_AT + len(answer)] = answer
        header.answer_seq, header.code, header.answer_length = header.seq, 0, len(answer)
        ring.publish(address + HEADER_AT, ANSWERED)

    thread = threading.Thread(target=server)
    thread.start()
    got = ring.ask(address, b"req", 3, 0.0, 10.0, b"expected")
    thread.join()
    assert got == want and header.state == ANSWERED
    view.release()
    m.close()


def test_an_answer_to_another_request_or_with_a_code_is_not_taken() -> None:
    m, view, address = mapped()
    header = header_in(view)
    header.answer_seq, header.code, header.answer_length = 4, 0, 8
    view[ANSWER_AT:ANSWER_AT + 8] = b"expected"
    header.state = ANSWERED  # a stale answer (request 4) is there when request 5 is asked: not taken
    assert ring.ask(address, b"x", 5, 0.0, 0.001, b"expected") == ring.ASKED_NONE
    header.answer_seq, header.code, header.state = 5, 13, ANSWERED
    # ask sets REQUEST first, so make the "server" answer by hand right after: code 13 is not the expected answer.
    done = threading.Event()

    def server() -> None:
        ring.wait(address + HEADER_AT, ANSWERED, 0.0, 0.0, 5.0)
        header.answer_seq, header.code, header.answer_length = 6, 13, 8
        ring.publish(address + HEADER_AT, ANSWERED)
        done.set()

    thread = threading.Thread(target=server)
    thread.start()
    assert ring.ask(address, b"x", 6, 0.0, 10.0, b"expected") == ring.ASKED
    thread.join()
    assert done.is_set()
    view.release()
    m.close()


def test_ask_refuses_a_bad_ring_or_request() -> None:
    with pytest.raises(ValueError):
        ring.ask(0, b"x", 1, 0.0, 0.0, b"")
    m, view, address = mapped()
    with pytest.raises(ValueError):
        ring.ask(address, bytes(RING_BYTES), 1, 0.0, 0.0, b"")
    view.release()
    m.close()
