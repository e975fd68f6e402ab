"""The worker's connections to its kvstore server, one `Client` per tenant, opened on first use."""

from __future__ import annotations

import threading
from typing import Any

from kvstore.client import Client

#: Tenants whose connections stay open; the least recently used beyond them is closed.
MAX_OPEN_TENANTS = 64


class StoreClients:
    """Clients of one kvstore server for one geometry, keyed by namespace.

    Args:
        target: the server's "host:port".
        geometry: the model's geometry name (the server must serve it).
        timeout_s: deadline of each store call.
        token: the worker's API token (`kvstore tenant create`) on a server with auth: a
            tenant's token confines the worker to that tenant; an admin's lets Runs name any.
        tls: TLS options (kvstore.client.connection.TlsOptions) when the server speaks TLS.

    Raises:
        KVStoreError: the first connection (made here, for the default tenant)
            failed: the server is down, or does not serve `geometry`.
    """

    def __init__(self, target: str, *, geometry: str, timeout_s: float = 60.0, token: str | None = None,
                 tls: Any = None) -> None:
        self.target = target
        self.geometry = geometry
        self.timeout_s = timeout_s
        self._credentials: dict[str, Any] = {"token": token, "tls": tls}
        self._lock = threading.Lock()
        self._clients: dict[str, Client] = {}
        first = self.client("")
        #: Tokens per block of the server (the same for every tenant).
        self.block_tokens: int = first.block_tokens

    def client(self, namespace: str) -> Client:
        """The client of `namespace` (empty: the token's tenant, "default" without auth), connected on first use."""
        with self._lock:
            found = self._clients.pop(namespace, None)
            if found is None:
                found = Client(self.target, namespace=namespace, geometry=self.geometry, timeout_s=self.timeout_s,
                               **self._credentials)
                if len(self._clients) >= MAX_OPEN_TENANTS:
                    oldest = next(iter(self._clients))
                    self._clients.pop(oldest).close()
            self._clients[namespace] = found  # last: the most recently used
            return found

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
