"""The SWA paths' checksums and arena copy (kvstore.native.swa_digest, native in
kvstore/native/_swa_digest.h): every form gives python-xxhash's xxh3-64 bit for bit, whatever the size and
however a stream is cut, and the module falls back to its Python forms where the native module is absent."""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
import sys
import threading

import pytest
import xxhash

from kvstore.native import swa_digest

SIZES = [0, 1, 15, 16, 128, 129, 239, 240, 241, 1023, 1024, 1025, (32 << 10) - 1, 32 << 10, (32 << 10) + 1,
         65_535, 65_536, 65_537, 1 << 20, 2_703_360, 2_715_648]
native = pytest.mark.skipif(not swa_digest.NATIVE, reason="kvstore.native._blockcopy is not built")


@pytest.fixture(params=["native", "python"])
def forms(request: pytest.FixtureRequest) -> dict[str, object]:
    """The module's forms: the native ones (skipped where not built) or the Python ones."""
    if request.param == "native":
        if not swa_digest.NATIVE:
            pytest.skip("kvstore.native._blockcopy is not built")
        return {"digest": swa_digest.digest, "copy_digest": swa_digest.copy_digest, "hasher": swa_digest.hasher,
                "stream_into": swa_digest.stream_into, "copy_hashed": swa_digest.copy_hashed}
    return {"digest": swa_digest.digest_python, "copy_digest": swa_digest.copy_digest_python,
            "hasher": xxhash.xxh3_64, "stream_into": swa_digest.stream_into_python,
            "copy_hashed": swa_digest.copy_hashed_python}


@pytest.mark.parametrize("size", SIZES)
def test_a_digest_is_xxh3_64_of_the_bytes(forms: dict, size: int) -> None:
    data = os.urandom(size)
    want = xxhash.xxh3_64_intdigest(data)
    assert forms["digest"](data) == want
    assert forms["digest"](bytearray(data)) == want
    assert forms["digest"](memoryview(data)) == want
    if size > 3:  # a view that does not start on an aligned address
        assert forms["digest"](memoryview(data)[3:]) == xxhash.xxh3_64_intdigest(data[3:])


@pytest.mark.parametrize("size", [0, 1, 240, 241, 65_537, 2_715_648])
@pytest.mark.parametrize("piece", [1, 7, 63, 64, 65, 255, 256, 1000, 4096, 1 << 20])
def test_a_streamed_digest_is_the_digest_of_the_whole_however_it_is_cut(forms: dict, size: int,
                                                                         piece: int) -> None:
    data = os.urandom(size)
    hasher = forms["hasher"]()
    view = memoryview(data)
    for start in range(0, size, piece):
        hasher.update(view[start:start + piece])
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(data)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(data)  # reading the digest leaves the state as it was


def test_pieces_of_uneven_sizes_stream_to_the_digest_of_the_whole(forms: dict) -> None:
    data = os.urandom(3_000_001)
    hasher, at = forms["hasher"](), 0
    for piece in [0, 1, 239, 1 << 20, 17, 0, 65_536, 1_000_003]:
        hasher.update(data[at:at + piece])
        at += piece
    hasher.update(data[at:])
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(data)


@pytest.mark.parametrize("size", SIZES)
def test_copy_digest_returns_a_copy_and_its_digest(forms: dict, size: int) -> None:
    data = bytearray(os.urandom(size))
    copy, digest = forms["copy_digest"](memoryview(data))
    assert isinstance(copy, bytes) and copy == data and digest == xxhash.xxh3_64_intdigest(data)
    if size:
        data[0] ^= 1  # a copy, not a view of the source
        assert copy != data


@pytest.mark.parametrize("size", SIZES)
def test_stream_into_copies_into_the_destination(forms: dict, size: int) -> None:
    data = os.urandom(size)
    dest = bytearray(size + 5)
    forms["stream_into"](memoryview(dest)[3:3 + size], data)  # an unaligned destination
    assert dest[3:3 + size] == data and dest[:3] == bytes(3) and dest[3 + size:] == bytes(2)


def test_stream_into_refuses_buffers_of_two_lengths(forms: dict) -> None:
    with pytest.raises(ValueError):
        forms["stream_into"](memoryview(bytearray(8)), b"123")


@pytest.mark.parametrize("size", SIZES)
def test_copy_hashed_copies_and_feeds_the_hasher_the_bytes_copied(forms: dict, size: int) -> None:
    data = os.urandom(size + 3)[3:]  # a source that does not start on an aligned address
    dest = bytearray(size + 9)
    hasher = forms["hasher"]()
    forms["copy_hashed"](memoryview(dest)[5:5 + size], memoryview(data), hasher)  # an unaligned destination
    assert dest[5:5 + size] == data and dest[:5] == bytes(5) and dest[5 + size:] == bytes(4)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(data)


def test_copy_hashed_goes_on_from_where_the_hasher_is(forms: dict) -> None:
    """A snapshot copied in pieces (a session's WRITTEN notes) hashes to the digest of the whole."""
    data = os.urandom(3_000_001)
    dest = memoryview(bytearray(len(data)))
    hasher, at = forms["hasher"](), 0
    for piece in [0, 1, 63, 1 << 20, 32_769, 0, 65_536, 1_000_003]:
        forms["copy_hashed"](dest[at:at + piece], data[at:at + piece], hasher)
        at += piece
    forms["copy_hashed"](dest[at:], data[at:], hasher)
    assert dest == data and hasher.intdigest() == xxhash.xxh3_64_intdigest(data)


def test_native_and_python_copy_hashed_agree(forms: dict) -> None:
    data = os.urandom(2_715_648)
    dests = [bytearray(len(data)), bytearray(len(data))]
    hashers = [forms["hasher"](), xxhash.xxh3_64()]
    forms["copy_hashed"](memoryview(dests[0]), data, hashers[0])
    swa_digest.copy_hashed_python(memoryview(dests[1]), data, hashers[1])
    assert dests[0] == dests[1] == data and hashers[0].intdigest() == hashers[1].intdigest()


def test_copy_hashed_hashes_what_it_wrote_while_the_source_changes(forms: dict) -> None:
    """A writer scribbling on its staging range during the server's copy: the digest is still that of the
    bytes the destination holds (the arena's rule: the checksum is of what readers map), never of a source
    read twice."""
    size = 16 << 20
    scribbles = [0]

    def scribble(src: bytearray, stop: threading.Event) -> None:
        rnd = random.Random(7)
        while not stop.is_set():
            src[rnd.randrange(size)] ^= 0xFF
            scribbles[0] += 1

    for _ in range(3):
        src = bytearray(os.urandom(size))
        dest = bytearray(size)
        stop = threading.Event()
        thread = threading.Thread(target=scribble, args=(src, stop))
        thread.start()
        try:
            hasher = forms["hasher"]()
            forms["copy_hashed"](memoryview(dest), src, hasher)
        finally:
            stop.set()
            thread.join()
        assert hasher.intdigest() == xxhash.xxh3_64_intdigest(dest)
    assert scribbles[0] > 0


def test_copy_hashed_refuses_buffers_of_two_lengths(forms: dict) -> None:
    with pytest.raises(ValueError):
        forms["copy_hashed"](memoryview(bytearray(8)), b"123", forms["hasher"]())


@native
def test_native_copy_hashed_takes_only_its_own_hasher_and_a_writable_destination() -> None:
    with pytest.raises(TypeError):
        swa_digest.copy_hashed(memoryview(bytearray(3)), b"123", xxhash.xxh3_64())
    with pytest.raises(TypeError):
        swa_digest.copy_hashed(memoryview(b"abc"), b"123", swa_digest.hasher())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        swa_digest.copy_hashed(memoryview(bytearray(3)), "123", swa_digest.hasher())  # type: ignore[arg-type]


@native
def test_a_hasher_that_copy_hashed_is_feeding_refuses_other_threads() -> None:
    """copy_hashed feeds its hasher without the GIL: another thread's update or digest of that hasher
    meanwhile is a RuntimeError, not a race on its state."""
    src, dest = os.urandom(64 << 20), memoryview(bytearray(64 << 20))
    hasher = swa_digest.hasher()
    refused: list[str] = []

    def copy(done: threading.Event) -> None:
        try:
            swa_digest.copy_hashed(dest, src, hasher)
        finally:
            done.set()

    for _ in range(20):
        done = threading.Event()
        thread = threading.Thread(target=copy, args=(done,))
        thread.start()
        while not done.is_set():
            for call in (lambda: hasher.update(b"x"), hasher.intdigest):
                try:
                    call()
                except RuntimeError as exc:
                    refused.append(str(exc))
        thread.join()
        if refused:
            break
    assert refused and "another thread" in refused[0]
    hasher.update(b"")  # usable again once the copy is done
    assert isinstance(hasher.intdigest(), int)


@native
def test_bad_arguments_are_type_errors_not_crashes() -> None:
    with pytest.raises(TypeError):
        swa_digest.digest("text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        swa_digest.copy_digest(12)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        swa_digest.stream_into(memoryview(b"read-only"), b"123456789")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        swa_digest.hasher().update(None)
    with pytest.raises(TypeError):
        type(swa_digest.hasher())(1)  # type: ignore[call-arg]


@native
def test_the_native_digest_runs_on_several_threads_at_once() -> None:
    """The GIL is let go while it hashes: threads hashing their own buffers all get xxhash's value."""
    datas = [os.urandom(1 << 20) for _ in range(4)]
    got: dict[int, list[int]] = {}

    def work(i: int) -> None:
        got[i] = [swa_digest.digest(datas[i]) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got[i] == [xxhash.xxh3_64_intdigest(datas[i])] * 20 for i in range(4))


def test_without_the_native_module_the_python_forms_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvstore.native._blockcopy", None)  # an install without a C compiler
    try:
        fallback = importlib.reload(swa_digest)
        assert not fallback.NATIVE
        assert fallback.digest is fallback.digest_python
        assert fallback.copy_digest is fallback.copy_digest_python
        assert fallback.stream_into is fallback.stream_into_python
        assert fallback.copy_hashed is fallback.copy_hashed_python
        assert fallback.hasher is xxhash.xxh3_64
        data = os.urandom(100_000)
        assert fallback.digest(data) == fallback.copy_digest(data)[1] == xxhash.xxh3_64_intdigest(data)
    finally:
        monkeypatch.undo()
        importlib.reload(swa_digest)
    assert (importlib.util.find_spec("kvstore.native._blockcopy") is not None) == swa_digest.NATIVE
