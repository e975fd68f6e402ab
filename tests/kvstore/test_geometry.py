"""The V4.1-Flash geometry reproduces the brief's numbers exactly."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from kvstore import geometry
from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH


def test_v4_1_flash_numbers() -> None:
    assert V4_1_FLASH.bytes_per_token == 890
    assert V4_1_FLASH.entries_per_token == 2.5
    assert {g.entry_bytes for g in V4_1_FLASH.global_layers} == {356}
    main, index = V4_1_FLASH.global_layers[0].components
    assert (main.value_bytes, main.scale_bytes, main.entry_bytes) == (256, 32, 288)
    assert (index.value_bytes, index.scale_bytes, index.entry_bytes) == (64, 4, 68)
    assert [g.tokens_per_entry for g in V4_1_FLASH.global_layers] == [2, 2, 2, 1]
    assert V4_1_FLASH.block_bytes(1_000_000) == 890_000_000  # 1M tokens = 0.89 GB
    assert V4_1_FLASH.swa_snapshot_bytes == 40 * 128 * 512


def test_block_bytes_follow_tokens() -> None:
    assert V4_1_FLASH.block_bytes(64) == 64 * 890
    with pytest.raises(InvalidArgument, match="multiple of 2"):
        V4_1_FLASH.block_bytes(63)


def test_layout_tiles_the_block() -> None:
    sections = V4_1_FLASH.block_layout(64)
    assert sections[0].offset == 0
    for a, b in itertools.pairwise(sections):
        assert b.offset == a.offset + a.size_bytes
    assert sections[-1].offset + sections[-1].size_bytes == V4_1_FLASH.block_bytes(64)
    assert sections[0].entries == 32 and sections[-1].entries == 64  # encoder 2 tok/entry, decoder 1


def test_fingerprint_tells_layouts_apart() -> None:
    other = dataclasses.replace(V4_1_FLASH, swa_channels=256)
    assert other.fingerprint != V4_1_FLASH.fingerprint
    assert dataclasses.replace(V4_1_FLASH).fingerprint == V4_1_FLASH.fingerprint


def test_resolve_names_the_known_profiles() -> None:
    assert geometry.resolve("") is V4_1_FLASH
    with pytest.raises(InvalidArgument, match="unknown geometry 'nope'"):
        geometry.resolve("nope")
