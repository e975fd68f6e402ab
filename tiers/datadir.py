"""The store's data dir: its OS lock, its identity, and the checks made before LMDB maps it.

LMDB maps `data.mdb` whole and trusts it: a file shorter than its own header says
kills the process with SIGBUS on the first read past its end, and an empty one is
taken for a new store. So nothing here lets LMDB touch a file before these hold:

- the data dir is a folder this process can write (not a file, not read-only);
- no other process serves it (`kvstore.lock`, an `flock` held while the tier is open);
- `capacity_bytes` fits on the disk (its free space plus what the store already uses);
- `data.mdb` is at least as long as its newer LMDB meta page says (`last_pg`), and
  the branch and leaf pages of its B-trees parse (tiers/lmdb_pages.py);
- `data.mdb` is present and not empty when `kvstore-identity.json` says a store was
  created here;
- once open: the layout is the current one and the state records parse.

Before any of these, a commit a crash left not durable is rolled back (tiers/durable.py, R36).

Every refusal is a ConfigError naming the file and what to do (docs/OPERATIONS.md).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

import lmdb

from kvstore.config import GiB, StoreSettings
from kvstore.errors import ConfigError
from kvstore.side_files import read_json
from tiers.durable import recover
from tiers.lmdb_pages import HeaderError, LmdbHeader, damaged_pages, read_header

log = logging.getLogger(__name__)

LOCK_NAME = "kvstore.lock"
IDENTITY_NAME = "kvstore-identity.json"
DATA_NAME = "data.mdb"
#: Version of the on-disk layout written into the identity file.
FORMAT_VERSION = 2
#: The most of the identity file read (it holds a few hundred bytes): a larger one is damaged.
MAX_IDENTITY_BYTES = 64 << 10
_USAGE_BYTES = 16
#: The start-time page check reads at most this many tree pages (branch and leaf,
#: not block data); a larger store is checked by `kvstore check` only.
MAX_CHECKED_TREE_PAGES = 1 << 18


def _repair_hint(data_dir: Path) -> str:
    return (f"run `kvstore check --data-dir {data_dir} --repair` to keep the intact blocks, or move "
            f"{data_dir} away and start with an empty one (the cache refills by recomputation)")


def read_lmdb_header(path: Path) -> LmdbHeader:
    """The meta page LMDB would use (of the later commit).

    Raises:
        ConfigError: the file is too short to hold its meta pages, or they are damaged.
    """
    try:
        return read_header(path)
    except HeaderError as exc:
        raise ConfigError(f"{path}: {exc}", hint=_repair_hint(path.parent)) from None


def check_length(path: Path) -> LmdbHeader:
    """Refuse a `data.mdb` shorter than its header says: LMDB would die of SIGBUS reading past its end.

    Raises:
        ConfigError: naming the file, both lengths and what to do.
    """
    header = read_lmdb_header(path)
    size = path.stat().st_size
    if size < header.expected_bytes:
        raise ConfigError(f"{path} is truncated: {size} bytes, but its LMDB header records "
                          f"{header.expected_bytes} bytes in use ({header.last_page + 1} pages of "
                          f"{header.page_size}); blocks on the missing pages are lost",
                          hint=_repair_hint(path.parent))
    return header


def check_pages(path: Path, header: LmdbHeader) -> None:
    """Refuse a store whose B-tree pages are damaged: LMDB aborts the process when a cursor meets one.

    Raises:
        ConfigError: naming the file, the first damaged pages and what to do.
    """
    damaged = damaged_pages(path, header=header, max_tree_pages=MAX_CHECKED_TREE_PAGES)
    if damaged is None:
        log.warning("%s: its B-trees span more than %d pages, so their start-time page check is skipped; "
                    "run `kvstore check --data-dir %s` now and then", path, MAX_CHECKED_TREE_PAGES, path.parent)
    elif damaged:
        listed = "; ".join(d.describe() for d in damaged[:3])
        more = f" (and {len(damaged) - 3} more)" if len(damaged) > 3 else ""
        raise ConfigError(f"{path} has {len(damaged)} damaged page(s): {listed}{more}",
                          hint=_repair_hint(path.parent))


class DataDirBusy(ConfigError):
    """Another process (or another open in this one) holds the data dir's lock."""


class DataDirLock:
    """An exclusive `flock` on `<data_dir>/kvstore.lock`, held while a tier serves the dir.

    The lock file records the holder's pid, host and start time, so a second
    opener can say who holds it. It keeps out a second *server* only: a same-host
    reader (`kvstore.client.colocated`) and `kvstore check` open LMDB read-only
    without it, registered as readers in LMDB's own `lock.mdb`, so the server
    never reuses the pages they read (tests/kvstore/client/test_colocated.py).
    The OS drops the lock when the holder dies, even by kill -9, so a stale file
    never blocks a restart.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: Path) -> DataDirLock:
        """Take the lock without waiting.

        Raises:
            DataDirBusy: another process (or another open in this one) holds it.
            ConfigError: the dir is not writable.
        """
        path = data_dir / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except IsADirectoryError:
            raise ConfigError(f"{path} is a folder, not the data dir's lock file",
                              hint=f"move {path} away (the lock file is created again at start)") from None
        except OSError as exc:
            raise _unwritable(data_dir, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DataDirBusy(f"{data_dir} is in use by another kvstore process ({holder}); two servers "
                              "on one data dir would corrupt its totals",
                              hint=f"stop that process, or give this one another store.data_dir "
                                   f"(the lock is {path})") from None
        except BaseException:
            os.close(fd)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise _unwritable(data_dir, exc) from None
        return cls(path, fd)

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (a no-op when released already). The file stays: it is only a handle."""
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor of the open file drops the flock
            self._fd = None

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the file."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, since {info['started']}"
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # whatever the lock file holds
        return "holder unknown: the lock file names no pid yet"


def _unwritable(data_dir: Path, exc: OSError) -> ConfigError:
    reason = {errno.EROFS: "is on a read-only file system", errno.EACCES: "is not writable by this user",
              errno.EPERM: "is not writable by this user"}.get(exc.errno or 0, f"cannot be written ({exc.strerror})")
    return ConfigError(f"store.data_dir {data_dir} {reason}; the store must write there",
                       hint="point store.data_dir (--data-dir) at a writable folder, or fix its permissions "
                            "or mount")


def prepare_dir(data_dir: Path) -> None:
    """Create the data dir if needed, and refuse a path that is a file or cannot be written.

    Raises:
        ConfigError: the path is a regular file (or another non-folder), or not writable.
    """
    if data_dir.exists() and not data_dir.is_dir():
        raise ConfigError(f"store.data_dir {data_dir} is a file, not a folder",
                          hint="point store.data_dir (--data-dir) at a folder (it is created if missing)")
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"store.data_dir {data_dir}: a part of that path is a file, not a folder",
                          hint="point store.data_dir (--data-dir) at a folder") from None
    except OSError as exc:
        raise _unwritable(data_dir, exc) from None
    # root passes os.access on any mode; the lock file's creation (DataDirLock) is the real test.
    if not os.access(data_dir, os.W_OK | os.X_OK):
        raise _unwritable(data_dir, OSError(errno.EACCES, "permission denied"))


def _size(n: int) -> str:
    """Bytes for people: exact count and a short unit."""
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n} bytes ({n / scale:.1f} {unit})"
    return f"{n} bytes"


def check_capacity(settings: StoreSettings) -> None:
    """Refuse a capacity the disk cannot hold: the store would fail with ENOSPC mid-Put.

    A store that already holds blocks still starts (with a warning): refusing it
    would make acknowledged blocks unreadable because something else filled the
    disk. Its Puts answer RESOURCE_EXHAUSTED when the disk runs out.

    Raises:
        ConfigError: a new store, naming the capacity, the room there is, and what to do.
    """
    data_dir = settings.data_dir
    free = shutil.disk_usage(data_dir).free
    data = data_dir / DATA_NAME
    used = data.stat().st_blocks * 512 if data.exists() else 0  # what the store already holds on disk
    if settings.capacity_bytes <= free + used:
        return
    message = (f"store.capacity_bytes={_size(settings.capacity_bytes)} is more than the disk under {data_dir} "
               f"can hold: {_size(free)} free plus {_size(used)} already used by the store = {_size(free + used)}")
    hint = ("lower store.capacity_bytes to at most that (leave room for LMDB's pages: about a fifth), "
            "free disk space, or use a larger disk")
    if used and read_identity(data_dir) is not None:
        log.warning("%s; starting anyway so the stored blocks stay readable (Puts will be refused once the "
                    "disk is full): %s", message, hint)
        print(f"kvstore: warning: {message}; starting so the stored blocks stay readable ({hint})",
              file=sys.stderr, flush=True)
        return
    raise ConfigError(message, hint=hint)


def check_files(data_dir: Path) -> None:
    """Before LMDB maps anything: the identity and `data.mdb` agree, and `data.mdb` is whole.

    Raises:
        ConfigError: the store existed but its data file is gone or empty, or is
            shorter than its header says, or its header pages are damaged.
    """
    data = data_dir / DATA_NAME
    identity = read_identity(data_dir)
    if data.exists() and not data.is_file():
        raise ConfigError(f"{data} is not a file", hint=f"move it away: {data_dir} must hold LMDB's data.mdb file")
    size = data.stat().st_size if data.exists() else None
    if identity is not None and not size:
        state = "missing" if size is None else "empty (0 bytes)"
        raise ConfigError(f"{data} is {state}, but {data_dir / IDENTITY_NAME} says store "
                          f"{identity.get('store_id')} was created here on {identity.get('created')}: "
                          "its blocks are lost, and starting would silently serve an empty store",
                          hint=f"move {data_dir} away (or delete it) and start with an empty one; the cache "
                               "refills by recomputation")
    if size:
        check_pages(data, check_length(data))


def read_identity(data_dir: Path) -> dict[str, object] | None:
    """The identity written when the store was created, or None for a new (or pre-identity) store.

    Raises:
        ConfigError: the file exists but does not parse.
    """
    path = data_dir / IDENTITY_NAME
    try:
        # Bounded (a few hundred bytes are written): any content is a one-line refusal (issue 29).
        identity = read_json(path, max_bytes=MAX_IDENTITY_BYTES)
        if identity is not None and not isinstance(identity.get("store_id"), str):
            raise ValueError("no store_id")
    except ValueError as exc:  # DamagedFile included
        raise ConfigError(f"{path} is damaged ({exc})",
                          hint=f"if {data_dir / DATA_NAME} is intact, delete {path} (it is written again at "
                               "start); otherwise move the data dir away and start empty") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}",
                          hint="check its permissions (the server's user must read it)") from None
    return identity


def node_id(data_dir: Path) -> str:
    """This store's id as a node of a fleet: the `store_id` of its identity file (docs/FLEET.md F1).

    The id names the data, not the machine or the address: a restarted node (the same
    data dir) is the same node, holding the same blocks; a wiped or new data dir is a
    new node, holding none, so the fleet never takes an empty store for one that holds
    blocks. The file is written when the store is first opened (`open_environment`).

    Raises:
        ConfigError: no store was opened in `data_dir` yet, or its identity file is damaged.
    """
    identity = read_identity(data_dir)
    if identity is None:
        raise ConfigError(f"{data_dir} holds no store yet ({IDENTITY_NAME} is missing): its node id is "
                          "written when the store is first opened",
                          hint="start `kvstore serve` on it once, or open the tier before asking its node id")
    return str(identity["store_id"])


def write_identity(data_dir: Path) -> None:
    """Record that a store lives here (atomically: a crash leaves the old file or the new one)."""
    path = data_dir / IDENTITY_NAME
    identity = {"store_id": uuid.uuid4().hex, "format_version": FORMAT_VERSION,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        json.dump(identity, f)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def open_environment(settings: StoreSettings) -> tuple[lmdb.Environment, DataDirLock]:
    """Check, lock and open the store's LMDB environment.

    Returns:
        The environment and the lock; the caller releases the lock after closing
        the environment.

    Raises:
        ConfigError: the data dir cannot be used as it is (the message names the
            file and what to do); nothing is left open.
    """
    data_dir = settings.data_dir
    prepare_dir(data_dir)
    lock = DataDirLock.acquire(data_dir)
    try:
        recover(data_dir, DATA_NAME)  # R36: before anything reads the meta pages a crash may have left
        check_files(data_dir)
        check_capacity(settings)
        # Room for B-tree pages and overflow-page rounding beyond the data itself.
        map_size = int(settings.capacity_bytes * 1.25) + GiB
        try:
            # R34: LMDB does not flush; the tier does, outside the write lock (tiers/durable.py).
            env = lmdb.open(str(data_dir), map_size=map_size, max_dbs=8, sync=False,
                            metasync=True, readahead=False, max_readers=512)
        except lmdb.Error as exc:
            raise ConfigError(f"LMDB cannot open {data_dir / DATA_NAME}: {exc}", hint=_repair_hint(data_dir)) from None
        try:
            _refuse_old_layout(env, settings)
            _check_state(env, data_dir)
            if read_identity(data_dir) is None:
                try:
                    write_identity(data_dir)
                except OSError as exc:
                    raise _unwritable(data_dir, exc) from None
        except BaseException:
            env.close()
            raise
    except BaseException:
        lock.release()
        raise
    return env, lock


def _refuse_old_layout(env: lmdb.Environment, settings: StoreSettings) -> None:
    """Stop at a store written with one database per record kind (before 2026-11-29).

    Its blocks would be invisible to this layout while its usage counters still
    counted them, so it is refused rather than served half-empty.
    """
    try:
        with env.begin() as txn:
            try:
                env.open_db(b"meta", txn=txn, create=False)
            except lmdb.NotFoundError:
                return
    except lmdb.Error as exc:
        raise ConfigError(f"{settings.data_dir / DATA_NAME}: LMDB's table of databases cannot be read ({exc})",
                          hint=_repair_hint(settings.data_dir)) from None
    raise ConfigError(f"{settings.data_dir} holds a store in an older on-disk layout (one LMDB database per "
                      "record kind); this version keeps a block's records together. Start with an empty "
                      "store.data_dir (the cache refills from recomputation)")


def _check_state(env: lmdb.Environment, data_dir: Path) -> None:
    """The usage totals and counters the tier reads at start parse (a damaged page must not
    surface as a raw UnicodeDecodeError or struct.error)."""
    try:
        with env.begin() as txn:
            try:
                state = env.open_db(b"state", txn=txn, create=False)
            except lmdb.NotFoundError:
                return  # a new store: the tier creates it
            usage = txn.get(b"usage", db=state)
            counters = txn.get(b"counters", db=state)
    except lmdb.Error as exc:
        raise ConfigError(f"{data_dir / DATA_NAME}: the store's state records cannot be read ({exc})",
                          hint=_repair_hint(data_dir)) from None
    problem = None
    if usage is not None and len(usage) != _USAGE_BYTES:
        problem = f"usage totals are {len(usage)} bytes, not {_USAGE_BYTES}"
    if counters is not None:
        try:
            if not isinstance(json.loads(counters), dict):
                problem = "counters are not a JSON object"
        except ValueError as exc:  # UnicodeDecodeError included
            problem = f"counters do not parse ({exc})"
    if problem:
        raise ConfigError(f"{data_dir / DATA_NAME}: the store's state records are damaged: {problem}",
                          hint=_repair_hint(data_dir))
