"""Which record layout vLLM's caches are in (kvstore.layout), read from vLLM's own settings at attach time.

vLLM 0.33.0 (models/deepseek_v41/attention.py, v1/attention/backends/mla/indexer.py):

- `--kv-cache-dtype fp8_ds_mla` (DeepSeek-V4.1's default): off the SM100 family, the 584-B V4
  record for compressed KV and the window (`_use_v41_mxfp8_kv_record()` false), block-split pages;
  on SM100, the 528-B MXFP8 record, interleaved. The indexer key is FP8 (132 B: 128 E4M3 and a
  power-of-two scale, a float32 off SM100 and four UE8M0 bytes on it, `mqa_logits_use_mx_scales`),
  block-split; `indexer_kv_dtype=mxfp4` exists only on SM100 and is not served with fp8_ds_mla.
- `--kv-cache-dtype nvfp4_ds_mla` (SM100 only): the model's own compressed and window rows; with
  the default FP8 indexer a layout of its own, with `indexer_kv_dtype=mxfp4` the model's rows.
- `auto` / `fp8` on a DeepSeek-V4 model: vLLM resolves it per attention backend inside the worker,
  after the scheduler's connector is made, so both sides could disagree on the layout: refused,
  naming the setting. On other models the cache dtype is the model's rows, as before.

Each refusal is a ConfigError that names the setting and what is served instead.
"""

from __future__ import annotations

from typing import Any

from kvstore import layout
from kvstore.errors import ConfigError
from kvstore.layout import RecordLayout

#: Model types whose vLLM attention keeps DeepSeek's packed records.
DEEPSEEK_V4 = ("deepseek_v4", "deepseek_v41")
SERVED = "--kv-cache-dtype fp8_ds_mla (FP8 indexer) or nvfp4_ds_mla"


def sm100_family() -> bool:
    """vLLM's own test for the V4.1 records and MX-scaled indexer (`current_platform`, capability 10.x)."""
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_device_capability_family(100))
    except Exception:  # no GPU platform (a CPU host): not SM100, as vLLM itself decides there
        return False


def records_of(vllm_config: Any, *, sm100: bool | None = None) -> RecordLayout:
    """The record layout of vLLM's caches under `vllm_config` (`sm100`: the architecture, default vLLM's).

    Raises:
        ConfigError: a combination vLLM may resolve differently in its workers, or one not served.
    """
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    attention = getattr(vllm_config, "attention_config", None)
    indexer = str(attention.resolve_indexer_kv_dtype("fp8")) if attention is not None else "fp8"
    on_sm100 = sm100_family() if sm100 is None else sm100
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    model_type = str(getattr(hf, "model_type", ""))
    if cache_dtype == "fp8_ds_mla":
        if indexer != "fp8":
            raise ConfigError(f"vLLM's indexer_kv_dtype={indexer} with --kv-cache-dtype fp8_ds_mla is not served by "
                              "kvstore: leave indexer_kv_dtype at fp8 (its default), or use --kv-cache-dtype "
                              "nvfp4_ds_mla with indexer_kv_dtype=mxfp4 for the model's own rows")
        return layout.VLLM_FP8_DS_MLA_SM100 if on_sm100 else layout.VLLM_FP8_DS_MLA_SM90
    if cache_dtype == "nvfp4_ds_mla":
        return layout.MODEL_NATIVE if indexer == "mxfp4" else layout.VLLM_NVFP4_DS_MLA_FP8_INDEXER
    if model_type in DEEPSEEK_V4 and cache_dtype in ("auto", "fp8"):
        raise ConfigError(f"vLLM's --kv-cache-dtype {cache_dtype} on {model_type} is resolved per attention backend "
                          "inside each worker, after the kvstore connector starts, so the record layout its blocks "
                          f"are keyed by is not known yet: set it explicitly ({SERVED})")
    return layout.MODEL_NATIVE


def arrangement(records: RecordLayout, component: str) -> bool:
    """Whether vLLM's pages of `component` ("compressed_kv", "indexer", "window") are block-split."""
    fmt = {"compressed_kv": records.kv, "indexer": records.indexer, "window": records.window}[component]
    return fmt.block_split
