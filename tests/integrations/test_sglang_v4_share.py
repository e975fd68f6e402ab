"""SGLang `v4` rows shared with the model's rows where exact (issue 27 item 3; integrations.sglang_share).

The rows are SGLang's own: its compressed-KV write path on the CPU (`_rope_fq4`: `rope_tail` then
`fake_quant_compressed_kv`, SGLang's torch reference of its Triton fake-quant) gives the latent SGLang
hands its V4 store; the store (CUDA only in SGLang) is kvstore's port, checked here against an
independent transcription of `store.cuh` in numpy + ml_dtypes. Then: SGLang's rows round-trip
engine row -> model row -> engine row bit for bit; rows that are no FP4 image (vLLM's FP8 of the raw
latent, a flipped byte) are inexact and stay SGLang's records; a Hopper SGLang backend (v4) and a
Blackwell one (v41, the model's rows) find each other's prompts; a chain that turns inexact moves
to SGLang's layout whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from integrations.sglang_v4 import V4PageLayout, blocks_to_pages
from kvstore.codec import sglang_v4 as codec
from kvstore.codec.block_codec import encode_blocks
from kvstore.codec.rows import compressed_kv_rows
from tests.children import Child, write_config
from tests.integrations import test_sglang_support as support
from tests.integrations.test_sglang_support import GEO, PoolName, kvstore, sg_utils
from tests.integrations.test_sglang_v4 import V4_PAGE, attach, v41_group
from tests.integrations.test_sglang_v4_layout import ENGINE, INDEX_POOL, KV_POOL, SOURCES, index_page, v4_group, v4_page
from tests.integrations.test_sglang_v4_pages import SIDE, N, page_bytes, side_transfers, slots, tokens_of

python_tree_core = support.python_tree_core
server = support.server

SHAPE = codec.RowShape()


def freqs(n: int, start: int = 0) -> torch.Tensor:
    """RoPE frequencies of positions [start, start + n): complex [n, 32], as the model's freqs_cis rows."""
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    angles = torch.arange(start, start + n, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.polar(torch.ones_like(angles), angles)


def rope_fq4(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """SGLang's `_rope_fq4(latent, freqs, 64, compressed_kv=True)`: on the CPU its torch path (`rope_tail`, then
    `fake_quant_compressed_kv`), the latent its V4 store receives. Imported here, after test_sglang_v4's
    stand-ins for the modules the lean install leaves out."""
    from sglang.srt.layers.attention.dsv4.dsv41_sparse import _rope_fq4

    return _rope_fq4(x, f, 64, compressed_kv=True)  # type: ignore[no-any-return]


def latents(n: int, seed: int, kind: str = "normed") -> torch.Tensor:
    """Compressed latents as SGLang's compressor hands them over (bf16 [n, 512]): RMS-normed Gaussians with a
    per-channel gain ("normed", the real-ish case), heavy-tailed ("t"), or 90% zeros ("sparse")."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 512, generator=g)
    if kind == "t":
        x = x / torch.sqrt(torch.distributions.Chi2(3.0).sample((n, 512)) / 3.0)
    if kind == "sparse":
        x = x * (torch.rand(n, 512, generator=g) < 0.1)
    gain = 0.5 + torch.rand(512, generator=g)
    rms = x.pow(2).mean(-1, keepdim=True).clamp_min(1e-12).sqrt()
    return (x / rms * gain).to(torch.bfloat16)


def sglang_rows(n: int, seed: int, kind: str = "normed") -> torch.Tensor:
    """SGLang's 584-B compressed-KV rows: its own fake-quant path (CPU) of the latents, then the V4 store."""
    x = latents(n, seed, kind)
    fq = rope_fq4(x, freqs(n))
    assert fq.dtype == torch.bfloat16
    return codec.store_rows(fq)


def store_reference(values: np.ndarray) -> np.ndarray:
    """`fused_store_flashmla_cache` (store.cuh, V4) transcribed: float32 numpy, ml_dtypes' E4M3 (RNE).

    Per warp of 64 NoPE values: abs_max = warp max, scale_raw = fmaxf(1e-4f, abs_max) / 448.f,
    ue8m0 = exponent + (mantissa != 0), inv_scale = 2^(127 - (ue8m0 - 127)) ... i.e. 2^-(ue8m0 - 127),
    E4M3(clip(x * inv_scale, +-448)); the last warp copies its 64 values as bf16 at byte 448; scale[wid]
    for warps 0-6 at byte 576; byte 583 untouched (zero)."""
    out = np.zeros((values.shape[0], 584), dtype=np.uint8)
    for r, row in enumerate(values.astype(np.float32)):
        for w in range(7):
            x = row[w * 64:(w + 1) * 64]
            raw = np.float32(max(np.float32(1e-4), np.abs(x).max())) / np.float32(448.0)
            bits = np.array([raw], dtype=np.float32).view(np.uint32)[0]
            e = int((bits >> 23) & 0xFF) + int((bits & 0x7FFFFF) != 0)
            inv = np.float32(2.0 ** (127 - e))
            q = np.clip(x * inv, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            out[r, w * 64:(w + 1) * 64] = q
            out[r, 576 + w] = e
        out[r, 448:576] = row[448:].astype(ml_dtypes.bfloat16).view(np.uint8)
    return out


def test_the_store_port_is_sglangs_store_math_byte_for_byte() -> None:
    fq = rope_fq4(latents(96, 1), freqs(96))
    edge = fq[:4].clone()
    edge[0] = 0                                  # an all-zero row: every tile at the 1e-4 floor
    edge[1, :64] = 1e-6                          # one tile below the floor
    edge[2, 64:128] = -0.0                       # negative zeros keep their sign
    edge[3, :448:2] = 400.0                      # large values (scale 2^0)
    values = torch.cat((fq, edge))
    ours = codec.store_rows(values)
    assert ours.shape == (100, 584) and ours.dtype == torch.uint8
    assert np.array_equal(ours.numpy(), store_reference(values.float().numpy()))
    assert (ours[:, 583] == 0).all() and (ours[98, 64:128] == 0x80).all()   # the edge rows are 96-99


@pytest.mark.parametrize("kind", ["normed", "t", "sparse"])
def test_sglangs_rows_round_trip_engine_model_engine_bit_for_bit(kind: str) -> None:
    rows = sglang_rows(512, 2, kind)
    found = codec.recover_rows(rows, alternatives=True)
    assert found.exact.all()                                           # every SGLang row is an FP4 image
    assert torch.equal(codec.encode_rows(found.native), rows)         # engine -> model -> engine
    if kind == "normed":
        # ... and the model row found is kvstore's own row of that latent (the model's fake-quant of it).
        x = latents(512, 2, kind)
        rope = x.float()
        tail = torch.view_as_complex(rope[:, 448:].reshape(512, 32, 2).contiguous()) * freqs(512)
        rope[:, 448:] = torch.view_as_real(tail).reshape(512, 64).to(torch.bfloat16).float()
        assert torch.equal(found.native, compressed_kv_rows(rope))
        assert not found.ambiguous.any()


def test_rows_that_are_no_fp4_image_are_inexact() -> None:
    x = latents(256, 3)
    raw = codec.store_rows(x)                          # vLLM's fp8_ds_mla: the raw latent's FP8, no FP4 step
    assert not codec.recover_rows(raw).exact.any()
    rows = sglang_rows(64, 4)
    flipped = rows.clone()
    flipped[5, 10] ^= 0x01                             # one NoPE byte off
    flipped[9, 500] ^= 0x01                            # one RoPE byte off
    flipped[11, 583] = 1                               # the pad byte set
    exact = codec.recover_rows(flipped).exact
    assert exact.sum() == 61 and not exact[5] and not exact[9] and not exact[11]


def test_a_collision_is_exact_and_counted_ambiguous_and_zero_groups_are_not() -> None:
    # HOPPER_LAYOUTS.md section 3: scales 1.625 and 1.75 with one code 6 both store E4M3 320 x 2^-5 = 10.0.
    values = torch.zeros(3, 512, dtype=torch.bfloat16)
    values[0, 0], values[1, 0] = 9.75, 10.5             # 6 x 1.625, 6 x 1.75: FP4 rows of themselves
    values[2, 100] = 3.0                                # the rest of row 2 zero: no collision, zero groups
    rows = codec.store_rows(rope_fq4(values, freqs(3, 0) ** 0))   # freqs 1: no rotation
    assert torch.equal(rows[0], rows[1])
    found = codec.recover_rows(rows, alternatives=True)
    assert found.exact.all() and found.ambiguous.tolist() == [True, True, False]
    assert found.native[0, 256] == torch.tensor(1.625).to(torch.float8_e4m3fn).view(torch.uint8)   # the nearest
    assert not codec.recover_rows(rows).ambiguous.any()                                 # counted only when asked


def test_blocks_transcode_and_report_the_exact_share() -> None:
    n = 3
    rows = {s: (sglang_rows(n * GEO.block_rows(s, 64), 10 + s),
                torch.randint(0, 256, (n * GEO.block_rows(s, 64), 68), dtype=torch.uint8))
            for s in GEO.kv_source_layers}
    from kvstore.codec.block_codec import join_blocks
    blocks = join_blocks(ENGINE, rows, 64)
    got = codec.v4_blocks_to_native(GEO, blocks, 64)
    assert got.exact.all() and got.rows == got.exact_rows == n * 160
    assert got.native.shape == (n, GEO.block_bytes(64))
    assert torch.equal(codec.native_blocks_to_v4(GEO, got.native, 64), blocks)
    rows[20] = (codec.store_rows(latents(n * 64, 7)), rows[20][1])   # layer 20's rows: vLLM-like, raw
    partly = codec.v4_blocks_to_native(GEO, join_blocks(ENGINE, rows, 64), 64)
    assert not partly.exact.any() and partly.exact_rows == n * 96


# -- the backend ------------------------------------------------------------------------------------


def fill_v4(group: Any, first_page: int, pages: int, seed: int, *, raw: bool = False) -> torch.Tensor:
    """SGLang's rows (its fake-quant then store; `raw`: the raw latent's FP8, no FP4 image) and random FP4
    indexer rows laid into the V4 side pools at host pages [first_page, +pages); the v4 blocks they are."""
    from kvstore.codec.block_codec import join_blocks
    g = torch.Generator().manual_seed(seed)
    per_layer: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {s: ([], []) for s in GEO.kv_source_layers}
    for p in range(pages):
        for ratio, layers in SOURCES.items():
            n = V4_PAGE // ratio
            kv = torch.stack([codec.store_rows(latents(n, seed * 100 + p * 10 + layer)) if raw else
                              sglang_rows(n, seed * 100 + p * 10 + layer) for layer in layers])
            ix = torch.randint(0, 256, (len(layers), n, 68), generator=g, dtype=torch.uint8)
            group.get_pool(KV_POOL[ratio]).set_from_flat_data_page((first_page + p) * V4_PAGE, v4_page(kv).flatten())
            group.get_pool(INDEX_POOL[ratio]).set_from_flat_data_page((first_page + p) * V4_PAGE,
                                                                      index_page(ix).flatten())
            for i, layer in enumerate(layers):
                per_layer[layer][0].append(kv[i])
                per_layer[layer][1].append(ix[i])
    return join_blocks(ENGINE, {s: (torch.cat(k), torch.cat(i)) for s, (k, i) in per_layer.items()}, 64)


def store(backend: Any, keys: list[str], first_page: int) -> list[bool]:
    """SGLang's write-back of pages at host pages [first_page, ...): side pools, then the anchor."""
    host = slots(first_page, len(keys))
    done = backend.batch_set_v2(side_transfers(keys, host))[str(SIDE[0])]
    assert backend.batch_set_v1(keys, host) == done
    return list(done)


def load(backend: Any, keys: list[str], first_page: int) -> int:
    """SGLang's prefetch of `keys` into host pages [first_page, ...): exists, then the anchor's read."""
    host = slots(first_page, len(keys))
    hit = backend.batch_exists_v2(keys, side_transfers(keys, host)).kv_hit_pages
    if hit:
        assert backend.batch_get_v1(keys[:hit], slots(first_page, hit)) == [True] * hit
    return int(hit)


def v41_page_bytes(blocks: torch.Tensor) -> list[dict[str, bytes]]:
    """The V4.1 side-pool pages (block-split, SGLANG_DSV4_KV_LAYOUT=v41) of model-rows blocks."""
    layout = V4PageLayout(GEO)
    return [{k: bytes(v.flatten().numpy()) for k, v in blocks_to_pages(layout, blocks[p * N:(p + 1) * N]).items()}
            for p in range(blocks.shape[0] // N)]


def test_a_hopper_and_a_blackwell_sglang_share_one_cache_of_model_rows(
        server: Child, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = tokens_of(61, 2)
    # Hopper (SGLang's default v4 rows) saves a prompt: stored as the model's rows, 890 B/token.
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    hopper_group = v4_group(pages=4)
    hopper = attach(server.target, hopper_group)
    try:
        engine_blocks = fill_v4(hopper_group, 0, 2, seed=5)
        saved = [page_bytes(hopper_group, p) for p in range(2)]
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:2]
        assert store(hopper, keys, 0) == [True, True]
        c = hopper.counters()
        assert (c["blocks_shared"], c["blocks_engine"], c["rows_exact"]) == (2 * N, 0, c["rows_transcoded"])
        native = codec.v4_blocks_to_native(GEO, engine_blocks, 64).native
        with kvstore.Client(server.target) as model, kvstore.Client(server.target, geometry=ENGINE.name) as engine:
            assert model.get(tokens[:2 * V4_PAGE]).blocks == [bytes(b.numpy()) for b in native]
            assert engine.lookup(tokens).found_blocks == 0            # nothing kept twice
        # ... and read back into its own pools as its own bytes.
        assert load(hopper, keys, 2) == 2
        assert [page_bytes(hopper_group, 2 + p) for p in range(2)] == saved
        assert hopper.counters()["pages_reencoded"] == 2
    finally:
        hopper.close()
    # Blackwell (v41: the model's rows) finds the prompt and reads the model's rows.
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")
    bw_group = v41_group(pages=4)
    blackwell = attach(server.target, bw_group)
    try:
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:2]
        assert load(blackwell, keys, 0) == 2
        assert [page_bytes(bw_group, p) for p in range(2)] == v41_page_bytes(native)
        # ... and the other way: what Blackwell stores (model rows), Hopper reads as its own v4 rows.
        more = tokens_of(62, 2)
        blocks = encode_blocks(GEO, {s: (torch.randn(2 * N * GEO.block_rows(s, 64), 512),
                                         torch.randn(2 * N * GEO.block_rows(s, 64), 128))
                                     for s in GEO.kv_source_layers})
        for p, page in enumerate(v41_page_bytes(blocks)):
            for name, data in page.items():
                bw_group.get_pool(PoolName(name)).set_from_flat_data_page(
                    (2 + p) * V4_PAGE, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        more_keys = sg_utils.get_hash_str(more, None, page_size=V4_PAGE)[:2]
        assert store(blackwell, more_keys, 2) == [True, True]
    finally:
        blackwell.close()
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    hopper_group = v4_group(pages=2)
    hopper = attach(server.target, hopper_group)
    try:
        more_keys = sg_utils.get_hash_str(more, None, page_size=V4_PAGE)[:2]
        assert load(hopper, more_keys, 0) == 2
        want = codec.native_blocks_to_v4(GEO, blocks, 64)
        layout = V4PageLayout(ENGINE)
        assert [page_bytes(hopper_group, p) for p in range(2)] == [
            {k: bytes(v.flatten().numpy()) for k, v in blocks_to_pages(layout, want[p * N:(p + 1) * N]).items()}
            for p in range(2)]
    finally:
        hopper.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_transcoding_on_the_gpu_stores_and_loads_the_same_bytes(server: Child, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    tokens = tokens_of(63, 2)
    group = v4_group(pages=4)
    backend = attach(server.target, group, {"transcode_device": "cuda"})
    try:
        engine_blocks = fill_v4(group, 0, 2, seed=6)
        saved = [page_bytes(group, p) for p in range(2)]
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:2]
        assert store(backend, keys, 0) == [True, True] and backend.counters()["blocks_shared"] == 2 * N
        with kvstore.Client(server.target) as model:
            want = codec.v4_blocks_to_native(GEO, engine_blocks, 64).native        # the CPU's answer
            assert model.get(tokens[:2 * V4_PAGE]).blocks == [bytes(b.numpy()) for b in want]
        assert load(backend, keys, 2) == 2
        assert [page_bytes(group, 2 + p) for p in range(2)] == saved
    finally:
        backend.close()


def test_a_chain_that_turns_inexact_moves_to_sglangs_layout_whole(
        server: Child, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    tokens = tokens_of(71, 3)
    group = v4_group(pages=6)
    backend = attach(server.target, group)
    try:
        exact = fill_v4(group, 0, 2, seed=8)
        raw = fill_v4(group, 2, 1, seed=9, raw=True)            # the third page: no FP4 image
        saved = [page_bytes(group, p) for p in range(3)]
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:3]
        assert store(backend, keys[:2], 0) == [True, True]       # shared: the model's rows
        assert store(backend, keys[2:], 2) == [True]             # inexact: SGLang's records, the chain with it
        c = backend.counters()
        assert (c["blocks_shared"], c["blocks_engine"], c["engine_prefix_moves"]) == (2 * N, N, 1)
        with kvstore.Client(server.target, geometry=ENGINE.name) as engine:
            assert engine.get(tokens[:3 * V4_PAGE]).blocks == [bytes(b.numpy()) for b in torch.cat((exact, raw))]
        assert load(backend, keys, 3) == 3                       # the longer chain: SGLang's
        assert [page_bytes(group, 3 + p) for p in range(3)] == saved
    finally:
        backend.close()
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")
    blackwell = attach(server.target, v41_group(pages=3))
    try:
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:3]
        assert blackwell.batch_exists(keys) == 2                 # the exact pages only, never the inexact one
    finally:
        blackwell.close()


def test_sharing_off_keeps_sglangs_records_and_the_setting_is_checked(
        server: Child, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.errors import ConfigError

    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    tokens = tokens_of(81, 1)
    group = v4_group(pages=2)
    backend = attach(server.target, group, {"share_model_rows": False})
    try:
        assert backend.sharing is None and backend.client.geometry == ENGINE.name
        fill_v4(group, 0, 1, seed=3)
        assert store(backend, sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:1], 0) == [True]
        with kvstore.Client(server.target) as model:
            assert model.lookup(tokens).found_blocks == 0
    finally:
        backend.close()
    for bad in ({"share_model_rows": "yes"}, {"transcode_device": "tpu"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            attach(server.target, v4_group(pages=1), bad)


def test_the_share_of_exact_blocks_on_real_ish_rows() -> None:
    """Reported: the share of blocks (and rows) that transcode exactly, per latent distribution."""
    from kvstore.codec.block_codec import join_blocks
    shares = {}
    for kind in ("normed", "t", "sparse"):
        rows = {s: (sglang_rows(2 * GEO.block_rows(s, 64), 20 + s, kind),
                    torch.zeros(2 * GEO.block_rows(s, 64), 68, dtype=torch.uint8)) for s in GEO.kv_source_layers}
        got = codec.v4_blocks_to_native(GEO, join_blocks(ENGINE, rows, 64), 64)
        shares[kind] = float(got.exact.float().mean())
    print(f"exact share of SGLang v4 blocks: {shares}")
    assert shares == {"normed": 1.0, "t": 1.0, "sparse": 1.0}


@pytest.fixture(scope="module")
def pinning_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    """A server that grants pins (docs/RETENTION.md R22-R24), as test_sglang_retention.py's."""
    root = tmp_path_factory.mktemp("v4-pins")
    conf = write_config(root / "kvstore.toml", {"store": {"pin_max_hours": 1000.0, "pin_budget_bytes": 1 << 30}})
    child = Child("serve", ["serve", "--port", "0", "--data-dir", str(root / "data"), "--config", str(conf)],
                  root / "logs")
    yield child
    child.kill_if_alive()


def _pins_view(server: Child) -> tuple[int, int]:
    """The server's Lookups answered, and the default tenant's pins."""
    with kvstore.Client(server.target) as c:
        stats = c.stats(tenant="default")
        return stats.lookups, next((t.pins for t in stats.tenants if t.tenant == "default"), 0)


def test_a_retention_hint_pins_the_chain_in_whichever_layout_it_went_to(
        pinning_server: Child, monkeypatch: pytest.MonkeyPatch) -> None:
    """R22/R28: a V4 stack's write pins in the Put of its last page, in the layout that page went to (the
    model's rows, SGLang's records, or SGLang's records with sharing off): the server answers no Lookup."""
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    lookups0, pins0 = _pins_view(pinning_server)
    group = v4_group(pages=2)
    backend = attach(pinning_server.target, group, {"keep_s": 3600})
    try:
        fill_v4(group, 0, 1, seed=12)                                   # exact: the model's rows
        fill_v4(group, 1, 1, seed=13, raw=True)                         # inexact: SGLang's records
        for p, tokens in enumerate((tokens_of(91, 1), tokens_of(92, 1))):
            keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:1]
            assert store(backend, keys, p) == [True]
            assert backend.counters()["pins"] == p + 1
            assert _pins_view(pinning_server) == (lookups0, pins0 + p + 1)     # granted in the Put itself
        assert (backend.counters()["blocks_shared"], backend.counters()["blocks_engine"]) == (N, N)
    finally:
        backend.close()
    group = v4_group(pages=1)
    plain = attach(pinning_server.target, group, {"keep_s": 3600, "share_model_rows": False})
    try:
        fill_v4(group, 0, 1, seed=14)
        assert store(plain, sg_utils.get_hash_str(tokens_of(93, 1), None, page_size=V4_PAGE)[:1], 0) == [True]
        assert plain.counters()["pins"] == 1 and _pins_view(pinning_server) == (lookups0, pins0 + 3)
    finally:
        plain.close()
