"""Where a prefix lives, as a router needs it: the path and time a worker on each host would take.

A Lookup asked with hosts (`kvstore.prefix_hosts`) names the nodes holding the found prefix on
their hosts. For each such host this module says which path a worker there would restore by and
what its plan would cost, with the planner's own cost model and decision (`Planner.decide`), so a
router can send the request to the worker beside the data (docs/PLANNER.md, "Where a prefix lives"):

- "direct-gpu": the worker's GPU reads the blocks straight from the node's store file
  (`ColocatedReader`, docs/DIRECT_RESTORE.md): a host with a colocated node, when its workers have
  the reader configured (`PathRates.direct`; the direct paths are opt-in, docs/SECURITY.md);
- "shm": the server copies into a shared region (a single server's host, no reader);
- "network": the blocks stream over gRPC: any host that holds none of them, and a fleet node's
  host without a reader (a fleet restores each run from its replica over gRPC, F47).

A fleet's prefix lies in runs on several nodes: a worker on a node's host reads that node's runs
by the local path (with a reader: one node's, as `restore` does, F48) and the rest over the network.
Its fetch rate is then the blend of the two over the share of the found prefix it holds, and the
plan for that host is decided again at that rate: far from the data a recompute may win.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.errors import InvalidArgument
from kvstore.prefix_hosts import PrefixHost
from replay.cost import DEFAULT_FETCH_GBPS, CostModel

if TYPE_CHECKING:
    from kvstore.client import LookupResult


class Planner(Protocol):
    """What a host's plan needs of the planner (`replay.planner.Planner.decide`: pure, no calls)."""

    def decide(self, n: int, found: LookupResult, cost: CostModel) -> Any: ...


DIRECT_GPU, SHM, NETWORK = "direct-gpu", "shm", "network"
#: The hosts entry for a worker on a host that holds none of the prefix.
OTHER_HOSTS = "*"
#: GB/s of a direct GPU restore: 890 MB (1M tokens) in 24.0 ms on the H200, the Lookup, records,
#: copy and checksums included (docs/DIRECT_RESTORE.md, "Measured").
DEFAULT_DIRECT_GPU_GBPS = 37.0
#: GB/s of blocks streamed over gRPC (`Get`): 0.48-0.58 GB/s on the H200 host's loopback
#: (docs/BENCHMARKS.md, session 21); across hosts give your network's figure.
DEFAULT_NETWORK_GBPS = 0.5


def _rate(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class PathRates:
    """Fetch rates of the restore paths, GB/s, and whether workers beside a node read its file.

    Attributes:
        direct_gpu_gbps: a worker's GPU reading a colocated store's file.
        shm_gbps: the server's copy into a shared region (the planner's `fetch_gbps` by default).
        network_gbps: blocks streamed over gRPC from another host.
        direct: workers on a colocated node's host have a `ColocatedReader` and a GPU (False: they
            use shared memory beside a single server, gRPC beside a fleet node).
    """

    direct_gpu_gbps: float = DEFAULT_DIRECT_GPU_GBPS
    shm_gbps: float = DEFAULT_FETCH_GBPS
    network_gbps: float = DEFAULT_NETWORK_GBPS
    direct: bool = True

    def __post_init__(self) -> None:
        _rate(self.direct_gpu_gbps, "direct_gpu_gbps")
        _rate(self.shm_gbps, "shm_gbps")
        _rate(self.network_gbps, "network_gbps")
        if not isinstance(self.direct, bool):
            raise InvalidArgument(f"direct must be True or False, got {self.direct!r}")


@dataclass(frozen=True, kw_only=True)
class HostPlan:
    """What a worker on one host would do for a prompt, and what it would cost.

    Attributes:
        host: the machine's name (`OTHER_HOSTS` for any host holding none of the prefix).
        host_id: its kernel boot id ('' when unknown, or for `OTHER_HOSTS`).
        nodes: the nodes there holding blocks of the found prefix.
        data_dir: the store a `ColocatedReader` there opens (the direct path), else ''.
        path: the path its local blocks come by ("direct-gpu", "shm" or "network").
        local_blocks: found blocks read by that path; `remote_blocks` come over the network.
        fetch_gbps: the blended rate of the two.
        action: the plan's action at that rate (it may differ from host to host).
        fetch_tokens: the tokens that plan fetches.
        estimated_s: that plan's estimate.
    """

    host: str
    host_id: str
    nodes: tuple[str, ...]
    data_dir: str
    path: str
    local_blocks: int
    remote_blocks: int
    fetch_gbps: float
    action: str
    fetch_tokens: int
    estimated_s: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"host": self.host, "host_id": self.host_id, "nodes": list(self.nodes), "data_dir": self.data_dir,
                "path": self.path, "local_blocks": self.local_blocks, "remote_blocks": self.remote_blocks,
                "fetch_gbps": self.fetch_gbps, "action": self.action, "fetch_tokens": self.fetch_tokens,
                "estimated_s": self.estimated_s}

    def line(self) -> str:
        """One line for `kvstore plan --hosts`."""
        where = "any other host" if self.host == OTHER_HOSTS else f"{self.host} (nodes {', '.join(self.nodes)})"
        return (f"{where}: {self.path}, {self.local_blocks:,} found blocks local + {self.remote_blocks:,} over the "
                f"network ({self.fetch_gbps:g} GB/s): {self.action}, fetch {self.fetch_tokens:,} tokens, "
                f"estimated {self.estimated_s * 1e3:,.3f} ms")


def is_fleet(client: Any) -> bool:
    """Whether `client` stores through a fleet: a fleet client, or a client of a gateway (it places runs)."""
    return bool(getattr(client, "run_blocks", 0) or getattr(getattr(client, "connection", None), "run_blocks", 0))


def _group(hosts: Sequence[PrefixHost]) -> dict[str, list[PrefixHost]]:
    """The nodes by machine (its boot id, else its name): nodes on one host share it."""
    out: dict[str, list[PrefixHost]] = {}
    for h in hosts:
        out.setdefault(h.host_id or h.host, []).append(h)
    return out


def _blend(local: int, remote: int, local_gbps: float, network_gbps: float) -> float:
    """The rate of fetching `local` blocks at one rate and `remote` at the other (bytes in proportion)."""
    total = local + remote
    if total == 0:
        return local_gbps
    return total / (local / local_gbps + remote / network_gbps)


def host_plans(planner: Planner, prompt_tokens: int, found: LookupResult, cost: CostModel, rates: PathRates, *,
               fleet: bool) -> list[HostPlan]:
    """One `HostPlan` per host holding blocks of the found prefix, cheapest first, then one for any other host.

    Args:
        planner: decides each host's plan (`Planner.decide`, pure: no calls).
        prompt_tokens: the prompt's length.
        found: the Lookup asked with hosts.
        cost: the tenant's cost model; each host's plan replaces its `fetch_gbps` with the host's rate.
        rates: the paths' rates.
        fleet: the store is a fleet (no "shm" path: a fleet maps no one node's store for a client, F47).
    """
    found_blocks = found.found_blocks
    plans = []
    for members in _group(found.hosts).values():
        readable = [h for h in members if h.colocated] if rates.direct else []
        if readable:  # one reader, of the node there holding the most (restore's F48)
            best = max(readable, key=lambda h: h.blocks)
            path, local_gbps, local = DIRECT_GPU, rates.direct_gpu_gbps, best.blocks_below(found_blocks)
            data_dir = best.data_dir
        elif not fleet:
            path, local_gbps, local, data_dir = SHM, rates.shm_gbps, members[0].blocks_below(found_blocks), ""
        else:  # a fleet's runs over gRPC from the replica there (loopback): the network's rate, nearby
            path, local_gbps, data_dir = NETWORK, rates.network_gbps, ""
            local = _union_below(members, found_blocks)
        gbps = _blend(local, found_blocks - local, local_gbps, rates.network_gbps)
        plans.append(_plan_at(planner, prompt_tokens, found, cost, gbps, host=members[0].host,
                              host_id=members[0].host_id, nodes=tuple(h.node_id for h in members),
                              data_dir=data_dir, path=path, local=local, remote=found_blocks - local))
    plans.sort(key=lambda p: (p.estimated_s, p.host))
    plans.append(_plan_at(planner, prompt_tokens, found, cost, rates.network_gbps, host=OTHER_HOSTS, host_id="",
                          nodes=(), data_dir="", path=NETWORK, local=0, remote=found_blocks))
    return plans


def _union_below(members: Sequence[PrefixHost], end_block: int) -> int:
    """Blocks below `end_block` that some node of `members` holds."""
    held: set[int] = set()
    for h in members:
        for first, end in h.block_ranges:
            held.update(range(first, min(end, end_block)))
    return len(held)


def _plan_at(planner: Planner, prompt_tokens: int, found: LookupResult, cost: CostModel, gbps: float, *, host: str,
             host_id: str, nodes: tuple[str, ...], data_dir: str, path: str, local: int, remote: int) -> HostPlan:
    """The planner's decision for one host, its fetches at `gbps`."""
    decided = planner.decide(prompt_tokens, found, replace(cost, fetch_gbps=gbps))
    return HostPlan(host=host, host_id=host_id, nodes=nodes, data_dir=data_dir, path=path, local_blocks=local,
                    remote_blocks=remote, fetch_gbps=round(gbps, 6), action=decided.action.value,
                    fetch_tokens=decided.fetch_tokens, estimated_s=decided.estimated_s)


def choose(hosts: Sequence[HostPlan], worker_hosts: Iterable[str]) -> HostPlan | None:
    """The cheapest host plan a router can serve: the first of `hosts` (cheapest first, as `Plan.hosts`
    lists them) whose boot id or name is among `worker_hosts` (the hosts with a free worker), else the
    entry for any other host; None when `hosts` is empty (the plan was made without hosts)."""
    free = set(worker_hosts)
    for plan in hosts:
        if plan.host != OTHER_HOSTS and (plan.host_id in free or plan.host in free):
            return plan
    return next((p for p in hosts if p.host == OTHER_HOSTS), None)
