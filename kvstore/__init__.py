"""kvstore: KV-cache storage and transfer for long-context LLM serving.

`kvstore.Client` is imported lazily so that `import kvstore.geometry` (or the
codec) does not pull in gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvstore.client import Client

__all__ = ["Client", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from kvstore.client import Client

        return Client
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
