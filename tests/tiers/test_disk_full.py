"""A Put that the disk cannot take (full; here a file-size limit) fails cleanly and stores nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    from kvstore.config import StoreSettings
    from kvstore.errors import ResourceExhausted
    from kvstore.geometry import V4_1_FLASH
    from kvstore.prefix import BlockScope, chain_hashes, root_hash
    from tiers.lmdb_tier import LmdbBlockTier
    d = Path(sys.argv[1])
    tier = LmdbBlockTier(StoreSettings(data_dir=d, capacity_bytes=1 << 26, block_tokens=16))
    scope, root = BlockScope(V4_1_FLASH.fingerprint, "default"), root_hash(V4_1_FLASH.fingerprint, 16)
    h = chain_hashes(list(range(16 * 40)), block_tokens=16, parent=root)
    tier.put(scope, root, h[:1], [b"a" * 4096], True)
    limit = (d / "data.mdb").stat().st_size + 8192
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        tier.put(scope, h[0], h[1:40], [b"b" * 65536] * 39, False)
        print("stored")
    except ResourceExhausted as exc:
        print("refused:", exc)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("after:", tier.lookup(scope, h)[0], tier.stats().blocks_stored, tier.stats().counters.rejected_puts)
    tier.put(scope, h[0], h[1:3], [b"c" * 4096] * 2, False)
    print("then:", tier.lookup(scope, h)[0])
    tier.close()
""")


def test_a_put_the_disk_cannot_take_is_refused_and_stores_nothing(tmp_path: Path) -> None:
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "store")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path}, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("refused:") and "refused the write" in lines[0], run.stdout
    assert lines[1:] == ["after: 1 1 1", "then: 3"]
