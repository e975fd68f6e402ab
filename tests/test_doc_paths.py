"""Every repository path the docs and the CLI's help texts name exists in the repository.

A clone holds only the repository: a doc or a `--help` that points to a file
outside it (a sibling folder, one machine's absolute path) leaves its reader with
nothing. The paths checked: relative Markdown links; words that start with one of
the repository's top-level folders (`kvstore/codec/rows.py`, `../deploy/`); and
the names of Markdown pages (`FORMAT.md`), which must be one of the repository's
pages. A path in another project is written `owner/name:path` or as a URL, and is
not checked. Help texts are gathered in-process from `kvstore.cli.build_parser`:
the top level, every command and every benchmark.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli import LAZY_COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]

#: The documents a new user reads.
DOCS = sorted([ROOT / "README.md", ROOT / "deploy" / "README.md", *(ROOT / "docs").glob("*.md")])

#: Top-level folders of the repository: a word starting with one of them names a repository path.
TOP_FOLDERS = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
                     and p.name not in ("kvstore.egg-info", "build", "dist"))

#: A word naming a repository path: a top-level folder, then path characters. Not preceded by a
#: path character, ':' (another project's `owner/name:path`) or '.' (a module name, a URL's host).
_PATH = re.compile(r"(?<![\w/.:~$-])((?:\.\./)*(?:" + "|".join(map(re.escape, TOP_FOLDERS)) + r")/[\w./*-]*)")
#: A Markdown page's name (`FORMAT.md`, `docs/FORMAT.md`, `../shared/V41_FORMAT.md`).
_PAGE = re.compile(r"(?<![\w.:-])((?:[\w.-]+/)*[A-Z][A-Z0-9_]*\.md)\b")
#: A relative Markdown link target.
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
#: Absolute paths of a build machine or a home folder: never right in a doc.
_MACHINE = re.compile(r"(?<![\w.:/-])/(?:work|home|root|Users)/[\w./-]+")

#: Folders a documented command creates, with the command: they exist only once it ran.
MADE_BY_COMMANDS: dict[str, str] = {"deploy/docker/certs": "deploy/docker/make-test-certs.sh"}

PAGES = {p.name for p in ROOT.glob("*.md")} | {p.name for p in (ROOT / "docs").glob("*.md")} | {
    p.name for p in (ROOT / "deploy").glob("*.md")}


def _exists(word: str, base: Path) -> bool:
    """Whether the path `word` (possibly a glob) names something in the repository, read from `base`."""
    word = word.rstrip(".,;:")
    if word.rstrip("/") in MADE_BY_COMMANDS:
        return True
    module, _, attribute = word.partition(".")
    if attribute and attribute[:1].isupper():  # `gateway/transfer_engine.Copier`: a module's class
        word = module + ".py"
    for start in (base, ROOT):
        if any(ch in word for ch in "*?["):
            if any(start.glob(word)):
                return True
        elif (start / word).exists():
            return True
    return False


def missing_paths(text: str, base: Path) -> list[str]:
    """The repository paths, pages and links `text` names that do not exist (read from `base`)."""
    missing = [w for w in _PATH.findall(text) if not _exists(w, base)]
    missing += [w for w in _PAGE.findall(text) if Path(w).name not in PAGES or (
        "/" in w and not _exists(w, base))]
    missing += [link for link in _LINK.findall(text) if "://" not in link and not link.startswith("mailto:")
                and not _exists(link, base)]
    missing += _MACHINE.findall(text)
    return sorted(set(missing))


def _parsers(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:  # argparse keeps its subcommands here; there is no public accessor
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def help_texts() -> dict[str, str]:
    """Each parser's own texts (description, epilog, every argument's help), by command line.

    Read before formatting: argparse's wrapping may break a path at a hyphen.
    """
    texts: dict[str, str] = {}
    for argv in ([], *([name] for name in LAZY_COMMANDS), ["bench"]):
        for name, parser in _parsers(build_parser(argv), "kvstore"):
            if argv and name.split()[1:2] != argv:
                continue  # only the command this argv loaded whole
            parts = [parser.description or "", parser.epilog or ""]
            parts += [str(a.help) for a in parser._actions if a.help and a.help != argparse.SUPPRESS]
            texts[name] = "\n".join(parts)
    return texts


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    missing = missing_paths(doc.read_text(), doc.parent)
    assert not missing, f"{doc.relative_to(ROOT)} names paths the repository does not have: {missing}"


def test_every_path_a_help_text_names_exists() -> None:
    texts = help_texts()
    assert {"kvstore", "kvstore serve", "kvstore worker", "kvstore bench store"} <= set(texts)
    missing = {name: m for name, text in texts.items() if (m := missing_paths(text, ROOT))}
    assert not missing, f"help texts name paths the repository does not have: {missing}"


def test_the_check_finds_a_path_outside_the_repository() -> None:
    # The three ways the docs once pointed outside the repository, each caught.
    assert missing_paths("the format facts are in `../shared/V41_FORMAT.md`", ROOT / "docs") == [
        "../shared/V41_FORMAT.md"]
    assert missing_paths("sources in /work/shared/V41_FORMAT.md", ROOT / "docs") == [
        "/work/shared/V41_FORMAT.md", "work/shared/V41_FORMAT.md"]
    assert missing_paths("'tiny' (the V41_FORMAT.md fixture)", ROOT) == ["V41_FORMAT.md"]
    assert missing_paths("see `kvstore/codec/nothing.py` and [x](NOPE.md)", ROOT / "docs") == [
        "NOPE.md", "kvstore/codec/nothing.py"]
    assert missing_paths("see `kvstore/codec/rows.py`, [x](FORMAT.md), `tiers/swa_*.py`, "
                         "`ztxz16/fastllm:docs/deepseek_v41.md`, `gateway/transfer_engine.Copier`", ROOT / "docs") == []
