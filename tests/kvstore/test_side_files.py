"""kvstore.side_files: what `read_json` refuses, and that it never reads past its bound or waits (real files)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvstore.side_files import DamagedFile, read_bounded, read_json

BOUND = 1 << 16


@pytest.mark.parametrize(("content", "says"), [
    (b"\xff\xfe{}", "not UTF-8 text (byte 0xff at offset 0)"),
    (b"", "empty (0 bytes)"),
    (b" \n\t", "empty (3 bytes of white space)"),
    (b'{"a": ', "not valid JSON"),
    (b"[1, 2, 3]", "a JSON array, not an object"),
    (b"null", "a JSON null, not an object"),
    (b'"x"', "a JSON string, not an object"),
    (b'{"a": NaN}', "NaN, which JSON does not allow"),
    (b'{"a": -Infinity}', "-Infinity, which JSON does not allow"),
    (b'{"a": [1e400]}', "the number 1e400, past the range of a double"),
    (b'{"a": ' + b"9" * 5000 + b"}", "not valid JSON"),  # past Python's digit limit for int()
    (b"[" * 60_000, "nested too deeply"),
])
def test_damage_is_refused_saying_why(tmp_path: Path, content: bytes, says: str) -> None:
    path = tmp_path / "side.json"
    path.write_bytes(content)
    with pytest.raises(DamagedFile, match=r"^its? ") as refusal:
        read_json(path, max_bytes=BOUND)
    assert says in str(refusal.value) and "\n" not in str(refusal.value)


def test_an_object_is_read_and_a_missing_file_is_none(tmp_path: Path) -> None:
    path = tmp_path / "side.json"
    assert read_json(path, max_bytes=BOUND) is None
    assert read_json(tmp_path / "no-folder" / "side.json", max_bytes=BOUND) is None
    path.write_bytes(b'{"a": [1, 2.5, "x", null, true]}')
    assert read_json(path, max_bytes=BOUND) == {"a": [1, 2.5, "x", None, True]}


def test_a_file_past_the_bound_is_refused_by_its_size(tmp_path: Path) -> None:
    path = tmp_path / "side.json"
    path.write_bytes(b"{}" + b" " * (BOUND - 2))
    assert read_bounded(path, max_bytes=BOUND) is not None  # exactly the bound: read
    os.truncate(path, 200 << 20)  # sparse, 200 MB
    with pytest.raises(DamagedFile, match=f"{200 << 20} bytes, more than the {BOUND} bytes read at most"):
        read_json(path, max_bytes=BOUND)


def test_a_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "side.json").mkdir()
    with pytest.raises(DamagedFile, match="a folder, not a file"):
        read_json(tmp_path / "side.json", max_bytes=BOUND)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    """A blocking open of a FIFO waits for a writer forever: the start would hang."""
    path = tmp_path / "side.json"
    os.mkfifo(path)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            read_json(path, max_bytes=BOUND)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():  # let the open return so the thread ends, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=30)
        pytest.fail("read_json waited on a FIFO")
    assert isinstance(outcome[0], DamagedFile) and "not a regular file" in str(outcome[0])

