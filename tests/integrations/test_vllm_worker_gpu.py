"""The vLLM connector's worker side on CUDA paged caches, against a real `kvstore serve` child.

Marked gpu; skipped without CUDA. Needs no vLLM: `integrations.vllm_worker` imports none, and the
caches are laid out as vLLM lays a KV cache group out (one physical block per page index, each
layer's cache a strided view, padding after each page's rows), as tests/integrations/
test_vllm_support.py does on CPU. Checked: the direct-gpu load (`ColocatedReader` + the GPU
gatherer) fills the same bytes as a gRPC load, all at once and layer by layer (each layer read on
the current stream right after its wait), also over a fleet (docs/FLEET.md F61: the worker's client
of the `etcd://` address, the runs of this host's node gathered from its file by the GPU, the rest
streamed); a layer-wise save from CUDA caches (per-layer gathers and asynchronous copies to pinned
memory) stores the bytes of an all-at-once save from CPU caches.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import kvstore  # noqa: E402
from integrations.common import parse_settings  # noqa: E402
from integrations.vllm_caches import page_map  # noqa: E402
from integrations.vllm_scheduler import LoadSpec, SaveSpec  # noqa: E402
from integrations.vllm_worker import WorkerSide  # noqa: E402
from kvstore.geometry import TINY as GEO  # noqa: E402
from tests.children import Child  # noqa: E402
from tests.integrations.conftest import STORE_BLOCK_TOKENS  # noqa: E402
from tests.integrations.fleet_support import Fleet, fleet_fixture, spread_prompt  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

B = STORE_BLOCK_TOKENS
PAGE = 16
NUM_PAGES = 64
PAD = 8
SECTIONS = GEO.block_layout(B)
BLOCKS = 24


def _name(layer: int, component: str) -> str:
    return f"model.layers.{layer}.self_attn." + ("indexer.k_cache" if component == "indexer" else "kv_cache")


def _caches(device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One physical tensor holding every source layer's pages side by side, and each layer's strided view."""
    widths = {_name(s.layer, s.component): PAGE // GEO.compress_ratios[s.layer] * s.row_bytes + PAD for s in SECTIONS}
    physical = torch.zeros(NUM_PAGES, sum(widths.values()), dtype=torch.uint8, device=device)
    caches, offset = {}, 0
    for name, width in widths.items():
        caches[name] = physical[:, offset: offset + width]
        offset += width
    return physical, caches


def _worker(store: Child, caches: dict[str, torch.Tensor], *, path: str, layerwise: bool = False) -> WorkerSide:
    return _worker_of(store.target, store.data_dir, caches, path=path, layerwise=layerwise)  # type: ignore[attr-defined]


def _worker_of(target: str, data_dir: Any, caches: dict[str, torch.Tensor], *, path: str,
               layerwise: bool = False) -> WorkerSide:
    """The connector's worker side as vLLM's factory makes it: its client of `target` (a node or a fleet's
    etcd:// address) and, on a direct path, the reader of the node whose store is `data_dir`."""
    extra: dict[str, Any] = {"target": target, "geometry": GEO.name, "path": path, "timeout_s": 30.0}
    reader = None
    if path.startswith("direct"):
        from kvstore.client.colocated import ColocatedReader

        extra["data_dir"] = str(data_dir)
        reader = ColocatedReader(data_dir)
    settings = parse_settings(extra)
    client = kvstore.Client(target, geometry=GEO.name, timeout_s=30.0)
    worker = WorkerSide(client, settings, GEO, reader=reader, layerwise=layerwise)
    worker.register(caches, {name: (0, PAGE) for name in caches})
    return worker


def _close(worker: WorkerSide) -> None:
    worker.close()
    if worker.reader is not None:
        worker.reader.close()


def _rows(cache: torch.Tensor, s: Any, pages: list[int]) -> torch.Tensor:
    """A section's rows of `pages` in position order, from a cache (host copy)."""
    pm = page_map(GEO, s.component, PAGE, GEO.compress_ratios[s.layer])   # as the worker maps it (indexer split)
    page, slot = pm.slots(pages, 0, len(pages) * pm.rows_per_page)
    view = pm.view(cache)
    return view[page.to(view.device), slot.to(view.device)].cpu()


@pytest.fixture(scope="module")
def stored(start_store: Callable[[], Child]) -> Iterator[tuple[Child, list[int], torch.Tensor]]:
    store = start_store()
    rng = random.Random(61)
    tokens = [rng.randrange(1, 1 << 30) for _ in range(BLOCKS * B)]
    blocks = torch.randint(0, 256, (BLOCKS, GEO.block_bytes(B)), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(61))
    with kvstore.Client(store.target, geometry=GEO.name) as c:
        c.put(tokens, blocks)
    yield store, tokens, blocks


def _load_spec(store: Child, tokens: list[int], pages: list[int]) -> LoadSpec:
    with kvstore.Client(store.target, geometry=GEO.name) as c:
        hashes = list(c.hashes(tokens))
    return LoadSpec(req_id="r", hashes=hashes, start=0, end=len(tokens), block_ids=(pages,))


def test_a_direct_gpu_load_fills_cuda_pages_with_the_bytes_of_a_grpc_load(
        stored: tuple[Child, list[int], torch.Tensor]) -> None:
    store, tokens, blocks = stored
    pages = random.Random(5).sample(range(1, NUM_PAGES), BLOCKS)   # page 0 is vLLM's null block
    spec = _load_spec(store, tokens, pages)
    filled = {}
    for path, layerwise in (("grpc", False), ("direct-gpu", False), ("direct-gpu", True)):
        physical, caches = _caches("cuda")
        worker = _worker(store, caches, path=path, layerwise=layerwise)
        worker.loads.start([spec])
        early = {}
        if layerwise:   # the forward: each layer's wait, then its rows read on the current stream
            for layer in range(GEO.num_layers):
                worker.loads.wait_layer(f"model.layers.{layer}.self_attn.attn")
                for s in SECTIONS:
                    if s.layer == layer:
                        early[(s.layer, s.component)] = _rows(caches[_name(s.layer, s.component)], s, pages)
            worker.loads.finish()
        assert worker.loads.load_paths == {path: 1}, worker.loads.load_paths
        assert worker.loads.take_errors() == set() and worker.loads.blocks_loaded == BLOCKS
        for s in SECTIONS:
            want = blocks[:, s.offset: s.offset + s.size_bytes].reshape(-1, s.row_bytes)
            assert torch.equal(_rows(caches[_name(s.layer, s.component)], s, pages), want), (path, s)
            if layerwise:
                assert torch.equal(early[(s.layer, s.component)], want), ("at its layer's wait", s)
        filled[(path, layerwise)] = physical.cpu()
        _close(worker)
    assert torch.equal(filled[("direct-gpu", False)], filled[("grpc", False)])
    assert torch.equal(filled[("direct-gpu", True)], filled[("grpc", False)])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from fleet_fixture(tmp_path_factory.mktemp("gpu-fleet"), block_tokens=B)


def test_f61_a_direct_gpu_load_over_a_fleet_gathers_the_local_nodes_runs_and_streams_the_rest(fleet: Fleet) -> None:
    """F61 on a GPU: the worker's client is the fleet's (etcd://), its reader this host's node's; the pages it fills
    on `direct-gpu` hold the bytes a gRPC load over the same fleet fills, all at once and layer by layer."""
    local = fleet.nodes[0].node_id
    rng = random.Random(62)
    with fleet.client(geometry=GEO.name) as client:   # the node holds some of the prompt's runs, not all of them
        _, tokens = spread_prompt(fleet, lambda seed: [rng.randrange(1, 1 << 30) for _ in range(BLOCKS * B)],
                                  client.hashes,
                                  also=lambda chain: 0 < sum(local in r.replicas for r in client.placement(chain))
                                  < len(client.placement(chain)))
        blocks = torch.randint(0, 256, (BLOCKS, GEO.block_bytes(B)), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(62))
        client.put(tokens, blocks)
        spec = LoadSpec(req_id="r", hashes=list(client.hashes(tokens)), start=0, end=len(tokens),
                        block_ids=(random.Random(6).sample(range(1, NUM_PAGES), BLOCKS),))
    filled = {}
    for path, layerwise in (("grpc", False), ("direct-gpu", False), ("direct-gpu", True)):
        physical, caches = _caches("cuda")
        worker = _worker_of(fleet.address, fleet.data_dirs[local], caches, path=path, layerwise=layerwise)
        worker.loads.start([spec])
        if layerwise:
            for layer in range(GEO.num_layers):
                worker.loads.wait_layer(f"model.layers.{layer}.self_attn.attn")
            worker.loads.finish()
        assert worker.loads.load_paths == {path: 1}, worker.loads.load_paths
        assert worker.loads.take_errors() == set() and worker.loads.blocks_loaded == BLOCKS
        for s in SECTIONS:
            want = blocks[:, s.offset: s.offset + s.size_bytes].reshape(-1, s.row_bytes)
            assert torch.equal(_rows(caches[_name(s.layer, s.component)], s, spec.block_ids[0]), want), (path, s)
        filled[(path, layerwise)] = physical.cpu()
        _close(worker)
    assert torch.equal(filled[("direct-gpu", False)], filled[("grpc", False)])
    assert torch.equal(filled[("direct-gpu", True)], filled[("grpc", False)])


def test_a_layerwise_save_from_cuda_pages_stores_the_bytes_of_an_all_at_once_cpu_save(
        stored: tuple[Child, list[int], torch.Tensor]) -> None:
    store, _, _ = stored
    rng = random.Random(7)
    tokens = [rng.randrange(1, 1 << 30) for _ in range(10 * B + 5)]   # 10 full blocks
    pages = rng.sample(range(1, NUM_PAGES), 11)
    gpu_physical, gpu_caches = _caches("cuda")
    gpu_physical.copy_(torch.randint(0, 256, gpu_physical.shape, dtype=torch.uint8, device="cuda"))
    cpu_physical, cpu_caches = _caches("cpu")
    cpu_physical.copy_(gpu_physical.cpu())
    gpu = _worker(store, gpu_caches, path="grpc", layerwise=True)
    cpu = _worker(store, cpu_caches, path="grpc")
    specs = [SaveSpec(req_id="g", tokens=tokens, first_block=0, block_ids=(pages,), extra_keys=("gpu",))]
    for layer in range(GEO.num_layers):
        gpu.saves.save_layer(specs, f"model.layers.{layer}.self_attn.attn")
        for s in SECTIONS:   # the next kernels on the stream overwrite the layer: the copy was taken before
            if s.layer == layer:
                gpu_caches[_name(s.layer, s.component)].fill_(0xEE)
    gpu.saves.save_step(specs)
    cpu.saves.save_step([SaveSpec(req_id="c", tokens=tokens, first_block=0, block_ids=(pages,), extra_keys=("cpu",))])
    assert gpu.saves.parts_captured == len(SECTIONS) and gpu.saves.parts_gathered == 0
    assert cpu.saves.parts_captured == 0 and cpu.saves.parts_gathered == len(SECTIONS)
    for worker, req in ((gpu, "g"), (cpu, "c")):
        deadline = time.monotonic() + 60
        while worker.finished({req})[0] != {req} and time.monotonic() < deadline:
            time.sleep(0.01)
    assert gpu.saves.save_errors == cpu.saves.save_errors == 0
    assert gpu.saves.blocks_saved == cpu.saves.blocks_saved == 10
    _close(gpu)
    _close(cpu)
    with kvstore.Client(store.target, geometry=GEO.name) as c:
        g = c.get(tokens[: 10 * B], extra_keys=["gpu"]).blocks
        want = c.get(tokens[: 10 * B], extra_keys=["cpu"]).blocks
    assert len(g) == len(want) == 10 and g == want
    for s in SECTIONS:   # and they are the pages' rows, in the block layout
        rows = _rows(cpu_caches[_name(s.layer, s.component)], s, pages)[: 10 * B // GEO.compress_ratios[s.layer]]
        for i, block in enumerate(want):
            assert block is not None
            got = torch.frombuffer(bytearray(block[s.offset: s.offset + s.size_bytes]), dtype=torch.uint8)
            assert torch.equal(got.view(-1, s.row_bytes), rows[i * s.rows:(i + 1) * s.rows]), (s, i)

