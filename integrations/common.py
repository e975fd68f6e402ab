"""What the engine adapters share: settings, the store's client, the usable-token rule, page mapping.

Public, stable for the other adapters (the SGLang backend may import these, read-only):

- `StoreSettings` / `parse_settings(extra, known=...)`: the adapter's extra config
  (target, token, namespace, geometry, timeout_s, path, data_dir, lease_ms, replay_windows, replay_fidelity,
  fidelity_refresh_s)
  checked, every mistake a `kvstore.errors.ConfigError` naming the setting.
- `connect(settings) -> kvstore.Client` (a fleet client for an etcd:// target; a gateway's target refuses the
  paths that read or map a node's store, F60); `through_gateway(client)`.
- `usable_tokens(plan) -> int`: tokens an engine that recomputes a replay itself may take from the
  store (a snapshot resume: R; a bounded/exact replay: the hit minus the replay span; else 0).
- `PageMap`: where the rows of token positions lie in an engine's paged cache
  (pages of `page_tokens` tokens, one row per `ratio` tokens; rows interleaved, or block-split:
  a page's data parts, then its scale parts, `SplitRows`).
- `connect_layout(settings, records, engine) -> kvstore.Client`: the client of the served geometry
  of the configured model in the engine's record layout (kvstore.layout), said in the log.
- `fetch_blocks(client, hashes, settings, reader=None) -> (uint8 [n, block_bytes], usable_blocks, path)`:
  the blocks by the configured path (`kvstore.client.restore` when present; Get otherwise).

Nothing here imports an engine.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore import geometry as geometries
from kvstore.client import Client
from kvstore.errors import ConfigError, KVStoreError
from kvstore.layout import RecordLayout
from replay.plan import Action, Plan

log = logging.getLogger(__name__)

#: Load paths a setting may name ("auto": the fastest available; see kvstore.client.restore).
PATHS = ("auto", "direct-cpu", "direct-gpu", "shm", "grpc")
#: The settings every adapter reads.
COMMON_KEYS = frozenset({"target", "token", "namespace", "geometry", "timeout_s", "path", "data_dir", "lease_ms",
                         "replay_windows", "replay_fidelity", "fidelity_refresh_s"})


@dataclass(frozen=True, kw_only=True)
class StoreSettings:
    """An adapter's checked settings.

    Attributes:
        target: the kvstore server, "host:port".
        token: the tenant's API token (default `$KVSTORE_TOKEN`; None without auth).
        namespace: the tenant ('' = the token's).
        geometry: the store geometry ('' = the server's default).
        timeout_s: deadline of each store call.
        path: how blocks are loaded: one of `PATHS`.
        data_dir: the store's data dir on this host: enables the direct paths (trust model,
            docs/SECURITY.md); None: off.
        lease_ms: how long the planner's Lookup holds the found blocks for the load.
        replay_windows: windows replayed after a hit without a snapshot (replay.cost.CostModel.replay_windows),
            None for exact replays only: the engine's own setting when `fidelity` is set from it, else 1, the
            cost model's span before the tenant's setting is resolved.
        fidelity: this engine's fidelity setting ("windows:N", "exact" or an error budget, replay/fidelity_budget.py),
            from `replay_windows` or `replay_fidelity`; None (neither given): the tenant's stored policy
            (replay_fidelity, read from the server at attach and every `fidelity_refresh_s`).
        fidelity_refresh_s: the longest the tenant's stored setting is used before it is read again.
    """

    target: str
    token: str | None = None
    namespace: str = ""
    geometry: str = ""
    timeout_s: float = 30.0
    path: str = "auto"
    data_dir: str | None = None
    lease_ms: int = 30_000
    replay_windows: int | None = 1
    fidelity: str | None = None
    fidelity_refresh_s: float = 60.0


def _number(extra: Mapping[str, Any], name: str, default: Any, *, least: float, integer: bool = False) -> Any:
    value = extra.get(name, default)
    ok = not isinstance(value, bool) and isinstance(value, int if integer else int | float) and value >= least
    if not ok:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"kv_connector_extra_config {name!r} must be {kind} >= {least}, got {value!r}")
    return value


def parse_settings(extra: Mapping[str, Any] | None, *, known: frozenset[str] = COMMON_KEYS) -> StoreSettings:
    """The extra config, checked; `known` names every setting the adapter accepts (a typo is refused).

    Raises:
        ConfigError: no target, an unknown setting, a value of the wrong type or range.
    """
    if extra is None or not isinstance(extra, Mapping):
        raise ConfigError("kvstore needs kv_connector_extra_config with at least {\"target\": \"host:port\"}, "
                          f"got {extra!r}")
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(f"unknown kvstore settings {unknown}; known: {sorted(known)}")
    target = extra.get("target")
    if not isinstance(target, str) or ":" not in target:
        raise ConfigError(f"kv_connector_extra_config 'target' must be the kvstore server as 'host:port', "
                          f"got {target!r}")
    text: dict[str, str] = {}
    for name in ("token", "namespace", "geometry"):
        value = extra.get(name, "")
        if not isinstance(value, str):
            raise ConfigError(f"kv_connector_extra_config {name!r} must be a string, got {type(value).__name__}")
        text[name] = value
    path = extra.get("path", "auto")
    if path not in PATHS:
        raise ConfigError(f"kv_connector_extra_config 'path' must be one of {list(PATHS)}, got {path!r}")
    data_dir = extra.get("data_dir")
    if data_dir is not None and (not isinstance(data_dir, str) or not os.path.isdir(data_dir)):
        raise ConfigError(f"kv_connector_extra_config 'data_dir' must be the store's data dir on this host, "
                          f"got {data_dir!r} (not a folder)")
    if path.startswith("direct") and data_dir is None:
        raise ConfigError(f"path {path!r} reads the store's file directly: set 'data_dir' (docs/SECURITY.md)")
    windows = extra.get("replay_windows", 1)
    if windows == "exact":
        windows = None
    elif windows is not None:
        windows = _number(extra, "replay_windows", 1, least=1, integer=True)
    fidelity = _fidelity(extra, windows)
    return StoreSettings(target=target, token=text["token"] or os.environ.get("KVSTORE_TOKEN") or None,
                         namespace=text["namespace"], geometry=text["geometry"],
                         timeout_s=float(_number(extra, "timeout_s", 30.0, least=0.001)), path=path,
                         data_dir=data_dir, lease_ms=_number(extra, "lease_ms", 30_000, least=0, integer=True),
                         replay_windows=windows, fidelity=fidelity,
                         fidelity_refresh_s=float(_number(extra, "fidelity_refresh_s", 60.0, least=0)))


def _fidelity(extra: Mapping[str, Any], windows: int | None) -> str | None:
    """The engine's own fidelity setting: `replay_windows` (as "windows:N" or "exact") or `replay_fidelity`
    (any setting, checked), never both; None when neither is given (the tenant's stored policy applies)."""
    has_windows, has_budget = "replay_windows" in extra, "replay_fidelity" in extra
    if has_windows and has_budget:
        raise ConfigError("kv_connector_extra_config sets both 'replay_windows' and 'replay_fidelity': give one "
                          "(or neither: the tenant's stored replay_fidelity policy applies)")
    if has_windows:
        return "exact" if windows is None else f"windows:{windows}"
    if not has_budget:
        return None
    from replay.fidelity_budget import parse_budget

    text = extra["replay_fidelity"]
    try:
        return parse_budget(text).text
    except KVStoreError as exc:
        raise ConfigError(f"kv_connector_extra_config 'replay_fidelity': {exc}") from None


#: Load paths that read or map one node's own store: a gateway holds none (docs/FLEET.md F40, F60).
NODE_PATHS = ("shm", "direct-cpu", "direct-gpu")


def through_gateway(client: Any) -> bool:
    """Whether `client` is a plain client of a fleet's gateway: GetInfo's `run_blocks` is the fleet's there and 0
    on a node (F36); a fleet client has no one connection (it routes itself)."""
    connection = getattr(client, "connection", None)
    return connection is not None and bool(getattr(connection, "run_blocks", 0))


def connect(settings: StoreSettings) -> Client:
    """A client of the configured store (raises the store's typed errors: Unavailable, ...).

    Raises:
        ConfigError: `settings.path` maps or reads a node's store and the target is a fleet's gateway (F60).
    """
    client = Client(settings.target, namespace=settings.namespace, geometry=settings.geometry,
                    timeout_s=settings.timeout_s, token=settings.token)
    if settings.path in NODE_PATHS and through_gateway(client):
        client.close()
        raise ConfigError(f"path {settings.path!r} maps or reads a storage node's own store, and {settings.target} "
                          "is a fleet's gateway, which holds none: target the fleet itself, "
                          "'etcd://HOST:PORT[,HOST:PORT...]/CLUSTER' (with this host's node's data_dir for the "
                          "direct paths), or keep the gateway with path 'auto' or 'grpc' (docs/FLEET.md F60)")
    return client


def connect_layout(settings: StoreSettings, records: RecordLayout, engine: str) -> Client:
    """A client of the configured model geometry in the engine's record layout, said in the log.

    `settings.geometry` names the model ('' = the server's default) or already its geometry in
    `records` (`<model>+<layout>`); the client then works under that layout's fingerprint, so
    its blocks and snapshots are found only by clients of the same layout (kvstore.layout).

    Raises:
        ConfigError: `settings.geometry` names another layout than the engine writes, or the server
            does not serve the model in this layout.
        KVStoreError: the store cannot be reached (Unavailable, Unauthenticated, ...).
    """
    client = connect(settings)
    try:
        served = geometries.resolve(client.geometry)
    except KVStoreError:
        client.close()
        raise
    if served.records != records:
        if not served.records.native:
            client.close()
            raise ConfigError(f"geometry {served.name!r} holds {served.records.name} rows, but {engine} writes "
                              f"{records.name} rows ({records.setting or 'the model rows'}): name the model "
                              "geometry and the adapter picks the layout")
        name = served.with_records(records).name
        client.close()
        try:
            client = connect(dataclasses.replace(settings, geometry=name))
        except KVStoreError as exc:
            raise ConfigError(f"the kvstore server does not serve {name!r} ({exc}): {engine}'s {records.setting} "
                              "rows need a kvstore server that knows the engine layouts (kvstore.layout)") from exc
    g = geometries.resolve(client.geometry)
    log.info("kvstore: %s keeps %s rows (%s, %s): blocks of %d B per %d tokens under geometry %s "
             "(fingerprint %s)", engine, g.records.name, g.records.setting or "the model's own rows",
             g.records.arch, client.block_bytes, client.block_tokens, g.name, g.fingerprint.hex())
    return client


def usable_tokens(plan: Plan) -> int:
    """Tokens an engine may load from the store for `plan` and then compute the rest itself.

    A snapshot resume: R (the engine loads the blocks and the window). A bounded or exact
    replay: the hit minus the replay span, `replay_start` (the engine's own prefill then
    recomputes the span with an empty window below it, which is the replay). A full prefill: 0.
    """
    if plan.action is Action.FETCH_SNAPSHOT:
        return plan.resume_tokens
    if plan.action in (Action.BOUNDED_REPLAY, Action.EXACT_REPLAY) and plan.replay_start is not None:
        return max(plan.replay_start, 0)
    return 0


class SplitRows:
    """A block-split page cache seen as rows: `[pages, rows, row_bytes]` through two views of its memory,
    the data parts `[pages, rows, data]` (a page's first `rows x data` bytes) and the scale parts
    `[pages, rows, row_bytes - data]` (right after them), as FlashMLA's V4 record and vLLM's indexer pages
    keep them. Indexing by (page, slot) tensors gathers whole rows (a copy); assigning scatters them."""

    def __init__(self, data: torch.Tensor, scales: torch.Tensor) -> None:
        self.data, self.scales = data, scales
        self.split = data.shape[-1]

    @property
    def device(self) -> torch.device:
        """The cache's device."""
        return self.data.device

    @property
    def shape(self) -> tuple[int, int, int]:
        """(pages, rows per page, row bytes)."""
        return self.data.shape[0], self.data.shape[1], self.split + self.scales.shape[-1]

    def __getitem__(self, index: Any) -> torch.Tensor:
        return torch.cat([self.data[index], self.scales[index]], dim=-1)

    def __setitem__(self, index: Any, rows: torch.Tensor | int) -> None:
        if isinstance(rows, int):  # one byte value for every byte, as a tensor view takes it
            self.data[index], self.scales[index] = rows, rows
            return
        self.data[index] = rows[..., :self.split]
        self.scales[index] = rows[..., self.split:]


#: What `PageMap.view` gives: the rows of a page cache, as a tensor view or through `SplitRows`.
RowsView = torch.Tensor | SplitRows


@dataclass(frozen=True)
class PageMap:
    """Where a source layer's rows lie in an engine's paged cache.

    The cache is `[num_pages, page_bytes]` (any trailing padding ignored); a page holds
    `page_tokens // ratio` rows of `row_bytes` in position order: the row of positions
    [j*ratio, (j+1)*ratio) is row `j % rows_per_page` of page `page_ids[j // rows_per_page]`.
    Interleaved (`data_bytes` 0, the FlashMLA V4.1 layout, docs/CODEC.md), a page is its rows
    one after the other; block-split (`data_bytes` > 0: FlashMLA's V4 record, vLLM's indexer), it
    is every row's first `data_bytes`, then every row's remaining (scale) bytes.
    """

    page_tokens: int
    ratio: int
    row_bytes: int
    data_bytes: int = 0

    @property
    def rows_per_page(self) -> int:
        """Rows of this kind in one page."""
        return self.page_tokens // self.ratio

    def view(self, cache: torch.Tensor) -> RowsView:
        """The cache as uint8 [num_pages, rows_per_page, row_bytes], a view of its memory (padding left
        out; `SplitRows` over two views when block-split).
        Pages may be strided (vLLM puts the pages of one group's layers in one physical block);
        each page's bytes must be contiguous.

        Raises:
            ConfigError: a page is not contiguous bytes (a copy would lose every write).
        """
        try:
            raw = cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)
        except RuntimeError as exc:
            raise ConfigError(f"a vLLM cache cannot be read as bytes in place ({exc}) (docs/ENGINES.md)") from exc
        if raw.dim() < 2:
            raise ConfigError(f"a vLLM cache of shape {tuple(cache.shape)} has no page dimension (docs/ENGINES.md)")
        pages = raw.flatten(1)
        if pages.data_ptr() != raw.data_ptr() or pages.stride(-1) != 1 or (
                pages.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr()):
            raise ConfigError("a vLLM cache page is not one contiguous run of bytes: the layout is not the one "
                              "assumed (docs/ENGINES.md)")
        need = self.rows_per_page * self.row_bytes
        if pages.shape[1] < need:
            raise ConfigError(f"a cache page holds {pages.shape[1]} bytes, fewer than {self.rows_per_page} rows "
                              f"of {self.row_bytes} B: the engine's layout is not the one assumed (docs/ENGINES.md)")
        n, d = self.rows_per_page, self.data_bytes
        if d:
            return SplitRows(pages[:, :n * d].view(cache.shape[0], n, d),
                             pages[:, n * d:need].view(cache.shape[0], n, self.row_bytes - d))
        return pages[:, :need].view(cache.shape[0], n, self.row_bytes)

    def slots(self, page_ids: Sequence[int], first_row: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, row-in-page) index tensors of rows [first_row, first_row + rows)."""
        j = torch.arange(first_row, first_row + rows, dtype=torch.long)
        table = torch.as_tensor(list(page_ids), dtype=torch.long)
        return table[j // self.rows_per_page], j % self.rows_per_page


def fetch_blocks(client: Client, hashes: Sequence[bytes], settings: StoreSettings,
                 reader: Any = None, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int, str]:
    """The blocks of `hashes` into a new uint8 tensor [n, block_bytes].

    Returns (blocks, usable leading blocks, path used). Uses `kvstore.client.restore`
    (direct, shm or gRPC by `settings.path`); where that module is absent, a plain Get.
    The tensor is on `device` when the GPU can read the store's file directly (a CUDA
    `device`, a reader, path "auto" or "direct-gpu"), on the CPU otherwise.
    """
    on_gpu = (torch.device(device).type == "cuda" and reader is not None
              and settings.path in ("auto", "direct-gpu"))
    dest = torch.empty((len(hashes), client.block_bytes), dtype=torch.uint8, device=device if on_gpu else "cpu")
    if not hashes:
        return dest, 0, "none"
    try:
        from kvstore.client.restore import restore
    except ImportError:  # an older kvstore: the Get path
        got = client.get_hashes(list(hashes))
        n = got.found_prefix_blocks
        for i in range(n):
            block = got.blocks[i]
            assert block is not None
            dest[i] = torch.frombuffer(bytearray(block), dtype=torch.uint8)
        return dest, n, "grpc"
    # F60: through a gateway "auto" streams: it holds no store to map, and refuses the transfer session shm opens (F40).
    path = "grpc" if settings.path == "auto" and through_gateway(client) else settings.path
    result = restore(client, list(hashes), dest, path=path, reader=reader)
    return dest, result.blocks, result.path
