"""Settings: defaults, TOML, environment, flags, in that order; bad values named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.config import load_settings
from kvstore.errors import ConfigError


def test_copy_threads_default_follows_the_cpu_count() -> None:
    assert load_settings(environ={}).transfer.copy_threads == min(8, max(1, (os.cpu_count() or 1) - 1))


def test_defaults_need_nothing() -> None:
    s = load_settings(environ={})
    assert s.server.port == 50051 and s.store.retention_hours == 72 and s.store.block_tokens == 64


def test_precedence_toml_env_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text('[server]\nport = 6000\nhost = "0.0.0.0"\n[store]\ncapacity_bytes = 1000\nretention_hours = 100\n')
    s = load_settings(cfg, environ={"KVSTORE_SERVER_PORT": "7000"}, overrides={"server": {"port": 8000}})
    assert (s.server.port, s.server.host) == (8000, "0.0.0.0")
    assert (s.store.capacity_bytes, s.store.retention_hours) == (1000, 100.0)
    s = load_settings(cfg, environ={"KVSTORE_SERVER_PORT": "7000"}, overrides={"server": {"port": None}})
    assert s.server.port == 7000


def test_config_file_from_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text("[store]\nblock_tokens = 128\n")
    assert load_settings(environ={"KVSTORE_CONFIG": str(cfg)}).store.block_tokens == 128


@pytest.mark.parametrize(("text", "match"), [
    ("[store]\nretention_hours = 24\n", "below the 72-hour"),
    ("[store]\ncolour = 1\n", "unknown setting"),
    ("[cache]\nx = 1\n", "unknown config section"),
    ("[server]\nport = 'abc'\n", "cannot read 'abc'"),
    ("[store]\nblock_tokens = 60\n", "multiple of 8"),
    ("[transfer]\ncopy_threads = 0\n", "copy_threads must be positive"),
])
def test_bad_values_are_named(tmp_path: Path, text: str, match: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_settings(cfg, environ={})


@pytest.mark.parametrize("name", ["kvstore.toml", "kvstore-redis-cluster.toml"])
def test_deploy_configs_load(name: str) -> None:
    path = Path(__file__).resolve().parents[2] / "deploy" / name
    s = load_settings(path, environ={})
    assert s.server.host == "0.0.0.0" and s.store.retention_hours >= 72
