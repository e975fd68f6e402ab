"""LMDB's data file read page by page with `pread`, never mapped, every offset bounds-checked.

LMDB trusts its file: a read past a truncated end dies of SIGBUS, and a cursor
stepping onto a damaged leaf fails an assertion and aborts the process
(mdb.c: "Assertion 'IS_LEAF(mp)' failed in mdb_cursor_next()"). Neither can be
caught, so what must survive damage (the start-time page check, `kvstore check`)
reads the B-trees here instead, reporting each damaged page with the key range
it covered.

The layout is LMDB 0.9's on a 64-bit little-endian host (mdb.c): a 16-byte page
header (pgno u64, pad u16, flags u16, lower u16, upper u16; an overflow page has
a u32 page count where lower and upper are), then, on branch and leaf pages,
u16 node offsets. A node is lo u16, hi u16, flags u16, key size u16, the key,
then (leaf) the value inline or an overflow page number (F_BIGDATA), or (branch)
nothing: the child's page number is lo | hi << 16 | flags << 32.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

PAGE_HEADER = struct.Struct("<QHHHH")
_META = struct.Struct("<IIQQ48s48sQQ")
_DB = struct.Struct("<IHHQQQQQ")
_NODE = struct.Struct("<HHHH")
_PGNO = struct.Struct("<Q")
_COUNT = struct.Struct("<I")
LMDB_MAGIC = 0xBEEFC0DE
LMDB_DATA_VERSION = 1
P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
_P_KIND = P_BRANCH | P_LEAF | P_OVERFLOW | P_META | 0x20 | 0x40  # LEAF2, SUBP: never in our trees
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
P_INVALID = (1 << 64) - 1
_HEADER_BYTES = PAGE_HEADER.size + _META.size
_SCAN_PAGES = 256  # pages read at once by `PageReader.stray_leaves`


class HeaderError(Exception):
    """The file's LMDB meta pages are missing or damaged."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tree:
    """One B-tree's record (MDB_db): where its root is and how deep it goes."""

    depth: int
    entries: int
    root: int
    tree_pages: int  # branch and leaf pages (the values on overflow pages not counted)

    @classmethod
    def unpack(cls, raw: bytes) -> Tree:
        _, _, depth, branch, leaf, _, entries, root = _DB.unpack(raw)
        return cls(depth=depth, entries=entries, root=root, tree_pages=branch + leaf)


@dataclass(frozen=True, kw_only=True, slots=True)
class LmdbHeader:
    """What one of the file's two meta pages says (LMDB uses the one of the later commit)."""

    page_size: int
    last_page: int
    txn_id: int
    free_tree: Tree
    main_tree: Tree

    @property
    def expected_bytes(self) -> int:
        """The least length the file must have: every page up to the last used one."""
        return (self.last_page + 1) * self.page_size


def read_headers(path: Path) -> list[LmdbHeader]:
    """Both meta pages of `path`, in page order.

    Raises:
        HeaderError: the file is too short to hold them, or one is not an LMDB meta page.
    """
    with path.open("rb") as f:
        first = f.read(_HEADER_BYTES)
        if len(first) < _HEADER_BYTES:
            raise HeaderError(f"{path.stat().st_size} bytes: too short to hold LMDB's header pages")
        meta0 = _parse_meta(first, 0)
        f.seek(meta0.page_size)
        second = f.read(_HEADER_BYTES)
    if len(second) < _HEADER_BYTES:
        raise HeaderError(f"{path.stat().st_size} bytes: too short to hold LMDB's header pages")
    return [meta0, _parse_meta(second, 1)]


def read_header(path: Path) -> LmdbHeader:
    """The meta page LMDB would use: the one with the higher transaction id."""
    return max(read_headers(path), key=lambda m: m.txn_id)


def _parse_meta(raw: bytes, index: int) -> LmdbHeader:
    flags = PAGE_HEADER.unpack_from(raw)[2]
    magic, version, _, _, free_db, main_db, last_page, txn_id = _META.unpack_from(raw, PAGE_HEADER.size)
    page_size = _COUNT.unpack_from(free_db)[0]  # md_pad of the free tree's record holds the page size
    if not flags & P_META or magic != LMDB_MAGIC or version != LMDB_DATA_VERSION or not 512 <= page_size <= 65536 \
            or page_size & (page_size - 1):
        raise HeaderError(f"LMDB header page {index} is damaged (or this is not an LMDB file)")
    return LmdbHeader(page_size=page_size, last_page=last_page, txn_id=txn_id,
                      free_tree=Tree.unpack(free_db), main_tree=Tree.unpack(main_db))


@dataclass(frozen=True, kw_only=True, slots=True)
class DamagedPage:
    """A page a tree points at that cannot be read as what it should be.

    Attributes:
        tree: which tree ("main", "free" or a named database).
        page: its page number.
        reason: what is wrong with it.
        low: the least key it could hold (b"" from the start).
        high: the key after the last it could hold (None to the end).
    """

    tree: str
    page: int
    reason: str
    low: bytes
    high: bytes | None

    def describe(self) -> str:
        """One line: the tree, the page, the keys lost and why."""
        if self.high == self.low + b"\0":
            return f"{self.tree}: page {self.page}, the value of key {short_key(self.low)}: {self.reason}"
        high = "the end" if self.high is None else short_key(self.high)
        low = short_key(self.low) if self.low else "the start"
        return f"{self.tree}: page {self.page}, keys from {low} to {high}: {self.reason}"


def short_key(key: bytes) -> str:
    """A key for people: a block's storage key starts with 16 bytes its scope's blocks share,
    so past 24 bytes the part after them is shown."""
    return key.hex() if len(key) <= 24 else f"...{key[16:28].hex()}..."


#: Value of a leaf entry whose overflow pages are damaged.
UNREADABLE = None


@dataclass(kw_only=True)
class PageReader:
    """Walks the B-trees of one LMDB data file as committed by `header`'s transaction.

    Args:
        path: the data file.
        header: the meta page to read from (the newest when None).
    """

    path: Path
    header: LmdbHeader | None = None
    damaged: list[DamagedPage] = field(default_factory=list)
    #: Leaf pages read intact so far, in the order walked.
    leaves: list[int] = field(default_factory=list)
    #: Branch and leaf pages read intact so far, of every tree.
    reached: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.header is None:
            self.header = read_header(self.path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self._size = os.fstat(self._fd).st_size

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)

    def __enter__(self) -> PageReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _head(self) -> LmdbHeader:
        assert self.header is not None
        return self.header

    def named_trees(self) -> dict[bytes, Tree]:
        """The named databases (records, lru, state) the main tree lists."""
        out = {}
        for name, value, flags in self._entries(self._head.main_tree, "main", values=True):
            if flags & F_SUBDATA and value is not None and len(value) == _DB.size:
                out[name] = Tree.unpack(value)
        return out

    def check_free_tree(self) -> None:
        """Walk the free-page tree (LMDB's writer walks it with a cursor) for damage."""
        for _ in self._entries(self._head.free_tree, "free", values=False):
            pass

    def free_pages(self) -> set[int] | None:
        """The pages the free tree lists (each value an IDL: a u64 count, then that many page
        numbers); None when a page of it cannot be read. Damage met is not recorded here
        (`check_free_tree` reports it)."""
        damaged, free = list(self.damaged), set[int]()
        try:
            for _, value, _ in self._entries(self._head.free_tree, "free", values=True):
                count = _PGNO.unpack_from(value)[0] if value is not None and len(value) >= 8 else -1
                if not 0 <= count <= (len(value or b"") - 8) // 8:
                    return None
                free.update(struct.unpack_from(f"<{count}Q", value, 8))  # type: ignore[arg-type]
            return None if len(self.damaged) > len(damaged) else free
        finally:
            self.damaged[:] = damaged

    def stray_leaves(self, skip: Collection[int]) -> Iterator[tuple[int, list[tuple[bytes, bytes | None]]]]:
        """Every intact leaf page of the file not in `skip`, in page order, with its (key, value)s.

        This finds the leaves a lost branch page (or root) cut off from their tree. The
        file is read in runs of pages; an overflow run (a value's pages) is stepped over
        whole, so the bytes of a value are never taken for a page. A value whose overflow
        pages are damaged is UNREADABLE (the damage recorded as the records tree's).
        """
        psize, end = self._head.page_size, min(self._head.last_page + 1, self._size // self._head.page_size)
        page = 2
        while page < end:
            count = min(_SCAN_PAGES, end - page)
            raw = os.pread(self._fd, count * psize, page * psize)
            at = 0
            while at < count:
                head_pgno, _, flags, _, _ = PAGE_HEADER.unpack_from(raw, at * psize)
                run = _COUNT.unpack_from(raw, at * psize + 12)[0] if flags & P_OVERFLOW else 1
                if head_pgno != page + at or not 1 <= run <= end - page - at:
                    run = 1
                elif flags & _P_KIND == P_LEAF and page + at not in skip:
                    reason, nodes = self._nodes(raw[at * psize:(at + 1) * psize], page + at, 1, b"", None,
                                                ordered=True)
                    if not reason:
                        yield page + at, [(key, self._overflow(_PGNO.unpack(value)[0], size, key, "records", True)
                                           if nflags & F_BIGDATA else value) for key, nflags, size, value in nodes]
                at += run
            page += at

    def find_leaf(self, tree: Tree, key: bytes) -> tuple[int, str]:
        """(the page that holds or would hold `key`, why it is damaged or ""), going down from the root
        as LMDB's search does: the leaf when every page on the way reads intact, else the first that does
        not. P_INVALID for an empty tree."""
        pgno, level, low, high = tree.root, tree.depth, b"", None
        if pgno == P_INVALID or level == 0:  # an empty tree
            return P_INVALID, ""
        while True:
            page = self._page(pgno)
            if page is None:
                return pgno, "the page is past the end of the file or the last used page"
            reason, nodes = self._nodes(page, pgno, level, low, high, ordered=True)
            if reason or level == 1:
                return pgno, reason
            i = max([0] + [n for n in range(1, len(nodes)) if nodes[n][0] <= key])
            low = low if i == 0 else nodes[i][0]
            high = nodes[i + 1][0] if i + 1 < len(nodes) else high
            pgno, level = _PGNO.unpack(nodes[i][3])[0], level - 1

    def entries(self, tree: Tree, name: str, *, values: bool = True) -> Iterator[tuple[bytes, bytes | None]]:
        """Every readable (key, value) of `tree` in key order; damaged pages go to `self.damaged`.

        A value is UNREADABLE (None) when its overflow pages are damaged; with
        `values` False, overflow values are not read (None) and only the tree's
        branch and leaf pages are checked.
        """
        for key, value, _ in self._entries(tree, name, values=values):
            yield key, value

    def _entries(self, tree: Tree, name: str, *, values: bool) -> Iterator[tuple[bytes, bytes | None, int]]:
        if tree.root == P_INVALID or tree.depth == 0:
            return
        yield from self._walk(tree.root, tree.depth, b"", None, name, values, set())

    def _page(self, pgno: int, count: int = 1) -> bytes | None:
        psize = self._head.page_size
        if pgno + count - 1 > self._head.last_page or (pgno + count) * psize > self._size:
            return None
        raw = os.pread(self._fd, count * psize, pgno * psize)
        return raw if len(raw) == count * psize else None

    def _walk(self, pgno: int, level: int, low: bytes, high: bytes | None, name: str, values: bool,
              seen: set[int]) -> Iterator[tuple[bytes, bytes | None, int]]:
        page = self._page(pgno)
        nodes: list[tuple[bytes, int, int, bytes]] = []
        if page is None:
            reason = (f"page {pgno} is past the last used page {self._head.last_page}"
                      if pgno > self._head.last_page else "the page is past the end of the file (truncated)")
        elif pgno in seen:
            reason = "the page is reached twice (a cycle)"
        else:
            seen.add(pgno)
            reason, nodes = self._nodes(page, pgno, level, low, high, ordered=name != "free")
        if reason:
            self.damaged.append(DamagedPage(tree=name, page=pgno, reason=reason, low=low, high=high))
            return
        self.reached.add(pgno)
        if level == 1:
            self.leaves.append(pgno)
        else:
            for i, (key, _, _, raw) in enumerate(nodes):
                child = _PGNO.unpack(raw)[0]
                child_low = low if i == 0 else key
                child_high = nodes[i + 1][0] if i + 1 < len(nodes) else high
                yield from self._walk(child, level - 1, child_low, child_high, name, values, seen)
            return
        for key, flags, size, raw in nodes:
            if flags & F_BIGDATA:
                yield key, self._overflow(_PGNO.unpack(raw)[0], size, key, name, values), flags
            else:
                yield key, raw, flags

    def _nodes(self, page: bytes, pgno: int, level: int, low: bytes, high: bytes | None, *, ordered: bool
               ) -> tuple[str, list[tuple[bytes, int, int, bytes]]]:
        """Parse a branch (level > 1) or leaf page: (why it is damaged or "", its nodes).

        `ordered`: keys compare as bytes (the free tree's are integers: not checked).
        """
        psize = self._head.page_size
        head_pgno, _, flags, lower, upper = PAGE_HEADER.unpack_from(page)
        want = P_BRANCH if level > 1 else P_LEAF
        if head_pgno != pgno:
            return f"its header names page {head_pgno}", []
        if flags & _P_KIND != want:
            return f"flags {flags:#x}, expected a {'branch' if level > 1 else 'leaf'} page", []
        if not PAGE_HEADER.size <= lower <= upper <= psize or lower % 2:
            return f"bad free-space bounds {lower}..{upper}", []
        count = (lower - PAGE_HEADER.size) // 2
        if count == 0:
            return "an empty page in a tree", []
        offsets = struct.unpack_from(f"<{count}H", page, PAGE_HEADER.size)
        nodes = []
        previous = low
        for i, at in enumerate(offsets):
            if not upper <= at <= psize - _NODE.size:
                return f"node {i} lies outside the page's node area", []
            lo, hi, nflags, ksize = _NODE.unpack_from(page, at)
            key_end = at + _NODE.size + ksize
            if level > 1:
                size, data_end = 8, key_end
                value = (lo | hi << 16 | nflags << 32).to_bytes(8, "little")
                if (lo | hi << 16 | nflags << 32) > self._head.last_page:
                    return f"node {i} points at page {lo | hi << 16 | nflags << 32}, past the last used page", []
            else:
                size = lo | hi << 16
                data_end = key_end + (8 if nflags & F_BIGDATA else size)
                if nflags & ~(F_BIGDATA | F_SUBDATA) or data_end > psize:
                    return f"node {i} is malformed (flags {nflags:#x}, ends at {data_end})", []
                value = page[key_end:data_end]
            if key_end > psize:
                return f"node {i}'s key runs past the page", []
            key = page[at + _NODE.size:key_end]
            if ordered and (level == 1 or i > 0) and (key < previous or (high is not None and key >= high)):
                return f"node {i}'s key is out of order", []
            previous = key if (level == 1 or i > 0) else previous
            nodes.append((key, nflags, size, value))
        return "", nodes

    def _overflow(self, pgno: int, size: int, key: bytes, name: str, values: bool) -> bytes | None:
        psize = self._head.page_size
        count = (PAGE_HEADER.size + size + psize - 1) // psize
        if not values:  # only where it is: the header and the run are read with the value
            if pgno + count - 1 <= self._head.last_page:
                return None
            self.damaged.append(DamagedPage(tree=name, page=pgno, reason="the value's overflow pages run past "
                                            "the last used page", low=key, high=key + b"\0"))
            return UNREADABLE
        head = self._page(pgno)
        reason = ""
        if head is None:
            reason = "the value's overflow page is past the end of the file"
        else:
            head_pgno, _, flags, _, _ = PAGE_HEADER.unpack_from(head)
            pages = _COUNT.unpack_from(head, 12)[0]
            if head_pgno != pgno or not flags & P_OVERFLOW or pages < count:
                reason = f"the value's overflow page {pgno} is damaged (header names page {head_pgno}, " \
                         f"flags {flags:#x}, {pages} pages for {count})"
        run = None if reason else self._page(pgno, count)
        if run is None:
            reason = reason or "the value's overflow pages run past the end of the file"
            self.damaged.append(DamagedPage(tree=name, page=pgno, reason=reason, low=key, high=key + b"\0"))
            return UNREADABLE
        return run[PAGE_HEADER.size:PAGE_HEADER.size + size]


def damaged_pages(path: Path, *, header: LmdbHeader | None = None,
                  max_tree_pages: int | None = None) -> list[DamagedPage] | None:
    """Check the branch and leaf pages of every tree (not the values on overflow pages).

    Returns:
        The damaged pages found, or None when the trees hold more than
        `max_tree_pages` branch and leaf pages (nothing past the main tree read).
    """
    with PageReader(path=path, header=header) as reader:
        trees = reader.named_trees()
        size = reader._head.free_tree.tree_pages + sum(t.tree_pages for t in trees.values())
        if max_tree_pages is not None and size > max_tree_pages:
            return None
        reader.check_free_tree()
        for name, tree in trees.items():
            for _ in reader.entries(tree, name.decode(errors="replace"), values=False):
                pass
        return reader.damaged
