"""Export a tenant's cache to a file, or import one: to move a tenant or warm a new node.

The file is on the SERVER's disk (the server writes and reads it while it keeps
serving): give an absolute path there. An export writes zstandard-compressed,
checksummed frames of blocks (gateway/tenant_export.py) and refuses a path
that exists; an import checks every frame before it writes any block, so a
damaged or cut file is refused whole, naming the frame. Both need a token with
the "admin" right (--token or $KVSTORE_TOKEN) and are audited.

Examples:
  kvstore export --tenant acme --file /var/lib/kvstore/export/acme.kvx
  scp node1:/var/lib/kvstore/export/acme.kvx node2:/var/lib/kvstore/export/
  kvstore import --file /var/lib/kvstore/export/acme.kvx --target node2:50051
  kvstore import --file /var/lib/kvstore/export/acme.kvx --tenant acme-copy --json
"""

from __future__ import annotations

import argparse
import json
from pathlib import PurePosixPath

from kvstore.commands.admin_call import add_connection_arguments, admin_client, progress
from kvstore.counted import counted
from kvstore.errors import InvalidArgument

#: Seconds an export or import may take by default: a 1 TB tenant at about 1 GB/s.
DEFAULT_TIMEOUT_S = 3600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kvstore export` or `kvstore import` (whichever `parser` is)."""
    exporting = parser.prog.split()[-1] == "export"
    parser.add_argument("--tenant", required=exporting, default="",
                        help="the tenant to export" if exporting
                        else "the tenant to import into (default: the one the file was exported from)")
    parser.add_argument("--file", required=True, metavar="PATH",
                        help="absolute path of the file on the server's disk"
                        + (" (must not exist)" if exporting else ""))
    add_connection_arguments(parser, timeout_s=DEFAULT_TIMEOUT_S)
    parser.set_defaults(direction="export" if exporting else "import")


def run(args: argparse.Namespace) -> int:
    """Ask the server to export or import, print the counts."""
    if not PurePosixPath(args.file).is_absolute():
        raise InvalidArgument(f"--file {args.file!r} is not absolute: it names a file on the server's disk",
                              hint="give the full path on the server, e.g. /var/lib/kvstore/export/acme.kvx")
    with admin_client(args) as admin:
        if args.direction == "export":
            with progress(args, f"exporting tenant {args.tenant} to {args.file}"):
                reply = admin.export_tenant(args.tenant, args.file)
            out = {"tenant": args.tenant, "file": args.file, "records": int(reply.records), "bytes": int(reply.bytes)}
            line = (f"tenant {args.tenant}: {counted(out['records'], 'block')} exported to {args.file} "
                    f"({counted(out['bytes'], 'byte')})")
        else:
            with progress(args, f"importing {args.file}"):
                reply = admin.import_tenant(args.tenant, args.file)
            out = {"tenant": args.tenant or None, "file": args.file, "records": int(reply.records),
                   "written": int(reply.written)}
            line = (f"{args.file}: {counted(out['records'], 'block')} read, {out['written']:,} written "
                    f"({out['records'] - out['written']:,} already stored or not served here)")
    print(json.dumps(out) if args.json else line)
    return 0
