"""Record layouts: which bytes a block's rows are, so that blocks of two layouts never meet.

A block holds, per kv source layer, its compressed-KV rows then its indexer rows
(`ModelGeometry.block_layout`); a snapshot holds every layer's window rows. What one
row's bytes are depends on who wrote them: the model's own rows (DeepSeek-V4.1's NVFP4
compressed KV, MXFP4 indexer keys, MXFP8 window rows: 288 + 68 and 528 B), or an
engine's record kept as it is (SGLang's default `v4` layout, 584-B FP8 + BF16 rows;
vLLM's `fp8_ds_mla`, 584-B rows on SM90 and 528-B MXFP8 rows on SM100, with a 132-B
FP8 indexer row). Sources: ../shared/HOPPER_LAYOUTS.md, checked against the engines'
own code (docs/ENGINES.md "Layouts").

A `RecordLayout` names one such choice. It is part of the geometry (`ModelGeometry.records`),
so it is in the geometry fingerprint, which is the first 8 bytes of every storage key and
the seed of every chain's root (`kvstore.prefix.root_hash`): this module is the one place
the layout enters the keys (`fingerprint`). The model's own layout keeps the fingerprint
it always had (docs/PREFIX_HASHING.md's vectors); any other is hashed with its description,
so two layouts share no key, no chain and no snapshot.

A stored row is always `[data][scales]`, whatever the engine's page arrangement
(`RowFormat.page_arrangement`: block-split pages hold every slot's data, then every
slot's scales; interleaved pages hold rows). Adapters un-arrange pages into rows and back.
For the model's rows that is an exact permutation, so block-split and interleaved
engines share them; an engine layout is one arrangement only, named in its description.

Pure Python (no torch): the server imports it through `kvstore.geometry`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

#: Row encodings: (data bytes, scale bytes) of a row of `width` channels, `rope` of them RoPE channels.
#: The names say the value type, the scale type and the channels per scale.
ENCODINGS: dict[str, str] = {
    "e2m1+e4m3/16": "E2M1 pairs (low nibble first), one E4M3 scale per 16 channels (the model's NVFP4)",
    "e2m1+ue8m0/32": "E2M1 pairs (low nibble first), one UE8M0 scale per 32 channels (MXFP4)",
    "e4m3+ue8m0/32": "E4M3 per channel, then one UE8M0 scale per 32 channels (MXFP8)",
    "e4m3-nope+bf16-rope+ue8m0/64": "E4M3 NoPE channels, BF16 RoPE channels, one UE8M0 scale per 64 NoPE channels "
                                    "padded with zero bytes to 8 (DeepSeek-V4's FlashMLA record)",
    "e4m3+f32/128": "E4M3 per channel, one float32 power-of-two scale per 128 channels",
    "e4m3+ue8m0x4/128": "E4M3 per channel, one power-of-two scale per 128 channels as four equal UE8M0 bytes",
}

#: Page arrangements an engine keeps rows in (a stored row is always `[data][scales]`).
ARRANGEMENTS = ("interleaved", "block-split")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def row_sizes(encoding: str, width: int, rope: int = 0) -> tuple[int, int]:
    """(data bytes, scale bytes) of one row of `encoding` over `width` channels (`rope` of them RoPE).

    Raises:
        KeyError: an encoding not in `ENCODINGS`.
    """
    if encoding == "e2m1+e4m3/16":
        return width // 2, width // 16
    if encoding == "e2m1+ue8m0/32":
        return width // 2, width // 32
    if encoding == "e4m3+ue8m0/32":
        return width, width // 32
    if encoding == "e4m3-nope+bf16-rope+ue8m0/64":
        nope = width - rope
        return nope + 2 * rope, 8 * _ceil(_ceil(nope, 64), 8)
    if encoding in ("e4m3+f32/128", "e4m3+ue8m0x4/128"):
        return width, 4 * _ceil(width, 128)
    raise KeyError(f"unknown row encoding {encoding!r}; known: {sorted(ENCODINGS)}")


@dataclass(frozen=True, kw_only=True)
class RowFormat:
    """One kind of row: its encoding and how the engine arranges such rows in a page.

    Attributes:
        encoding: a key of `ENCODINGS`.
        page_arrangement: "interleaved" (each slot's data then its scales) or "block-split"
            (a page's data rows, then its scale rows), one of `ARRANGEMENTS`.
    """

    encoding: str
    page_arrangement: str = "interleaved"

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS or self.page_arrangement not in ARRANGEMENTS:
            raise ValueError(f"row format {self.encoding!r} / {self.page_arrangement!r}: known encodings "
                             f"{sorted(ENCODINGS)}, arrangements {list(ARRANGEMENTS)}")

    @property
    def block_split(self) -> bool:
        """Whether the engine's pages hold every slot's data before every slot's scales."""
        return self.page_arrangement == "block-split"


@dataclass(frozen=True, kw_only=True)
class RecordLayout:
    """The byte layout of a geometry's rows: the model's own, or an engine's record kept byte for byte.

    Attributes:
        name: the layout's short name, the suffix of its geometry's name (`<model>+<name>`).
        engine: who writes these rows ("" for the model's own rows, else "sglang" / "vllm").
        setting: the engine setting that selects it, as an operator writes it.
        arch: the GPU architecture family it is written on ("any", "sm90", "sm100").
        kv, indexer, window: the compressed-KV, indexer-key and window (SWA) row formats.
    """

    name: str
    engine: str
    setting: str
    arch: str
    kv: RowFormat
    indexer: RowFormat
    window: RowFormat

    @property
    def native(self) -> bool:
        """Whether these are the model's own rows (the layout every engine and kvstore.Client shares)."""
        return self.engine == ""

    def to_dict(self) -> dict[str, object]:
        """A canonical, JSON-ready description: what the fingerprint of a non-native layout covers."""
        return {"name": self.name, "engine": self.engine, "setting": self.setting, "arch": self.arch,
                **{kind: {"encoding": f.encoding, "page_arrangement": f.page_arrangement,
                          "meaning": ENCODINGS[f.encoding]}
                   for kind, f in (("kv", self.kv), ("indexer", self.indexer), ("window", self.window))}}


def fingerprint(geometry_description: dict[str, object], records: RecordLayout) -> bytes:
    """The 8-byte key scope of a geometry in `records` (`ModelGeometry.fingerprint`): the one place a
    layout enters storage keys and chain roots.

    The model's own rows keep the fingerprint they always had (a SHA-256 of the geometry's
    canonical description alone), so their stored blocks stay hits; any other layout adds its
    description under a prefix of its own, so no two layouts share a key.
    """
    canon = json.dumps(geometry_description, sort_keys=True, separators=(",", ":")).encode()
    if records.native:
        return hashlib.sha256(b"kvstore.geometry.v2\0" + canon).digest()[:8]
    layout = json.dumps(records.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"kvstore.layout.v1\0" + canon + b"\0" + layout).digest()[:8]


_NATIVE_KV = RowFormat(encoding="e2m1+e4m3/16")
_V4_ROW = RowFormat(encoding="e4m3-nope+bf16-rope+ue8m0/64", page_arrangement="block-split")

#: The model's own rows (docs/CODEC.md): what kvstore.Client, the replay worker and every engine that
#: keeps them (SGLang v41/v41_new, vLLM nvfp4_ds_mla with an MXFP4 indexer) store and share.
MODEL_NATIVE = RecordLayout(name="model", engine="", setting="", arch="any", kv=_NATIVE_KV,
                            indexer=RowFormat(encoding="e2m1+ue8m0/32"), window=RowFormat(encoding="e4m3+ue8m0/32"))

#: SGLang 0.5.23's default DeepSeek-V4 layout on every GPU (SGLANG_DSV4_KV_LAYOUT=v4, or auto off SM100):
#: 584-B compressed-KV and window rows (FP4-fake-quantized latent written as FP8 NoPE + BF16 RoPE), block-split
#: pages; its FP4 indexer rows are 68 B, in 64-slot index pages.
SGLANG_V4 = RecordLayout(name="sglang-v4", engine="sglang", setting="SGLANG_DSV4_KV_LAYOUT=v4", arch="any",
                         kv=_V4_ROW, indexer=RowFormat(encoding="e2m1+ue8m0/32", page_arrangement="block-split"),
                         window=_V4_ROW)

#: vLLM 0.33.0's `--kv-cache-dtype fp8_ds_mla` (its default) off SM100: the 584-B V4 record of the raw latent for
#: compressed KV and the window, and the FP8 indexer row (128 E4M3 + a float32 scale), all block-split.
VLLM_FP8_DS_MLA_SM90 = RecordLayout(
    name="vllm-fp8_ds_mla-sm90", engine="vllm", setting="--kv-cache-dtype fp8_ds_mla", arch="sm90", kv=_V4_ROW,
    indexer=RowFormat(encoding="e4m3+f32/128", page_arrangement="block-split"), window=_V4_ROW)

#: vLLM 0.33.0's `--kv-cache-dtype fp8_ds_mla` on SM100: 528-B MXFP8 records (RoPE quantized too), each token's
#: scales after its values, and the FP8 indexer row with its scale as four UE8M0 bytes (block-split).
VLLM_FP8_DS_MLA_SM100 = RecordLayout(
    name="vllm-fp8_ds_mla-sm100", engine="vllm", setting="--kv-cache-dtype fp8_ds_mla", arch="sm100",
    kv=RowFormat(encoding="e4m3+ue8m0/32"),
    indexer=RowFormat(encoding="e4m3+ue8m0x4/128", page_arrangement="block-split"),
    window=RowFormat(encoding="e4m3+ue8m0/32"))

#: vLLM 0.33.0's `--kv-cache-dtype nvfp4_ds_mla` (SM100 only) with its default FP8 indexer: the model's compressed
#: and window rows, but a 132-B FP8 indexer row (scale as four UE8M0 bytes), so blocks of their own.
VLLM_NVFP4_DS_MLA_FP8_INDEXER = RecordLayout(
    name="vllm-nvfp4_ds_mla-fp8-indexer", engine="vllm", setting="--kv-cache-dtype nvfp4_ds_mla", arch="sm100",
    kv=_NATIVE_KV, indexer=RowFormat(encoding="e4m3+ue8m0x4/128", page_arrangement="block-split"),
    window=RowFormat(encoding="e4m3+ue8m0/32"))

#: The engine layouts a server serves beside the model's own rows, for every geometry it knows.
ENGINE_LAYOUTS: tuple[RecordLayout, ...] = (SGLANG_V4, VLLM_FP8_DS_MLA_SM90, VLLM_FP8_DS_MLA_SM100,
                                            VLLM_NVFP4_DS_MLA_FP8_INDEXER)

#: Every layout by name.
LAYOUTS: dict[str, RecordLayout] = {r.name: r for r in (MODEL_NATIVE, *ENGINE_LAYOUTS)}


def geometry_name(model: str, records: RecordLayout) -> str:
    """The served geometry name of model geometry `model` in `records` (the model's own name when native)."""
    return model if records.native else f"{model}+{records.name}"


__all__ = ["ARRANGEMENTS", "ENCODINGS", "ENGINE_LAYOUTS", "LAYOUTS", "MODEL_NATIVE", "SGLANG_V4",
           "VLLM_FP8_DS_MLA_SM90", "VLLM_FP8_DS_MLA_SM100", "VLLM_NVFP4_DS_MLA_FP8_INDEXER", "RecordLayout",
           "RowFormat", "fingerprint", "geometry_name", "row_sizes"]
