"""API tokens of tenants, and the file that holds their hashes (docs/SECURITY.md).

A token is `kvst_<token_id>_<secret>`: `token_id` (8 hex digits) names it in
listings and revocations, `secret` is 32 random bytes (256 bits) from the OS
CSPRNG. Only SHA-256 of the whole token is stored: the token itself is printed
once, when it is created, and never written anywhere.

Why one unsalted SHA-256 and not bcrypt/scrypt/argon2: those slow hashes exist
to make guessing a *low-entropy* secret (a password) expensive. A 256-bit random
secret cannot be guessed at any hash speed, and nothing is shared between two
tokens for a salt to separate, so a slow hash would add no protection while
costing milliseconds on every call (the server checks a token per RPC).

The tenants file is JSON, written whole and atomically (a temporary file,
fsync, rename, fsync of the folder), with mode 0600; writers serialise on an
`flock` of `<file>.lock`, so two `kvstore tenant` commands never lose each
other's change. A running server re-reads it when it changes (gateway.tenants).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvstore.errors import ConfigError, InvalidArgument, NotFound
from kvstore.side_files import DamagedFile, read_json

#: Rights a token may carry. "admin" also lets a call name any tenant's namespace.
READ, WRITE, ADMIN = "read", "write", "admin"
RIGHTS = (READ, WRITE, ADMIN)
#: File name of the tenants file inside the data dir when `auth.tenants_file` is not set.
TENANTS_FILE_NAME = "tenants.json"
FORMAT_VERSION = 1
TOKEN_PREFIX = "kvst_"
#: A tenant name is a namespace name (gateway.validate): 1-128 of [A-Za-z0-9._-], alphanumeric first.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SECRET_BYTES = 32
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: The most of the tenants file read: a record is about 250 bytes, so about 250,000 tokens. A larger
#: file is refused as damaged (at start a ConfigError; while serving, the last table is kept).
MAX_FILE_BYTES = 64 << 20


def token_hash(token: str) -> bytes:
    """The stored form of a token: SHA-256 of its UTF-8 bytes (see the module doc for why)."""
    return hashlib.sha256(token.encode()).digest()


def check_tenant(name: str) -> str:
    """`name` when it can name a tenant.

    Raises:
        InvalidArgument: naming what a tenant name may hold.
    """
    if not TENANT_NAME.fullmatch(name):
        raise InvalidArgument(f"tenant {name!r} is not 1-128 of [A-Za-z0-9._-] starting alphanumeric")
    return name


def check_rights(rights: list[str] | tuple[str, ...] | frozenset[str]) -> frozenset[str]:
    """The rights as a set, each one of RIGHTS.

    Raises:
        InvalidArgument: an unknown right, or none at all.
    """
    unknown = sorted(set(rights) - set(RIGHTS))
    if unknown or not rights:
        raise InvalidArgument(f"rights {sorted(rights)} are not a non-empty subset of {', '.join(RIGHTS)}")
    return frozenset(rights)


@dataclass(frozen=True, kw_only=True)
class TokenRecord:
    """One issued token, as stored: its id, tenant, rights and hash; never the token."""

    token_id: str
    tenant: str
    rights: tuple[str, ...]
    sha256: str
    created_at: str
    revoked_at: str | None = None

    @property
    def active(self) -> bool:
        """Whether the token is still accepted."""
        return self.revoked_at is None


def now_stamp() -> str:
    """The time a record is created or revoked at, as stored: ISO 8601, UTC, to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def new_token() -> tuple[str, str]:
    """(token_id, token): a fresh token and the id it is listed under."""
    token_id = secrets.token_hex(4)
    return token_id, f"{TOKEN_PREFIX}{token_id}_{secrets.token_urlsafe(_SECRET_BYTES)}"


def issue(tenant: str, rights: frozenset[str]) -> tuple[TokenRecord, str]:
    """A new token for `tenant` (rights already checked) and the record that stores its hash; nothing is written."""
    token_id, token = new_token()
    record = TokenRecord(token_id=token_id, tenant=tenant, rights=tuple(r for r in RIGHTS if r in rights),
                         sha256=token_hash(token).hex(), created_at=now_stamp())
    return record, token


def read_records(path: Path) -> list[TokenRecord] | None:
    """Every record of the tenants file at `path`; None when there is no such file.

    At most MAX_FILE_BYTES are read, and every record is checked field by field
    (a token the server cannot hash-match, or rights it does not know, are damage
    too), so any content gives either the records or one ConfigError.

    Raises:
        ConfigError: the file cannot be read, or is damaged in any way, naming it and why.
    """
    try:
        data = read_json(path, max_bytes=MAX_FILE_BYTES)
    except OSError as exc:
        raise ConfigError(f"cannot read tenants file {path}: {exc.strerror or exc}",
                          hint="check its permissions (the server's user must read it)") from None
    except DamagedFile as exc:
        raise _damaged(path, str(exc)) from None
    if data is None:
        return None
    try:
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {_short(data.get('version'))}, expected {FORMAT_VERSION}")
        tokens = data.get("tokens")
        if not isinstance(tokens, list):
            raise ValueError(f"'tokens' is {type(tokens).__name__}, not a list")
        return [_record(i, r) for i, r in enumerate(tokens)]
    except ValueError as exc:
        raise _damaged(path, str(exc)) from None


def _short(value: object) -> str:
    """`value`'s repr cut to a few words: the message of a damaged file stays one short line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _damaged(path: Path, why: str) -> ConfigError:
    return ConfigError(f"tenants file {path} is damaged: {why}",
                       hint="restore it from a backup, or move it away and create the tenants again")


def record_from_json(data: bytes, where: str) -> TokenRecord:
    """One token record stored alone (the fleet keeps one per etcd key), every field checked as in the file.

    Raises:
        ValueError: naming `where` and what is wrong (not UTF-8 JSON, an object of the wrong shape).
    """
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"token record {where} is not JSON ({type(exc).__name__})") from None
    return _record(where, raw)


def record_to_json(record: TokenRecord) -> bytes:
    """One token record as `record_from_json` reads it."""
    return json.dumps(asdict(record), sort_keys=True).encode()


def _record(index: int | str, raw: object) -> TokenRecord:
    """Record `index` of the file (or the key it is stored under), every field checked.

    Raises:
        ValueError: naming the record and the field.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"token record {index} is {type(raw).__name__}, not an object")
    fields = {f.name for f in dataclasses.fields(TokenRecord)}
    unknown, missing = sorted(set(raw) - fields), sorted(fields - {"revoked_at"} - set(raw))
    if unknown or missing:
        raise ValueError(f"token record {index} has unknown fields {_short(unknown)} or lacks {_short(missing)}")
    text = {k: raw[k] for k in ("token_id", "tenant", "sha256", "created_at")}
    wrong = sorted(k for k, v in text.items() if not isinstance(v, str))
    revoked = raw.get("revoked_at")
    rights = raw["rights"]
    if wrong or not (revoked is None or isinstance(revoked, str)) or not isinstance(rights, list) \
            or not all(isinstance(r, str) for r in rights):
        raise ValueError(f"token record {index}: {wrong or 'revoked_at or rights'} of the wrong type")
    if not _SHA256.fullmatch(raw["sha256"]):
        raise ValueError(f"token record {index}: sha256 is not 64 hex digits")
    if not TENANT_NAME.fullmatch(raw["tenant"]):
        raise ValueError(f"token record {index}: tenant {_short(raw['tenant'])} is not a tenant name")
    if not rights or not set(rights) <= set(RIGHTS):
        raise ValueError(f"token record {index}: rights {_short(rights)} are not a non-empty subset of "
                         f"{', '.join(RIGHTS)}")
    return TokenRecord(token_id=raw["token_id"], tenant=raw["tenant"], rights=tuple(rights), sha256=raw["sha256"],
                       created_at=raw["created_at"], revoked_at=revoked)


def _write(path: Path, records: list[TokenRecord]) -> None:
    """Replace the file at `path` atomically and durably, readable by its owner only."""
    body = json.dumps({"version": FORMAT_VERSION, "tokens": [asdict(r) for r in records]}, indent=1)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, body.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[list[TokenRecord]]:
    """The records under the writers' lock; the list as left by the body is written back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = read_records(path) or []
        before = list(records)
        yield records
        if records != before:
            _write(path, records)


def create(path: Path, tenant: str, rights: frozenset[str]) -> tuple[TokenRecord, str]:
    """Issue a token for `tenant` (creating the file, and so turning auth on, if needed).

    A tenant may hold several tokens (rotation: create the new one, move the
    clients, revoke the old one).

    Returns:
        The stored record and the token, which is shown once and kept nowhere.
    """
    check_tenant(tenant)
    rights = check_rights(rights)
    with _locked(path) as records:
        taken = {r.token_id for r in records}
        record, token = issue(tenant, rights)
        while record.token_id in taken:
            record, token = issue(tenant, rights)
        records.append(record)
    return record, token


def revoke(path: Path, tenant: str, token_id: str | None = None) -> list[TokenRecord]:
    """Revoke every active token of `tenant`, or only `token_id`; revoked records stay listed.

    Raises:
        NotFound: no active token matched.
    """
    with _locked(path) as records:
        hits = [i for i, r in enumerate(records)
                if r.tenant == tenant and r.active and token_id in (None, r.token_id)]
        if not hits:
            what = f"token {token_id} of tenant {tenant!r}" if token_id else f"tenant {tenant!r}"
            raise NotFound(f"no active {what} in {path}", hint="`kvstore tenant list` shows them")
        stamp = now_stamp()
        for i in hits:
            records[i] = replace(records[i], revoked_at=stamp)
        return [records[i] for i in hits]
