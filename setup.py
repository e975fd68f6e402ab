"""Builds the native modules, `kvstore.native._blockcopy` and `kvstore.native._ring` (the rest: pyproject.toml).

Both are optional: without a C compiler the install still succeeds and the
Python forms stand in, at lower speed (`kvstore.native.blockcopy`'s loop; the request
ring's Python server in `gateway/transfer_ring.py`).
"""

from setuptools import Extension, setup

_HEADERS = ["third_party/xxhash/xxhash.h", "kvstore/native/_xxh3.h", "kvstore/native/_lmdb_search.h"]

setup(
    ext_modules=[
        Extension(
            "kvstore.native._blockcopy",
            sources=["kvstore/native/_blockcopy.c"],
            include_dirs=["third_party/xxhash", "kvstore/native"],
            depends=[*_HEADERS, "kvstore/native/_swa_digest.h"],
            extra_compile_args=["-O3"],
            py_limited_api=True,
            optional=True,
        ),
        Extension(  # the chain hashes in one call (kvstore.prefix): OpenSSL's SHA-256, as hashlib's
            "kvstore.native._chainhash",
            sources=["kvstore/native/_chainhash.c"],
            libraries=["crypto"],
            extra_compile_args=["-O3"],
            py_limited_api=True,
            optional=True,
        ),
        Extension(
            "kvstore.native._ring",
            sources=["kvstore/native/_ring.c"],
            include_dirs=["third_party/xxhash", "kvstore/native"],
            depends=[*_HEADERS, *(f"kvstore/native/_ring_{h}.h" for h in ("wire", "words", "ask"))],
            extra_compile_args=["-O3"],
            py_limited_api=True,
            optional=True,
        ),
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
