"""One connection to a kvstore server: what the store, SWA and transfer clients share.

A `Connection` owns the gRPC channel and the call plumbing, written once here:
each call's deadline, and every gRPC failure turned into a `kvstore.errors`
class (never a raw `grpc.RpcError`). It also keeps what the server said at
connect time for one tenant and one geometry: the block size, the chain root
and the server's limits. Each client takes a Connection (as redis-py's command
classes share one connection pool); none of them imports another.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvstore.client import arguments
from kvstore.client.chain_memo import DEFAULT_MAX_BYTES, ChainMemo
from kvstore.client.fleet_chain import FleetChainMemo
from kvstore.client.lookup_anchors import AnchorTable
from kvstore.errors import InvalidArgument, KVStoreError, from_status
from kvstore.prefix import ExtraKey, chain_hashes, root_hash
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

#: The tenant of every call on a server without auth (gateway.auth.DEFAULT_TENANT, which the client does not
#: import): what an empty namespace means there.
DEFAULT_TENANT = "default"
#: Room left in a message for everything that is not block or snapshot bytes.
ENVELOPE_BYTES = 1 << 20


def status_error(exc: grpc.RpcError) -> KVStoreError:
    """The `kvstore.errors` class of a failed call's status (raise it `from None`)."""
    return from_status(exc.code(), exc.details())


@dataclass(frozen=True, kw_only=True)
class TlsOptions:
    """How a client speaks TLS to the server (PEM files; docs/SECURITY.md).

    Attributes:
        ca_file: CA certificates the server's certificate must chain to ('' : the system's roots).
        cert_file: this client's certificate chain, for a server demanding mutual TLS.
        key_file: this client's private key (with `cert_file`).
        server_name: the name to check the server's certificate against, when the
            target's host is not in it (an IP address, a load balancer).
    """

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials these files make.

        Raises:
            InvalidArgument: a file cannot be read, or only one of cert_file and key_file is set.
        """
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgument("tls: cert_file and key_file go together (mutual TLS): set both or neither")

        def read(name: str, path: str) -> bytes | None:
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise InvalidArgument(f"tls.{name} {path}: {exc.strerror or exc}",
                                      hint="name a readable PEM file") from None

        return grpc.ssl_channel_credentials(read("ca_file", self.ca_file), read("key_file", self.key_file),
                                            read("cert_file", self.cert_file))


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata that carries `token` (`authorization: Bearer`), or None without one.

    Raises:
        InvalidArgument: not the printable ASCII string `kvstore tenant create` printed.
    """
    if token is None:
        return None
    token = arguments.text(token, "token")
    if not token or not token.isascii() or not token.isprintable() or token != token.strip():
        raise InvalidArgument("token must be the non-empty printable ASCII string `kvstore tenant create` printed")
    return (("authorization", f"Bearer {token}"),)


def open_channel(target: str, tls: TlsOptions | None,
                 options: Sequence[tuple[str, int | str]] = ()) -> grpc.Channel:
    """A channel to `target`: TLS with `tls`'s files (and its server name, when set), else plaintext."""
    options = list(options)
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(target, tls.credentials(), options=options)


class Connection:
    """A channel to a kvstore server for one tenant and one geometry.

    Args:
        target: "host:port" of the server (or the gateway).
        namespace: the tenant; blocks of two tenants never mix.
        geometry: profile name; '' means the server's default.
        timeout_s: deadline of each call.
        token: the API token (`kvstore tenant create`), sent as `authorization: Bearer`
            metadata on every call; None for a server without auth.
        tls: speak TLS (None: plaintext).
        chain_memo_bytes: most bytes the memo of hashed chains keeps (`chain_memo`; about 4.5
            bytes per token), so a conversation's next turn hashes only its new tokens; 0: none.

    Raises:
        InvalidArgument: a bad argument, or a geometry the server does not serve.
        Unauthenticated: the server wants a token and this one is missing, unknown or revoked.
        KVStoreError: the server could not be asked (the class of its status).
    """

    def __init__(self, target: str, *, namespace: str = "", geometry: str = "",
                 timeout_s: float = 120.0, token: str | None = None, tls: TlsOptions | None = None,
                 chain_memo_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.target = arguments.text(target, "target")
        chain_memo_bytes = arguments.integer(chain_memo_bytes, "chain_memo_bytes")
        #: The tenant asked for: '' is the token's own (the only one a non-admin token may name).
        self.namespace = arguments.text(namespace, "namespace")
        self.timeout_s = arguments.seconds(timeout_s, "timeout_s")
        geometry = arguments.text(geometry, "geometry")
        #: Sent with every call (None: no token).
        self.metadata = token_metadata(token)
        self.channel = open_channel(target, tls, [("grpc.max_receive_message_length", -1),
                                                  ("grpc.max_send_message_length", -1)])
        #: The KVStore service's stub (GetInfo here; blocks in the store and transfer clients).
        self.kvstore = pb_grpc.KVStoreStub(self.channel)
        try:
            info = self.call(self.kvstore.GetInfo, pb.GetInfoRequest())
        except KVStoreError:
            self.close()
            raise
        served = {g.name: g for g in info.geometries}
        chosen = served.get(geometry) if geometry else info.geometries[0]
        if chosen is None:
            self.close()
            raise InvalidArgument(f"server does not serve geometry {geometry!r}; it serves {sorted(served)}")
        self.geometry: str = chosen.name
        self.fingerprint: bytes = chosen.fingerprint
        self.block_tokens: int = info.block_tokens
        self.block_bytes: int = chosen.block_bytes
        self.max_batch_blocks: int = info.max_batch_blocks
        self.max_message_bytes: int = info.max_message_bytes
        self.max_lease_ms: int = info.max_lease_ms
        self.root: bytes = root_hash(self.fingerprint, self.block_tokens)
        #: The tenant an empty namespace means for this caller (its token's; "default" without one); "" from
        #: a server that does not say.
        self.tenant: str = info.tenant
        #: Blocks per run when the server is a fleet's gateway (its clients hash as the fleet
        #: does: docs/FLEET.md F36); 0 for one node.
        self.run_blocks: int = info.run_blocks
        #: The server reads a Lookup's hashes as one packed field (one parse, not one per hash).
        self.lookup_packed_hashes: bool = info.lookup_packed_hashes
        #: The server reads a Lookup's anchor: a next turn names the chain found before (`anchors`).
        self.lookup_anchors: bool = info.lookup_anchors and info.lookup_packed_hashes
        self.anchors = AnchorTable()
        #: The chains hashed on this connection, reused by prompts that begin with their tokens.
        self.chain_memo = ChainMemo(block_tokens=self.block_tokens, max_bytes=chain_memo_bytes)
        #: Through a fleet's gateway, the fleet chains hashed here, run by run through the same memo (F56).
        self.fleet_chains = FleetChainMemo(block_tokens=self.block_tokens, run_blocks=self.run_blocks,
                                           max_bytes=chain_memo_bytes) if self.run_blocks else None

    # -- calls -------------------------------------------------------------

    def call(self, method: Any, request: Any) -> Any:
        """One unary call under the deadline, its failure raised as a KVStoreError."""
        try:
            return method(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise status_error(exc) from None

    def stream(self, method: Any, request: Any) -> Iterator[Any]:
        """The replies of a streaming call (`request` one message or an iterator of them)
        under the deadline, as they arrive; a failure is raised as a KVStoreError."""
        try:
            yield from method(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise status_error(exc) from None

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

    # -- what the server said ----------------------------------------------

    @property
    def batch_blocks(self) -> int:
        """Most blocks in one request: the server's batch limit, cut to fit its message limit."""
        by_bytes = max((self.max_message_bytes - ENVELOPE_BYTES) // self.block_bytes, 1)
        return min(self.max_batch_blocks, by_bytes)

    def hashes(self, tokens: Sequence[int], *, extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
        """Chain hashes of every full block of `tokens`, from the prompt start: one chain from the
        root for one node, the fleet's (each run a chain of its own, bridged: `fleet_chain`) through
        a gateway. A prompt that begins with the tokens of a chain hashed before on this connection
        hashes only its blocks after it (`chain_memo`: same hashes, checked byte for byte)."""
        chain = self.chain(tokens, extra_keys=extra_keys)
        return chain if isinstance(chain, list) else list(chain)

    def chain(self, tokens: Sequence[int], *, extra_keys: Sequence[ExtraKey] = ()) -> Sequence[bytes]:
        """`hashes`, as the memo keeps them where it holds the chain (`chain_memo.HashChain`: a next turn
        shares the kept hashes instead of copying them, C6), else a list."""
        extra_keys = arguments.extra_keys(extra_keys)
        if self.fleet_chains is not None:
            return self.fleet_chains.hashes(tokens, root=self.root, extra_keys=extra_keys)
        if self.chain_memo.max_bytes:
            return self.chain_memo.chain(tokens, root=self.root, extra_keys=extra_keys)
        return chain_hashes(tokens, block_tokens=self.block_tokens, parent=self.root, extra_keys=extra_keys)

    def run_fields(self, chain: Sequence[bytes], first_block: int) -> dict[str, Any]:
        """What a request from block `first_block` tells a gateway of its run (empty for one node):
        the index, and the run's key and bridge when the request does not start the run, or the key of the
        run before when it starts one past the first (a Put's, for the gateway's check of that run: F69).

        Args:
            chain: the fleet hashes from block 0, at least to `first_block`.
        """
        if not self.run_blocks:
            return {}
        start = first_block - first_block % self.run_blocks
        if start == first_block:
            return {"first_block": first_block, **({"parent_run_key": chain[start - self.run_blocks]} if start else {})}
        return {"first_block": first_block, "run_key": chain[start], "run_bridge": chain[start - 1] if start else b""}
