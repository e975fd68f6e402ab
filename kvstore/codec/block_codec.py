"""One global-KV block as bytes: tensors of every global layer -> the geometry's layout, and back.

A block of `block_tokens` tokens holds, for each layer that writes global KV
(in the geometry's order), `block_tokens / tokens_per_entry` entries of each
component: main KV (FP4, E4M3 scale per 16 channels) and indexer key (FP4,
float32 scale per vector). `ModelGeometry.block_layout` gives the byte sections:
per layer, per component, its values then its scales, entries in token order.
Float32 scales are little-endian.

Encoding runs on the tensors' device; decoding runs where the bytes are (a CUDA
uint8 tensor decodes on the GPU). Decoded values are exact on the FP4 grid, so
encode(decode(b)) == b.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvstore.codec import fp4
from kvstore.errors import InvalidArgument
from kvstore.geometry import KVComponent, ModelGeometry, ScaleFormat

#: Per-layer tensors of one block: layer number -> component name -> tensor.
BlockTensors = Mapping[int, Mapping[str, torch.Tensor]]


@dataclass(frozen=True, kw_only=True)
class EncodedComponent:
    """The stored form of one component of one layer in a block.

    Attributes:
        values: uint8 `[entries, channels/2]`, two E2M1 codes per byte.
        scales: float8_e4m3fn `[entries, channels/16]` or float32 `[entries, 1]`.
    """

    values: torch.Tensor
    scales: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The component's values, `[entries, channels]` of `dtype`."""
        return fp4.dequantize(self.values, self.scales, dtype=dtype)


def encode_component(component: KVComponent, x: torch.Tensor) -> EncodedComponent:
    """Quantize one component's `[entries, channels]` tensor with its scale format.

    Raises:
        InvalidArgument: wrong dtype or channels; NaN or Inf.
    """
    if component.scale_format is ScaleFormat.E4M3_PER_16:
        values, scales = fp4.quantize(x)
    else:
        values, scales = fp4.quantize_per_vector(x)
    return EncodedComponent(values=values, scales=scales)


def _check_tensor(x: object, *, layer: int, component: KVComponent, entries: int) -> torch.Tensor:
    expected = (entries, component.channels)
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != expected:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InvalidArgument(f"layer {layer} {component.name}: expected a tensor of shape {expected} "
                              f"[entries, channels], got {got}")
    return x


def encode_block(geometry: ModelGeometry, block_tokens: int, layers: BlockTensors) -> torch.Tensor:
    """Encode one block of global KV into the geometry's byte layout.

    Args:
        geometry: the model's cache geometry.
        block_tokens: tokens in the block, a multiple of geometry.token_alignment.
        layers: for each global-KV layer of the geometry, by layer number, each
            component's tensor `[block_tokens / tokens_per_entry, channels]` by
            name (V4.1-Flash: "main_kv" 512 and "indexer_key" 128 channels),
            float32, bfloat16 or float16, all on one device.

    Returns:
        uint8 tensor of `geometry.block_bytes(block_tokens)` on the tensors'
        device; `bytes(t.cpu().numpy())` when bytes are wanted.

    Raises:
        InvalidArgument: a missing or extra layer or component, a wrong shape or
            dtype, NaN or Inf, or a block size the geometry cannot hold.
    """
    geometry.check_block_tokens(block_tokens)
    expected_layers = [g.layer for g in geometry.global_layers]
    if sorted(layers) != expected_layers:
        raise InvalidArgument(f"block of geometry {geometry.name!r}: expected layers {expected_layers}, "
                              f"got {sorted(layers)}")
    encoded: dict[tuple[int, str], EncodedComponent] = {}
    for g in geometry.global_layers:
        names = sorted(c.name for c in g.components)
        if sorted(layers[g.layer]) != names:
            raise InvalidArgument(f"layer {g.layer}: expected components {names}, got {sorted(layers[g.layer])}")
        entries = block_tokens // g.tokens_per_entry
        for c in g.components:
            x = _check_tensor(layers[g.layer][c.name], layer=g.layer, component=c, entries=entries)
            encoded[g.layer, c.name] = encode_component(c, x)
    parts = []
    for s in geometry.block_layout(block_tokens):
        enc = encoded[s.layer, s.component]
        part = enc.values if s.part == "values" else enc.scales.view(torch.uint8)
        parts.append(part.reshape(-1))
    return torch.cat(parts)


def view_block(geometry: ModelGeometry, block_tokens: int, data: object) -> dict[int, dict[str, EncodedComponent]]:
    """The codes and scales of an encoded block, as views of `data` (no copy, no decoding).

    Args:
        geometry: the model's cache geometry.
        block_tokens: tokens in the block.
        data: bytes, bytearray, memoryview or a 1-D contiguous uint8 tensor (CPU
            or CUDA) of `geometry.block_bytes(block_tokens)`.

    Returns:
        Layer number -> component name -> EncodedComponent. Every tensor aliases
        `data`: valid while `data` is alive and unchanged (for a buffer lent by
        LMDB, only until its transaction ends: copy first to keep it longer), and
        not to be written to when `data` is read-only (bytes).

    Raises:
        InvalidArgument: wrong type or length, or a block size the geometry cannot hold.
    """
    buf = as_uint8(data, expected_bytes=geometry.block_bytes(block_tokens), what="block")
    components = {(g.layer, c.name): c for g in geometry.global_layers for c in g.components}
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for s in geometry.block_layout(block_tokens):
        c = components[s.layer, s.component]
        raw = buf[s.offset:s.offset + s.size_bytes]
        if s.part == "values":
            view = raw.view(s.entries, c.value_bytes)
        elif c.scale_format is ScaleFormat.E4M3_PER_16:
            view = raw.view(torch.float8_e4m3fn).view(s.entries, c.scale_bytes)
        else:
            view = raw.view(torch.float32).view(s.entries, 1)
        parts.setdefault((s.layer, s.component), {})[s.part] = view
    out: dict[int, dict[str, EncodedComponent]] = {}
    for (layer, name), p in parts.items():
        out.setdefault(layer, {})[name] = EncodedComponent(values=p["values"], scales=p["scales"])
    return out


def decode_block(geometry: ModelGeometry, block_tokens: int, data: object, *,
                 dtype: torch.dtype = torch.float32) -> dict[int, dict[str, torch.Tensor]]:
    """Decode an encoded block to tensors: the inverse of `encode_block` on the FP4 grid.

    Args:
        geometry: the model's cache geometry.
        block_tokens: tokens in the block.
        data: as `view_block` takes it; decoding runs on its device.
        dtype: output dtype (float32 is exact).

    Returns:
        Layer number -> component name -> `[entries, channels]` tensor (new memory).

    Raises:
        InvalidArgument: wrong type or length, or a block size the geometry cannot hold.
    """
    views = view_block(geometry, block_tokens, data)
    return {layer: {name: enc.dequantize(dtype) for name, enc in comps.items()}
            for layer, comps in views.items()}


def as_uint8(data: object, *, expected_bytes: int, what: str) -> torch.Tensor:
    """`data` as a 1-D uint8 tensor sharing its memory, after checking its length.

    Args:
        data: bytes, bytearray, memoryview (C-contiguous) or 1-D contiguous uint8 tensor.
        expected_bytes: the length it must have.
        what: how messages name it.

    Returns:
        A view of `data`, on data's device for a tensor, on the CPU otherwise. It
        keeps `data` alive but not whatever lent `data` (an LMDB transaction).

    Raises:
        InvalidArgument: wrong type, dtype, layout or length.
    """
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
            raise InvalidArgument(f"{what}: expected a 1-D contiguous uint8 tensor, got {data.dtype} "
                                  f"of shape {tuple(data.shape)}")
        buf = data
    elif isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data)
        if not view.c_contiguous:
            raise InvalidArgument(f"{what}: expected a contiguous buffer")
        if view.nbytes != expected_bytes:
            raise InvalidArgument(f"{what}: expected {expected_bytes} bytes, got {view.nbytes}")
        if not view.nbytes:  # torch.frombuffer refuses an empty buffer; there is nothing to share
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            # bytes are read-only; torch warns that writing to the tensor would be
            # undefined. The contract above forbids writing instead.
            warnings.simplefilter("ignore", UserWarning)
            buf = torch.frombuffer(view.cast("B"), dtype=torch.uint8)
    else:
        raise InvalidArgument(f"{what}: expected bytes, bytearray, memoryview or a uint8 tensor, "
                              f"got {type(data).__name__}")
    if buf.numel() != expected_bytes:
        raise InvalidArgument(f"{what}: expected {expected_bytes} bytes, got {buf.numel()}")
    return buf
