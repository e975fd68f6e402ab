"""Fixtures of the engine adapters' tests: a real `kvstore serve` child serving the tiny fixture geometry.

The engines' own skips live in the test modules (test_vllm_support.py, test_sglang_support.py):
a module whose engine cannot be imported skips with the reason, and with what
scripts/install_engines.sh wrote into VENV/engine-skip-<name>.txt when it could not install it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.children import Child, write_config

#: Tokens per store block in these tests (the tiny geometry's rows: 2,544 B per block).
STORE_BLOCK_TOKENS = 16


def engine_skip_reason(engine: str, exc: BaseException) -> str:
    """Why `engine` cannot be tested here: the import error, and the installer's note when it left one."""
    reason = f"{engine} is not importable here ({type(exc).__name__}: {exc})"
    note = Path(sys.prefix) / f"engine-skip-{engine}.txt"
    if note.exists():
        reason += f"; scripts/install_engines.sh: {note.read_text().strip()}"
    return reason


@pytest.fixture(scope="module")
def start_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Child]]:
    """`start_store()`: a new `kvstore serve` child (16-token blocks, its own data dir), killed at the end."""
    started: list[Child] = []

    def start() -> Child:
        root = tmp_path_factory.mktemp("store")
        config = write_config(root / "kvstore.toml", {"store": {"block_tokens": STORE_BLOCK_TOKENS}})
        child = Child("serve", ["serve", "--port", "0", "--host", "127.0.0.1", "--data-dir", str(root / "data"),
                                "--config", str(config)], root / "logs")
        child.data_dir = root / "data"  # type: ignore[attr-defined]  # for the direct paths' reader
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill_if_alive()
