"""Delete one prompt's blocks, or a tenant's whole cache, from a running service (audited).

A prompt's blocks are named by its token ids (--tokens FILE: a JSON array, or
integers separated by spaces or commas; `-` reads stdin), with the extra keys
it was stored with, or by their chain hashes (--hashes FILE: one hex hash a
line). Every block stored below them goes too, so no block is left whose parent
is gone (R6). --all deletes the tenant's whole cache, every geometry. Nothing
is deleted without --yes. Needs a token with the "admin" right (--token or
$KVSTORE_TOKEN); a server without tenants on a loopback bind needs none.

Examples:
  kvstore purge --tenant acme --tokens prompt.json --yes
  kvstore purge --tenant acme --all --yes --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvstore.commands.admin_call import add_connection_arguments, admin_client, progress
from kvstore.counted import counted
from kvstore.errors import InvalidArgument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    parser.add_argument("--tenant", required=True, help="the tenant whose blocks go")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--tokens", metavar="FILE", help="a prompt's token ids (JSON array or integers; - for stdin)")
    what.add_argument("--hashes", metavar="FILE", help="chain hashes, one hex hash a line (- for stdin)")
    what.add_argument("--all", action="store_true", help="the tenant's whole cache, every geometry")
    parser.add_argument("--extra-key", action="append", default=[], metavar="KEY",
                        help="an extra key the prompt was stored with (repeat for several, in order)")
    parser.add_argument("--geometry", default="", help="geometry of the prompt's blocks (default: the server's)")
    parser.add_argument("--yes", action="store_true", help="really delete (required)")
    add_connection_arguments(parser, timeout_s=600.0)


def _read(path: str) -> str:
    return sys.stdin.read() if path == "-" else Path(path).read_text()


def parse_tokens(text: str, source: str) -> list[int]:
    """Token ids from a JSON array or integers separated by spaces or commas.

    Raises:
        InvalidArgument: no ids, or an item that is not one (named with its index).
    """
    items = text.strip().removeprefix("[").removesuffix("]").replace(",", " ").split()
    tokens = []
    for i, item in enumerate(items):
        try:
            tokens.append(int(item))
        except ValueError:
            raise InvalidArgument(f"{source}: item {i} ({item!r}) is not a token id") from None
    if not tokens:
        raise InvalidArgument(f"{source} holds no token ids")
    return tokens


def parse_hashes(text: str, source: str) -> list[bytes]:
    """32-byte chain hashes, one hex hash a line.

    Raises:
        InvalidArgument: no hashes, or a line that is not one (named with its number).
    """
    hashes = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = bytes.fromhex(line.strip())
        except ValueError:
            value = b""
        if len(value) != 32:
            raise InvalidArgument(f"{source} line {n} is not a 64-digit hex chain hash: {line.strip()[:80]!r}")
        hashes.append(value)
    if not hashes:
        raise InvalidArgument(f"{source} holds no chain hashes")
    return hashes


def run(args: argparse.Namespace) -> int:
    """Ask the server to purge, print what went."""
    if not args.yes:
        what = "the whole cache" if args.all else "the named prompt's blocks and every block below them"
        raise InvalidArgument(f"purge deletes {what} of tenant {args.tenant!r}: add --yes to go ahead")
    tokens = parse_tokens(_read(args.tokens), args.tokens) if args.tokens else None
    hashes = parse_hashes(_read(args.hashes), args.hashes) if args.hashes else None
    with admin_client(args) as admin, progress(args, f"purging tenant {args.tenant}"):
        purged = admin.purge(args.tenant, all_blocks=args.all, token_ids=tokens, block_hashes=hashes,
                             extra_keys=args.extra_key, geometry=args.geometry)
    if args.json:
        print(json.dumps({"tenant": args.tenant, "all": args.all, "purged_blocks": purged}))
    else:
        print(f"tenant {args.tenant}: {counted(purged, 'block')} purged" + (" (the whole cache)" if args.all else ""))
    return 0
