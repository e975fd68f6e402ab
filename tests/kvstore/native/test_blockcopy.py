"""kvstore.native.blockcopy: the verify-and-copy loop, in both forms (native C and Python), on the same cases."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import xxhash

from kvstore.native import blockcopy
from kvstore.native.records import META_STRUCT

FORMS: dict[str, Callable[..., tuple[bytes, list[int]]] | None] = {
    "python": blockcopy.verify_copy_python,
    "native": blockcopy.verify_copy_native,
}


@pytest.fixture(params=list(FORMS))
def verify_copy(request: Any) -> Callable[..., tuple[bytes, list[int]]]:
    form = FORMS[request.param]
    if form is None:
        # scripts/test.sh refuses to run without it, so this skips only in a bare `pytest`.
        pytest.skip("kvstore.native._blockcopy is not built (pip install -e . needs a C compiler)")
    return form


def meta(data: bytes, *, last_access_s: float = 100.0, checksum: int | None = None, size: int | None = None
         ) -> bytes:
    """A meta record for `data` as the tier writes it."""
    return META_STRUCT.pack(b"\0" * 32, 1, len(data) if size is None else size,
                            xxhash.xxh3_64_intdigest(data) if checksum is None else checksum, 0.0, last_access_s)


def test_copies_verified_blocks_and_reports_those_due_a_touch(verify_copy: Callable[..., Any]) -> None:
    blocks = [os.urandom(1000) for _ in range(3)]
    dest = bytearray(3000)
    view = memoryview(dest)
    metas = [meta(blocks[0], last_access_s=10.0), meta(blocks[1], last_access_s=500.0), meta(blocks[2])]
    codes, due = verify_copy(metas, blocks, [view[i * 1000:(i + 1) * 1000] for i in range(3)], 200.0, False)
    assert codes == bytes([blockcopy.FOUND] * 3)
    assert bytes(dest) == b"".join(blocks)
    assert due == [0, 2], "blocks last accessed before due_before are due"


def test_a_block_failing_its_checks_is_corrupt_and_never_copied(verify_copy: Callable[..., Any]) -> None:
    block = os.urandom(500)
    cases = [
        meta(block, checksum=xxhash.xxh3_64_intdigest(block) ^ 1),  # checksum differs
        meta(block, size=499),  # size differs from the stored bytes
        meta(block)[:-1],  # a record of the wrong length
        meta(block),  # a record with no block
    ]
    datas = [block, block, block, None]
    dest = bytearray(b"\xee" * 2000)
    view = memoryview(dest)
    codes, due = verify_copy(cases, datas, [view[i * 500:(i + 1) * 500] for i in range(4)], 1e9, False)
    assert codes == bytes([blockcopy.CORRUPT] * 4)
    assert dest == b"\xee" * 2000 and due == []


def test_missing_skipped_and_stop_at_missing(verify_copy: Callable[..., Any]) -> None:
    blocks = [os.urandom(64) for _ in range(4)]
    metas: list[Any] = [meta(blocks[0]), None, meta(blocks[2]), meta(blocks[3])]
    datas: list[Any] = [blocks[0], None, blocks[2], blocks[3]]
    dests: list[Any] = [memoryview(bytearray(64)) for _ in range(4)]
    dests[3] = None
    codes, _ = verify_copy(metas, datas, dests, 0.0, False)
    assert codes == bytes([blockcopy.FOUND, blockcopy.MISSING, blockcopy.FOUND, blockcopy.NOT_REACHED])
    codes, _ = verify_copy(metas, datas, dests, 0.0, True)
    assert codes == bytes([blockcopy.FOUND, blockcopy.MISSING, 0, 0])


def test_a_dest_of_the_wrong_size_stops_the_loop(verify_copy: Callable[..., Any]) -> None:
    blocks = [os.urandom(64) for _ in range(3)]
    dests = [memoryview(bytearray(64)), memoryview(bytearray(63)), memoryview(bytearray(64))]
    codes, _ = verify_copy([meta(b) for b in blocks], blocks, dests, 0.0, False)
    assert codes == bytes([blockcopy.FOUND, blockcopy.WRONG_SIZE, 0])
    assert bytes(dests[1]) == bytes(63), "nothing partial is written"


def test_read_only_dest_is_refused(verify_copy: Callable[..., Any]) -> None:
    block = os.urandom(64)
    with pytest.raises((TypeError, BufferError)):
        verify_copy([meta(block)], [block], [memoryview(bytes(64))], 0.0, False)


def test_native_and_python_agree_on_a_mixed_batch() -> None:
    if blockcopy.verify_copy_native is None:
        pytest.skip("kvstore.native._blockcopy is not built")
    rng = random.Random(7)
    metas: list[Any] = []
    datas: list[Any] = []
    for i in range(300):
        data = rng.randbytes(rng.choice([1, 15, 16, 63, 64, 65, 4096, 14240]))
        kind = rng.random()
        metas.append(None if kind < 0.1 else meta(data, last_access_s=float(i), checksum=(
            0 if kind < 0.2 else None)))
        datas.append(data)
    out = {}
    for name, form in FORMS.items():
        assert form is not None
        skip = random.Random(11)  # the same dests skipped in both runs
        dests: list[Any] = [None if skip.random() < 0.05 else memoryview(bytearray(len(d))) for d in datas]
        codes, due = form(metas, datas, dests, 150.0, False)
        out[name] = (codes, due, [None if d is None else bytes(d) for d in dests])
    assert out["native"] == out["python"]
    assert {blockcopy.FOUND, blockcopy.MISSING, blockcopy.CORRUPT, blockcopy.NOT_REACHED} <= set(out["native"][0])


def test_native_checks_its_arguments() -> None:
    native = blockcopy.verify_copy_native
    if native is None:
        pytest.skip("kvstore.native._blockcopy is not built")
    with pytest.raises(ValueError, match="same length"):
        native([None], [], [], 0.0, False)
    with pytest.raises(TypeError):
        native((None,), [None], [None], 0.0, False)


@pytest.mark.parametrize("native", [True, False])
def test_fill_bytes_hands_back_what_fill_wrote_and_what_it_returned(native: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if native and blockcopy._blank_bytes is None:
        pytest.skip("kvstore.native._blockcopy is not built (pip install -e . needs a C compiler)")
    if not native:
        monkeypatch.setattr(blockcopy, "_blank_bytes", None)
    payload = os.urandom(1 << 20)
    kept: list[memoryview] = []

    def fill(view: memoryview) -> int:
        assert not view.readonly and len(view) == len(payload) + 2
        view[:2] = b"hi"
        view[2:] = payload
        kept.append(view)
        return 7

    out, result = blockcopy.fill_bytes(len(payload) + 2, fill)
    assert type(out) is bytes and out == b"hi" + payload and result == 7
    assert hash(out) == hash(b"hi" + payload)
    with pytest.raises(ValueError):  # the view was released: nothing writes into the bytes once handed on
        kept[0][0] = 1
    # Sizes below 2 (CPython shares its 0- and 1-byte objects) take the copying path.
    assert blockcopy.fill_bytes(1, lambda v: v.__setitem__(0, 9)) == (b"\x09", None)
    assert blockcopy.fill_bytes(0, lambda v: len(v)) == (b"", 0)


def test_blank_bytes_refuses_sizes_cpython_shares() -> None:
    if blockcopy._blank_bytes is None:
        pytest.skip("kvstore.native._blockcopy is not built (pip install -e . needs a C compiler)")
    for n in (-1, 0, 1):
        with pytest.raises(ValueError, match="at least 2"):
            blockcopy._blank_bytes(n)
