"""The engines' own write paths for their Hopper layouts, on the GPU, round-tripped through a real kvstore server.

Issue 27 item 4 (marked gpu; skipped without CUDA). The engines are not installed on the GPU machine, so
their Triton kernels are run from verbatim copies (tests/integrations/engine_kernels.py, checked against
the installed engines' text in test_engine_kernels.py):

- SGLang `v4`: its Triton `rope_tail_fake_quant_fp4` (step 1 of its compressed-KV write), then its V4 store
  (CUDA JIT in SGLang; here kvstore's bit-exact port `store_rows`, checked against a transcription of
  `store.cuh` in test_sglang_v4_share.py) write real rows from a real latent into SGLang's block-split
  256-token pages. The backend's save path takes them (pages -> blocks -> the model's rows, transcoded on
  the GPU, every row exact), a real `kvstore serve` stores them, the pages are dropped, and the load path
  (Get, or the direct GPU restore from the store's file) transcodes them back on the GPU into pages that
  equal SGLang's byte for byte.
- vLLM `fp8_ds_mla` (SM90): its Triton `_rope_quant_insert_kernel` writes 584-B rows into 64-token
  block-split pages; the torch port (`vllm_insert_584`, the CPU oracle) writes the same bytes on CUDA and
  on the CPU; the rows are stored under vLLM's own layout, dropped, and come back byte for byte, through
  Get, the direct GPU restore, and the direct GPU scatter into each layer's rows.

The indexer rows are not the engines' kernels here (SGLang's are the model's FP4 rows; vLLM's FP8 ones are
random bytes): they are stored byte for byte like any row.

    python -m pytest -q -m gpu tests/integrations/test_engine_writes_gpu.py
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.client import Client
from kvstore.codec.block_codec import join_blocks, split_blocks
from kvstore.geometry import V4_1_FLASH
from kvstore.layout import VLLM_FP8_DS_MLA_SM90
from tests.children import Child

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BT = 64
GEO = V4_1_FLASH


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("engine-writes")
    data_dir = tmp / "store"
    server = Child("serve", ["serve", "--port", "0", "--data-dir", str(data_dir)], tmp / "logs")
    try:
        yield server.target, data_dir
    finally:
        server.kill_if_alive()


def latent(rows: int, seed: int) -> torch.Tensor:
    """Compressed latents as the compressor hands them over: RMS-normed, per-channel gains, bf16 [rows, 512]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 512, generator=g)
    gain = 0.5 + torch.rand(512, generator=g)
    return (x / x.pow(2).mean(-1, keepdim=True).sqrt() * gain).to(torch.bfloat16)


def freqs(rows: int, step: int) -> torch.Tensor:
    """Complex RoPE factors [rows, 32] of positions 0, step, 2 step, ... (a compressed row's position)."""
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    angles = (torch.arange(rows, dtype=torch.float32) * step)[:, None] * inv[None, :]
    return torch.polar(torch.ones_like(angles), angles)


def tokens_of(n_blocks: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << 30, (n_blocks * BT,), generator=g).tolist()


def test_sglangs_v4_rows_round_trip_through_kvstore_as_the_models_rows(store: tuple[str, Path]) -> None:
    from integrations.sglang_v4 import V4PageLayout, blocks_to_pages, pages_to_blocks
    from kvstore.client.colocated import ColocatedReader
    from kvstore.client.restore import restore
    from kvstore.codec import sglang_v4
    from kvstore.codec.rows import compressed_kv_rows, indexer_key_rows
    from tests.integrations import engine_kernels as ek

    target, data_dir = store
    engine = sglang_v4.engine_geometry(GEO)
    n = 8                                                       # two 256-token SGLang pages
    layers, exact_model = {}, 0
    for s in GEO.kv_source_layers:
        rows = n * GEO.block_rows(s, BT)
        x = latent(rows, s)
        f = freqs(rows, GEO.compress_ratios[s])
        fq = ek.rope_tail_fake_quant_fp4(x.cuda(), f.cuda())  # SGLang's Triton fake-quant, on the GPU
        v4 = sglang_v4.store_rows(fq)                          # its V4 store (the bit-exact port)
        # The values SGLang stores are the model's FP4 row of the rotated latent (RoPE FMAs aside).
        rot = x.float()
        tail = torch.view_as_complex(rot[:, 448:].reshape(rows, 32, 2).contiguous()) * f
        rot[:, 448:] = torch.view_as_real(tail).reshape(rows, 64).to(torch.bfloat16).float()
        found = sglang_v4.recover_rows(v4)
        exact_model += int((found.native.cpu() == compressed_kv_rows(rot)).all(-1).sum())
        assert bool(found.exact.all())                         # every row SGLang wrote is an FP4 image
        index = indexer_key_rows(torch.randn(rows, 128, generator=torch.Generator().manual_seed(50 + s)))
        layers[s] = (v4, index.cuda())
    assert exact_model >= 0.99 * sum(n * GEO.block_rows(s, BT) for s in GEO.kv_source_layers)
    written = join_blocks(engine, layers, BT)
    layout = V4PageLayout(engine, page_tokens=256, block_tokens=BT)
    pages = [blocks_to_pages(layout, written[i:i + 4].cpu()) for i in range(0, n, 4)]   # SGLang's host pages
    # Save: the backend's page -> blocks, the transcode on the GPU, the model's rows stored (all exact).
    saved = torch.cat([pages_to_blocks(layout, p) for p in pages])
    assert torch.equal(saved, written.cpu())
    native = sglang_v4.v4_blocks_to_native(GEO, saved.cuda(), BT)
    assert bool(native.exact.all()) and native.exact_rows == native.rows
    tokens = tokens_of(n, 1)
    with Client(target, geometry=GEO.name) as client:
        client.put(tokens, native.native.cpu())
        kept = [{k: v.clone() for k, v in p.items()} for p in pages]
        for p in pages:                                        # dropped from the engine's pages
            for v in p.values():
                v.zero_()
        got, _ = client.get_tensor(tokens)
        loaded = sglang_v4.native_blocks_to_v4(GEO, got.cuda(), BT).cpu()
        for i, want in enumerate(kept):
            back = blocks_to_pages(layout, loaded[4 * i:4 * i + 4])
            assert all(torch.equal(back[k], want[k]) for k in want)      # SGLang's pages, byte for byte
        dest = torch.empty((n, GEO.block_bytes(BT)), dtype=torch.uint8, device="cuda")
        with ColocatedReader(data_dir) as reader:
            result = restore(client, tokens, dest, reader=reader, path="direct-gpu")
        assert (result.path, result.blocks) == ("direct-gpu", n)
        assert torch.equal(sglang_v4.native_blocks_to_v4(GEO, dest, BT).cpu(), written.cpu())


def _rows_of_pages(cache: torch.Tensor) -> torch.Tensor:
    """A block-split 584-B cache [pages, slots, 584] (data slot x 576, scales after) as rows [pages, slots, 584]."""
    p, slots = cache.shape[0], cache.shape[1]
    flat = cache.view(p, -1)
    data = flat[:, :slots * 576].view(p, slots, 576)
    scales = flat[:, slots * 576:].view(p, slots, 8)
    return torch.cat((data, scales), dim=-1)


def _pages_of_rows(rows: torch.Tensor) -> torch.Tensor:
    p, slots = rows.shape[0], rows.shape[1]
    return torch.cat((rows[..., :576].reshape(p, -1), rows[..., 576:].reshape(p, -1)), dim=-1).view(p, slots, 584)


def test_vllms_fp8_ds_mla_rows_round_trip_through_kvstore_byte_for_byte(store: tuple[str, Path]) -> None:
    from kvstore.client.colocated import ColocatedReader
    from kvstore.client.gpu_gather import GpuGather
    from kvstore.client.restore import restore
    from tests.integrations import engine_kernels as ek

    target, data_dir = store
    engine = GEO.with_records(VLLM_FP8_DS_MLA_SM90)
    n = 6                                                       # six 64-token vLLM pages = kvstore blocks
    positions = torch.arange(n * BT)
    angles = torch.arange(n * BT, dtype=torch.float32)[:, None] * (1.0 / 10000 ** (torch.arange(32) / 32))[None]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    caches, layers = {}, {}
    for s in GEO.kv_source_layers:
        ratio, slots_per_page = GEO.compress_ratios[s], GEO.block_rows(s, BT)
        x = latent(n * BT, 100 + s)
        slots = positions // BT * slots_per_page + positions % BT // ratio
        cache = torch.zeros((n, slots_per_page, 584), dtype=torch.uint8, device="cuda")
        ek.rope_quant_insert_584(x.cuda(), positions.cuda(), cos_sin.cuda(), cache, slots.cuda(), ratio)  # vLLM's
        port = torch.zeros_like(cache)
        ek.vllm_insert_584(x.cuda(), positions.cuda(), cos_sin.cuda(), port, slots.cuda(), ratio)
        cpu = torch.zeros(cache.shape, dtype=torch.uint8)
        ek.vllm_insert_584(x, positions, cos_sin, cpu, slots, ratio)
        loose = torch.zeros_like(cpu)
        ek.vllm_insert_584(x, positions, cos_sin, loose, slots, ratio, contract=False)
        assert torch.equal(port, cache) and torch.equal(cpu, cache.cpu()), \
            f"layer {s}: the port differs from vLLM's kernel in {int((cpu != cache.cpu()).sum())} bytes " \
            f"(without contraction: {int((loose != cache.cpu()).sum())})"
        assert (cache.view(n, -1)[:, slots_per_page * 576:].view(n, slots_per_page, 8)[..., 7] == 0).all()
        caches[s] = cache
        index = torch.randint(0, 256, (n * slots_per_page, engine.indexer_row_bytes), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(s)).cuda()
        layers[s] = (_rows_of_pages(cache).reshape(-1, 584), index)
    blocks = join_blocks(engine, layers, BT)
    tokens = tokens_of(n, 2)
    with Client(target, geometry=engine.name) as client:
        client.put(tokens, blocks.cpu())
        kept = {s: c.clone() for s, c in caches.items()}
        for c in caches.values():                              # dropped from the engine's pages
            c.zero_()
        with Client(target, geometry=GEO.name) as native:
            assert native.lookup(tokens).found_blocks == 0      # never found as the model's rows
        got, _ = client.get_tensor(tokens)
        for s, (kv, _index) in split_blocks(engine, got.cuda(), BT).items():
            assert torch.equal(_pages_of_rows(kv), kept[s])     # vLLM's pages, byte for byte
        dest = torch.empty((n, engine.block_bytes(BT)), dtype=torch.uint8, device="cuda")
        with ColocatedReader(data_dir) as reader:
            result = restore(client, tokens, dest, reader=reader, path="direct-gpu")
            assert (result.path, result.blocks) == ("direct-gpu", n) and torch.equal(dest.cpu(), blocks.cpu())
            rows = {s: (torch.zeros((n, GEO.block_rows(s, BT), 584), dtype=torch.uint8, device="cuda"),
                        torch.zeros((n, GEO.block_rows(s, BT), engine.indexer_row_bytes), dtype=torch.uint8,
                                    device="cuda")) for s in GEO.kv_source_layers}
            pages = torch.arange(n).flip(0)                    # each block to another page
            with GpuGather() as gather, reader.read(client, client.hashes(tokens)) as read:
                scattered = gather.scatter(read, rows, pages, geometry=engine, block_tokens=BT)
        assert scattered.blocks == n
        for s, (kv, index) in rows.items():                     # the direct scatter into each layer's rows
            assert torch.equal(_pages_of_rows(kv[pages]), kept[s])
            assert torch.equal(index[pages], layers[s][1].view(n, -1, engine.indexer_row_bytes))


def test_sglangs_v4_rows_scatter_straight_into_its_paged_layout(store: tuple[str, Path]) -> None:
    """The direct GPU scatter of blocks stored under SGLang's own layout (an inexact chain's, here raw-latent
    rows) into each layer's 584-B rows, which SGLang's pages are made of (integrations.sglang_v4)."""
    from kvstore.client.colocated import ColocatedReader
    from kvstore.client.gpu_gather import GpuGather
    from kvstore.codec import sglang_v4

    target, data_dir = store
    engine = sglang_v4.engine_geometry(GEO)
    n = 4
    layers = {s: (sglang_v4.store_rows(latent(n * GEO.block_rows(s, BT), 200 + s).cuda()),      # raw: inexact
                  torch.randint(0, 256, (n * GEO.block_rows(s, BT), 68), dtype=torch.uint8).cuda())
              for s in GEO.kv_source_layers}
    blocks = join_blocks(engine, layers, BT)
    assert not bool(sglang_v4.v4_blocks_to_native(GEO, blocks, BT).exact.any())
    tokens = tokens_of(n, 3)
    with Client(target, geometry=engine.name) as client, ColocatedReader(data_dir) as reader:
        client.put(tokens, blocks.cpu())
        rows = {s: (torch.zeros((n, GEO.block_rows(s, BT), 584), dtype=torch.uint8, device="cuda"),
                    torch.zeros((n, GEO.block_rows(s, BT), 68), dtype=torch.uint8, device="cuda"))
                for s in GEO.kv_source_layers}
        with GpuGather() as gather, reader.read(client, client.hashes(tokens)) as read:
            assert gather.scatter(read, rows, None, geometry=engine, block_tokens=BT).blocks == n
    for s, (kv, index) in rows.items():
        assert torch.equal(kv.reshape(-1, 584), layers[s][0]) and torch.equal(index.reshape(-1, 68), layers[s][1])
