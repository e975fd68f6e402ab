"""One settings object for the whole service, loaded from TOML and the environment.

Precedence, lowest first: the sections' defaults, the TOML file (`--config` or
KVSTORE_CONFIG), environment variables `KVSTORE_<SECTION>_<FIELD>` (for example
KVSTORE_STORE_CAPACITY_BYTES=2e9), then command-line flags given to the entry
point. Only entry points read the environment; components receive their section.

The sections themselves are in kvstore/config_sections.py and the range check in
kvstore/config_ranges.py; their names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config_ranges import MAX_BYTES, NON_NEGATIVE, UINT32_MAX, Range, check_ranges
from kvstore.config_sections import (
    BULK_TRANSPORTS,
    RETENTION_FLOOR_HOURS,
    AuthSettings,
    EventsSettings,
    FleetSettings,
    GiB,
    MetricsSettings,
    ServerSettings,
    StoreSettings,
    SwaSettings,
    TlsSettings,
    TraceSettings,
    TransferSettings,
)
from kvstore.errors import ConfigError

__all__ = [
    "BULK_TRANSPORTS", "MAX_BYTES", "NON_NEGATIVE", "RETENTION_FLOOR_HOURS", "UINT32_MAX", "AuthSettings",
    "EventsSettings", "FleetSettings", "GiB",
    "MetricsSettings", "Range", "ServerSettings", "Settings", "StoreSettings", "SwaSettings", "TlsSettings",
    "TraceSettings", "TransferSettings", "check_ranges", "load_settings",
]


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every section of the service's configuration."""

    server: ServerSettings = field(default_factory=ServerSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    swa: SwaSettings = field(default_factory=SwaSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    tls: TlsSettings = field(default_factory=TlsSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    fleet: FleetSettings = field(default_factory=FleetSettings)
    events: EventsSettings = field(default_factory=EventsSettings)
    trace: TraceSettings = field(default_factory=TraceSettings)


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _coerce(value: Any, target: type | str, name: str) -> Any:
    kind = target if isinstance(target, str) else target.__name__
    try:
        if "Path" in kind:
            return Path(value)
        if kind in ("int", "float") and isinstance(value, bool):
            raise ValueError("a boolean is not a number")
        if kind == "int":
            number = float(value) if isinstance(value, str) else value
            if isinstance(number, float) and not number.is_integer():
                raise ValueError("not a whole number")  # int() would truncate it, and fails on nan/inf
            return int(number)
        if kind == "float":
            return float(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if str(value).lower() not in _TRUE | _FALSE:
                raise ValueError("not a boolean")
            return str(value).lower() in _TRUE
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: cannot read {value!r} as {kind}") from None


def _section(cls: type, name: str, values: Mapping[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(fields)
    if unknown:
        raise ConfigError(f"unknown setting(s) in [{name}]: {', '.join(sorted(unknown))}")
    kwargs = {k: _coerce(v, fields[k].type, f"{name}.{k}") for k, v in values.items()}
    return cls(**kwargs)


def load_settings(
    path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Settings:
    """Build the settings from defaults, a TOML file, the environment and overrides.

    Args:
        path: a TOML file; None reads KVSTORE_CONFIG if set.
        environ: the environment (defaults to os.environ).
        overrides: {section: {field: value}} from command-line flags; None values are ignored.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, a value out of range.
    """
    environ = os.environ if environ is None else environ
    merged: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(Settings)}
    path = path or (Path(environ["KVSTORE_CONFIG"]) if environ.get("KVSTORE_CONFIG") else None)
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        for section, values in data.items():
            if section not in merged or not isinstance(values, dict):
                raise ConfigError(f"unknown config section [{section}] in {path}")
            merged[section].update(values)
    for section in merged:
        prefix = f"KVSTORE_{section.upper()}_"
        for key, value in environ.items():
            if key.startswith(prefix):
                merged[section][key[len(prefix):].lower()] = value
    for section, values in (overrides or {}).items():
        merged[section].update({k: v for k, v in values.items() if v is not None})
    sections = typing.get_type_hints(Settings)
    return Settings(**{s: _section(sections[s], s, v) for s, v in merged.items()})
