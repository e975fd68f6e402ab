"""The kvstore HiCache backend's settings (SGLang's `--hicache-storage-backend-extra-config`), checked.

Every mistake is a `kvstore.errors.ConfigError` at start naming the setting, never a
silent default: an unknown name (a typo) is refused, not ignored.
"""

from __future__ import annotations

import os
from typing import Any

from integrations import sglang_keys
from kvstore.errors import ConfigError

#: Every setting the backend reads; the first three are the dynamic factory's, `interface_v1` SGLang's.
KNOWN = {"backend_name", "module_path", "class_name", "interface_v1", "target", "token", "namespace", "geometry",
         "timeout_s", "ledger_pages", "swa_ttl_s", "keep_s", "share_model_rows", "transcode_device"}


def settings(extra: dict[str, Any] | None) -> dict[str, Any]:
    """The extra config, checked: typed values, no unknown names (a typo is refused, not ignored)."""
    if not isinstance(extra, dict):
        raise ConfigError("the kvstore HiCache backend needs --hicache-storage-backend-extra-config with "
                          "at least {\"target\": \"host:port\"}")
    unknown = sorted(set(extra) - KNOWN)
    if unknown:
        raise ConfigError(f"unknown kvstore HiCache settings {unknown}; known: {sorted(KNOWN)}")
    target = extra.get("target")
    if not isinstance(target, str) or ":" not in target:
        raise ConfigError(f"extra config 'target' must be the kvstore server as 'host:port', got {target!r}")
    out: dict[str, Any] = {"target": target}
    for name in ("token", "namespace", "geometry"):
        value = extra.get(name, "")
        if not isinstance(value, str):
            raise ConfigError(f"extra config {name!r} must be a string, got {type(value).__name__}")
        out[name] = value
    out["token"] = out["token"] or os.environ.get("KVSTORE_TOKEN") or None
    for name, default, least in (("timeout_s", 30.0, 0.001), ("ledger_pages", sglang_keys.DEFAULT_LEDGER_PAGES, 1),
                                 ("swa_ttl_s", None, 0.001), ("keep_s", None, 1.0)):
        value = extra.get(name, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < least):
            raise ConfigError(f"extra config {name!r} must be a number >= {least}, got {value!r}")
        out[name] = value
    if not isinstance(out["ledger_pages"], int):
        raise ConfigError(f"extra config 'ledger_pages' must be an integer, got {out['ledger_pages']!r}")
    # SGLang v4 rows stored as the model's rows where the transcoding is exact (integrations.sglang_share).
    share = extra.get("share_model_rows", True)
    if not isinstance(share, bool):
        raise ConfigError(f"extra config 'share_model_rows' must be true or false, got {share!r}")
    out["share_model_rows"] = share
    device = extra.get("transcode_device", "cpu")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"extra config 'transcode_device' must be 'cpu' or 'cuda', got {device!r}")
    out["transcode_device"] = device
    return out


def check_tree_core() -> None:
    """Refuse SGLang's Rust radix-tree core: it hashes pages natively, past the kvstore keys
    (sglang_keys), so none of its pages could be stored; the Python core hashes through them."""
    from sglang.srt.environ import envs

    core = envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.get()
    if core != "python":
        raise ConfigError(f"SGLang's radix tree core is {core!r}; the kvstore backend needs the Python one, whose "
                          "page keys are kvstore chain hashes: set SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python")


def check_topology(config: Any) -> None:
    """Refuse a rank that holds a shard of each page: kvstore keys a page by its tokens alone, so
    every rank must hold (and store) the same bytes for it, the whole model's rows.

    Raises:
        ConfigError: KV split across TP heads (not MLA with tp_size > 1), pipeline stages, context-
            or decode-context-parallel ranks.
    """
    shards = []
    if not config.is_mla_model and config.tp_size > 1:
        shards.append(f"tp_size={config.tp_size} with per-head KV (not MLA)")
    if config.pp_size > 1:
        shards.append(f"pp_size={config.pp_size}")
    if config.attn_cp_size > 1:
        shards.append(f"attn_cp_size={config.attn_cp_size}")
    if getattr(config, "dcp_size", 1) > 1:
        shards.append(f"dcp_size={config.dcp_size}")
    if shards:
        raise ConfigError(f"this SGLang rank holds a shard of each page ({', '.join(shards)}); a kvstore block is "
                          "the whole page, keyed by its tokens alone: run SGLang with the KV replicated per rank "
                          "(MLA, no pipeline or context parallelism) to use the kvstore backend")
