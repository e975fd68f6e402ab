"""Builds the one native module, `tiers._blockcopy` (everything else is in pyproject.toml).

It is optional: without a C compiler the install still succeeds and the tier
uses the Python form of the same loop (`tiers.blockcopy`), at lower speed.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tiers._blockcopy",
            sources=["tiers/_blockcopy.c"],
            include_dirs=["third_party/xxhash"],
            depends=["third_party/xxhash/xxhash.h"],
            extra_compile_args=["-O3"],
            py_limited_api=True,
            optional=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
