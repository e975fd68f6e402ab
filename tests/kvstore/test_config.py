"""Settings: defaults, TOML, environment, flags, in that order; bad values named."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from kvstore.config import (
    NON_NEGATIVE,
    ServerSettings,
    Settings,
    StoreSettings,
    SwaSettings,
    TransferSettings,
    load_settings,
)
from kvstore.errors import ConfigError

SECTIONS = {"server": ServerSettings, "store": StoreSettings, "swa": SwaSettings, "transfer": TransferSettings}


def _numeric_fields() -> list[tuple[str, str, str]]:
    """(section, field, 'int' or 'float') for every numeric setting of every section."""
    out = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.type in ("int", "float"):
                out.append((section, f.name, str(f.type)))
    return out


NUMERIC = _numeric_fields()


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
    ("[store]\nretention_hours = 24\n",
     r"retention_hours = 24.0 is out of range: allowed \[72, 876000\]; the 72-hour guarantee may only be raised"),
    ("[store]\ncolour = 1\n", "unknown setting"),
    ("[cache]\nx = 1\n", "unknown config section"),
    ("[server]\nport = 'abc'\n", "cannot read 'abc'"),
    ("[store]\nblock_tokens = 60\n", "multiple of 8"),
    ("[transfer]\ncopy_threads = 0\n", r"transfer.copy_threads = 0 is out of range: allowed \[1, 256\]"),
    ("[store]\nretention_hours = nan\n", r"store.retention_hours = nan is out of range: allowed \[72, "),
    ("[store]\nretention_hours = inf\n", r"store.retention_hours = inf is out of range"),
    ("[server]\nport = 99999\n", r"server.port = 99999 is out of range: allowed \[0, 65535\]"),
    ("[server]\nport = 1.5\n", "cannot read 1.5 as int"),
    ("[server]\nport = true\n", "cannot read True as int"),
    ("[server]\ngrace_s = false\n", "cannot read False as float"),
    ("[store]\ncapacity_bytes = inf\n", "cannot read inf as int"),
    ("[store]\ncapacity_bytes = 1e400\n", "cannot read inf as int"),
    ("[swa]\nconfigure_redis = 'maybe'\n", "cannot read 'maybe' as bool"),
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


def test_every_numeric_setting_has_a_range() -> None:
    """A new numeric field gets an explicit range (its RANGES entry), not only the finite, >= 0 default."""
    missing = [f"{section}.{name}" for section, name, _ in NUMERIC if name not in SECTIONS[section].RANGES]
    assert not missing, f"add these to their section's RANGES: {missing}"
    assert len(NUMERIC) >= 22 and {s for s, _, _ in NUMERIC} == set(SECTIONS)


def _refused(section: str, name: str, value: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(environ={}, overrides={section: {name: value}})
    return info.value.message


@pytest.mark.parametrize(("section", "name", "kind"), NUMERIC)
def test_every_numeric_setting_refuses_values_out_of_range(section: str, name: str, kind: str) -> None:
    allowed = SECTIONS[section].RANGES.get(name, NON_NEGATIVE)
    below = allowed.lo if allowed.lo_open else allowed.lo - (1 if kind == "int" else 0.001)
    above = allowed.hi + 1 if kind == "int" else allowed.hi * 1.001 + 1
    for bad in (below, above):
        value = int(bad) if kind == "int" else float(bad)
        message = _refused(section, name, value)
        assert message.startswith(f"{section}.{name} = {value!r} is out of range: allowed {allowed}")
    # The edge itself passes the range (another rule, such as one across fields, may still refuse it).
    edge = allowed.hi if allowed.lo_open else allowed.lo
    try:
        load_settings(environ={}, overrides={section: {name: int(edge) if kind == "int" else edge}})
    except ConfigError as exc:
        assert "is out of range" not in exc.message


@pytest.mark.parametrize(("section", "name", "kind"), NUMERIC)
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_nan_and_infinity_are_refused_everywhere(section: str, name: str, kind: str, bad: str) -> None:
    """From the environment (strings) and from code (floats straight into the dataclass)."""
    with pytest.raises(ConfigError, match=re.escape(f"{section}.{name}")):
        load_settings(environ={f"KVSTORE_{section.upper()}_{name.upper()}": bad})
    with pytest.raises(ConfigError, match=re.escape(f"{section}.{name} = {float(bad)!r} is out of range")):
        SECTIONS[section](**{name: float(bad)})


def test_nan_retention_cannot_shorten_the_guarantee() -> None:
    """Issue 9 item 6: nan compared false against the floor and let fresh blocks go."""
    with pytest.raises(ConfigError, match=r"store\.retention_hours = nan"):
        StoreSettings(retention_hours=float("nan"))
    assert Settings().store.retention_hours == 72
