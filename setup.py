"""Builds the native modules, `tiers._blockcopy` and `tiers._ring` (everything else is in pyproject.toml).

Both are optional: without a C compiler the install still succeeds and the
Python forms stand in, at lower speed (`tiers.blockcopy`'s loop; the request
ring's Python server in `gateway/transfer_ring.py`).
"""

from setuptools import Extension, setup

_HEADERS = ["third_party/xxhash/xxhash.h", "tiers/_xxh3.h", "tiers/_lmdb_search.h"]

setup(
    ext_modules=[
        Extension(
            "tiers._blockcopy",
            sources=["tiers/_blockcopy.c"],
            include_dirs=["third_party/xxhash", "tiers"],
            depends=[*_HEADERS, "tiers/_swa_digest.h"],
            extra_compile_args=["-O3"],
            py_limited_api=True,
            optional=True,
        ),
        Extension(
            "tiers._ring",
            sources=["tiers/_ring.c"],
            include_dirs=["third_party/xxhash", "tiers"],
            depends=[*_HEADERS, "tiers/_ring_wire.h", "tiers/_ring_words.h", "tiers/_ring_ask.h"],
            extra_compile_args=["-O3"],
            py_limited_api=True,
            optional=True,
        ),
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
