"""Generate the Python wire code from proto/ into kvstore/v1/ (the only generator).

Usage: python scripts/gen_proto.py [--out DIR]

The generated package kvstore.v1 holds nothing hand-written; a test regenerates
into a temporary folder and fails when the committed files are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out: Path) -> list[Path]:
    """Run protoc over every .proto under proto/, writing into `out`; return the files."""
    from grpc_tools import protoc  # dev dependency, imported only here

    out.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={out}", f"--grpc_python_out={out}", f"--pyi_out={out}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    pkg = out / "kvstore" / "v1"
    (pkg / "__init__.py").write_text('"""Generated wire code for kvstore.v1: do not edit (scripts/gen_proto.py)."""\n')
    return sorted(pkg.iterdir())


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repo)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
