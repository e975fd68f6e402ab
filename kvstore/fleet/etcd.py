"""One etcd client (aetcd, on grpcio and asyncio) over a list of endpoints, failing over between them.

aetcd's client speaks to one `host:port`; a three-member etcd answers on any
member, so `EtcdSession` keeps one client at a time and moves to the next
endpoint when a call finds its member unreachable. Each client gets a fresh
channel with its own subchannel pool and a short reconnect backoff, so a member
that comes back is used again within seconds (gRPC's shared default would wait
up to two minutes). etcd's errors leave here as `kvstore.errors` classes, an
unreachable etcd as `Unavailable` naming every endpoint tried (docs/FLEET.md).

TLS to etcd (F57): aetcd 1.x opens only plaintext channels (`Client.connect` calls
`insecure_channel`), so `_TlsClient` is aetcd's client with that one call made a
`secure_channel` with the session's credentials; everything else is aetcd's.

etcd's user authentication (F70): aetcd's client takes a user and password and
authenticates when it connects (etcd's Authenticate, its token sent with every call);
`_TlsClient` does the same over TLS. The password is read from its file when a session
is made, and again each time the session makes a client (a reconnect: another endpoint, a
token etcd forgot, credentials refused), so a password changed in etcd and in the file is
used from the next connect without a restart (F70a); it lives only in the session and its
client. A token etcd no longer takes (it expired while the client was idle, etcd restarted,
the user's password changed, or, as a JWT or a simple token carries the auth store's revision,
any user, role or password changed since it was issued: F70c) is answered by connecting again,
once, which authenticates again. etcd's JWT tokens (`--auth-token jwt,...`) are sent as its
simple ones are (F70c).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aetcd
import aetcd.client
import grpc
from aetcd import rpc

from kvstore.errors import ConfigError, Internal, KVStoreError, PermissionDenied, Unauthenticated, Unavailable
from kvstore.fleet.endpoints import Endpoint, EtcdAuth, EtcdTls

log = logging.getLogger(__name__)
T = TypeVar("T")

#: aetcd's errors that mean "this member cannot answer now": try the next one.
UNREACHABLE = (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError)
#: What a member that answers says while the cluster cannot serve a call right now (its members electing a
#: leader after one was lost, a request outliving its own deadline there): worth the same call again.
_TRANSIENT = ("context deadline exceeded", "etcdserver: request timed out", "etcdserver: leader changed",
              "etcdserver: no leader")


def _channel_options(timeout_s: float) -> dict[str, int]:
    """gRPC options of a channel to one member: notice a dead member, reconnect soon to a revived one."""
    backoff_ms = max(200, int(timeout_s * 1000))
    return {
        # A new channel must not inherit another's backoff through the process-wide subchannel pool.
        "grpc.use_local_subchannel_pool": 1,
        "grpc.initial_reconnect_backoff_ms": backoff_ms,
        "grpc.min_reconnect_backoff_ms": backoff_ms,
        "grpc.max_reconnect_backoff_ms": backoff_ms,
        # A member that stops answering (SIGSTOP, a cut link) fails the watch within ~10 s; etcd accepts
        # pings every 5 s at the most (its --grpc-keepalive-min-time).
        "grpc.keepalive_time_ms": 5000,
        "grpc.keepalive_timeout_ms": 5000,
    }


#: What etcd says of credentials it refuses (INVALID_ARGUMENT) and of a call without them while its auth is on.
_BAD_CREDENTIALS = "authentication failed"
_NO_USER = "user name is empty"
#: What etcd says of a token it does not take: one it does not know (a simple token expired, dropped by a password
#: change, or etcd restarted; a JWT past its `exp`), and one issued before the auth store's last change (any user,
#: role or password changed since: a JWT is never dropped, and a simple token of another user is kept, but both carry
#: the revision they were issued at, F70c). Either way: authenticate again.
_STALE_TOKENS = ("invalid auth token", "revision of auth store is old")


def _status_code(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC status under an aetcd error (aetcd raises its own classes from the RPC error)."""
    cause = exc.__cause__
    return cause.code() if isinstance(cause, grpc.aio.AioRpcError) else None


def translate(exc: BaseException, endpoints: Sequence[Endpoint], auth: EtcdAuth | None = None) -> KVStoreError:
    """The kvstore error for an aetcd (or gRPC) error met talking to `endpoints` as `auth`'s user (None: none)."""
    if isinstance(exc, KVStoreError):
        return exc
    where = ", ".join(str(e) for e in endpoints)
    text = str(exc)
    settings = "[fleet] etcd_user and etcd_password_file (a client's address: ?user=NAME&password_file=PATH)"
    if _BAD_CREDENTIALS in text:
        return Unauthenticated(f"etcd at {where} refused user {auth.user if auth else ''!r}: {text}",
                               hint=f"check the user and the password in its file ({settings})")
    if _NO_USER in text or (auth is None and isinstance(exc, aetcd.exceptions.UnauthenticatedError)):
        return Unauthenticated(f"etcd at {where} has authentication on and this process gave no user: {text}",
                               hint=f"set {settings} (docs/FLEET.md F70)")
    if _status_code(exc) == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDenied(f"etcd at {where} denied user {auth.user if auth else ''!r} the call: {text}",
                                hint="grant the user's role readwrite on the fleet's keys: etcdctl role "
                                     "grant-permission ROLE --prefix=true readwrite /kvstore/CLUSTER/ "
                                     "(docs/FLEET.md F70)")
    if any(transient in text for transient in _TRANSIENT):
        return Unavailable(f"etcd at {where} cannot serve the call now ({text})",
                           hint="its members are electing a leader or it is overloaded: the call may be retried")
    if isinstance(exc, UNREACHABLE):
        return Unavailable(f"etcd does not answer at {where} ({exc})",
                           hint="start etcd there, or point [fleet] etcd (KVSTORE_FLEET_ETCD) at its client URLs; "
                                "an etcd serving TLS is written https:// (etcds:// for a client), its CA in "
                                "[fleet] etcd_ca_file")
    if isinstance(exc, aetcd.exceptions.UnauthenticatedError):
        return Unauthenticated(f"etcd at {where} refused the call: {exc}", hint=f"check {settings}")
    return Internal(f"etcd at {where} failed the call: {type(exc).__name__}: {exc}")


class _StaleToken(Exception):
    """A call refused for a token etcd no longer knows (`EtcdSession.call` authenticates again, once)."""

    def __init__(self, error: aetcd.ClientError) -> None:
        super().__init__(str(error))
        self.error = error


class _TlsClient(aetcd.Client):
    """aetcd's client over a TLS channel (aetcd 1.x has no TLS option): `connect` as aetcd's, the channel secure.

    Args:
        credentials: the channel's credentials (`EtcdTls.credentials`).
        kwargs: aetcd.Client's (host, port, timeout, options).
    """

    _is_connecting: bool  # aetcd's, set in its __init__
    _username: str | None
    _password: str | None

    def __init__(self, *, credentials: grpc.ChannelCredentials, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._credentials = credentials

    @aetcd.client._handle_errors  # type: ignore[misc]  # aetcd's own error mapping, as its connect has
    async def connect(self) -> None:
        """Open the channel (TLS) and the stubs, and authenticate as aetcd's connect does when given a user (F70)."""
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it, as aetcd's connect does
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = rpc.secure_channel(f"{self._host}:{self._port}", self._credentials,
                                              options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                reply = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
                self.metadata = (("token", reply.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.client.watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                                         metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


class EtcdSession:
    """Calls to an etcd cluster through one aetcd client at a time, moving to the next endpoint on failure.

    Args:
        endpoints: the members' client addresses, tried in order (the first that answers is kept).
        timeout_s: deadline of each call to one member.
        tls: speak TLS to etcd with these files (None: plaintext).
        auth: authenticate as this etcd user (F70; None: no user, for an etcd without auth).

    Raises:
        ConfigError: a TLS or password file that cannot be read (naming it).
    """

    def __init__(self, endpoints: Sequence[Endpoint], *, timeout_s: float, tls: EtcdTls | None = None,
                 auth: EtcdAuth | None = None) -> None:
        if not endpoints:
            raise ValueError("an etcd session needs at least one endpoint")
        self.endpoints = tuple(endpoints)
        self.timeout_s = timeout_s
        self.tls, self.auth = tls, auth
        # Read once: a bad file fails the session's making, with its name, not each call.
        self._credentials = tls.credentials() if tls is not None else None
        self._password = auth.password() if auth is not None else None
        self._current = 0
        self._client: aetcd.Client | None = None

    @property
    def endpoint(self) -> Endpoint:
        """The member calls go to now."""
        return self.endpoints[self._current]

    def _open(self) -> aetcd.Client:
        if self._client is None:
            endpoint = self.endpoint
            self._password = self._fresh_password()  # a reconnect reads the file again (F70a)
            # aetcd passes `timeout` to gRPC as the deadline of each unary call (seconds, float is fine).
            kwargs = {"host": endpoint.host, "port": endpoint.port, "timeout": self.timeout_s,
                      "options": _channel_options(self.timeout_s),
                      "username": self.auth.user if self.auth else None, "password": self._password}
            self._client = (aetcd.Client(**kwargs) if self._credentials is None  # type: ignore[arg-type]
                            else _TlsClient(credentials=self._credentials, **kwargs))
        return self._client

    def _fresh_password(self) -> str | None:
        """The password file's first line, read now; one that cannot be read now (a rotation half done) keeps
        the password read before, logged: the session was made with a good one, and etcd judges either."""
        if self.auth is None:
            return None
        try:
            return self.auth.password()
        except ConfigError as exc:
            log.warning("etcd: %s; authenticating with the password read before", exc.message)
            return self._password

    async def reset(self, *, next_endpoint: bool = True) -> None:
        """Drop the client (its channel and watches); the next call opens a new one, on the next endpoint."""
        client, self._client = self._client, None
        if next_endpoint:
            self._current = (self._current + 1) % len(self.endpoints)
        if client is not None:
            try:
                await client.close()
            except Exception as exc:  # a channel already broken may fail to close; it is dropped either way
                log.debug("closing the etcd client of %s: %s", self.endpoint, exc)

    async def client(self) -> aetcd.Client:
        """The current client, connected (for a watch, whose stream the caller keeps)."""
        client = self._open()
        try:
            await client.connect()
        except Exception as exc:
            error = translate(exc, self.endpoints, self.auth)
            if isinstance(error, Unauthenticated):  # refused credentials: the next call connects (and reads) again
                await self.reset(next_endpoint=False)
            raise error from None
        return client

    async def call(self, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """Run `op` on a member: the current one, then each other once while they are unreachable.

        Raises:
            Unavailable: no endpoint answered (the message names them all).
            KVStoreError: etcd answered with an error (`translate`).
        """
        try:
            return await self._call(op)
        except _StaleToken:  # etcd forgot the token (expired while idle, or etcd restarted): authenticate again
            await self.reset(next_endpoint=False)
            try:
                return await self._call(op)
            except _StaleToken as exc:
                raise translate(exc.error, self.endpoints, self.auth) from None

    async def _call(self, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        last: BaseException | None = None
        for _ in self.endpoints:
            client = self._open()
            try:
                return await op(client)
            except UNREACHABLE as exc:
                last = exc
                log.debug("etcd member %s unreachable (%s); trying the next", self.endpoint, exc)
                await self.reset()
            except aetcd.ClientError as exc:
                if self.auth is not None and any(stale in str(exc) for stale in _STALE_TOKENS):
                    raise _StaleToken(exc) from None
                error = translate(exc, self.endpoints, self.auth)
                if isinstance(error, Unauthenticated):  # refused credentials: the next call connects (and reads) again
                    await self.reset(next_endpoint=False)
                raise error from None
        assert last is not None
        raise translate(last, self.endpoints, self.auth) from None

    async def close(self) -> None:
        """Close the client; the session may be used again (it opens a new one)."""
        await self.reset(next_endpoint=False)


async def stop_task(task: asyncio.Task[Any], *, again_s: float = 1.0) -> None:
    """Cancel `task` and wait for it to end, cancelling it again every `again_s` while it runs: a cancel can be
    lost inside aetcd's watch creation (its `asyncio.wait_for` on Python 3.11 returns the watch when the reply
    lands as the cancel does, gh-86296), and the task then follows its watch for good, so a single cancel and
    an `await` could wait forever (a node whose start failed just after joining never exited)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=again_s)
    if not task.cancelled() and (failed := task.exception()) is not None:
        log.debug("a stopped etcd task had failed: %s", failed)


async def follow_prefix(session: EtcdSession, prefix: bytes, revision: int, *,
                        apply: Callable[[aetcd.Event], Awaitable[None]],
                        lost: Callable[[Exception], Awaitable[None]],
                        reload: Callable[[], Awaitable[int]], retry_s: float) -> None:
    """Follow the watch of `prefix` from `revision + 1` until cancelled, across etcd's outages.

    Each event goes to `apply`. On any failure (etcd away, the stream broken, history compacted) `lost`
    is told once, the session moves to the next endpoint, and every `retry_s` `reload` is tried (it lists
    the prefix again and returns the revision listed); once it answers, the watch resumes from there.
    The fleet's view of the nodes and its shared tables both follow etcd this way.
    """
    while True:
        try:
            client = await session.client()
            watch = await client.watch_prefix(prefix, start_revision=revision + 1)
            async for event in watch:
                revision = event.kv.mod_revision
                await apply(event)
            raise aetcd.ConnectionFailedError("the watch stream ended")
        except Exception as exc:  # etcd away, the stream broken, history compacted: reload when it answers
            await lost(exc)
            await session.reset()
        while True:
            await asyncio.sleep(retry_s)  # the retry period while etcd is away
            try:
                revision = await reload()
                break
            except KVStoreError:
                await session.reset()
