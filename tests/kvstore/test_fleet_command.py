"""`kvstore fleet drain NODE`'s naming of a node (kvstore/commands/fleet.py, docs/FLEET.md F85): a member's id or a
prefix of exactly one; anything else is refused with the ids it could have meant, before etcd is written."""

from __future__ import annotations

import pytest

from kvstore.commands.fleet import resolve_node
from kvstore.errors import InvalidArgument, NotFound

A, B, C = "6f1c" + "0" * 28, "6f2d" + "1" * 28, "9a00" + "2" * 28


def test_a_whole_id_or_a_prefix_of_one_names_that_node() -> None:
    assert resolve_node(A, [A, B], cluster="x") == A
    assert resolve_node("6f1", [A, B], cluster="x") == A
    assert resolve_node("9", [A, B], [C], cluster="x") == C  # a drained node's id, for --cancel


def test_an_id_that_is_the_start_of_another_is_that_node_itself() -> None:
    assert resolve_node("6f1c", [A, "6f1c"], cluster="x") == "6f1c"


def test_a_prefix_of_several_ids_names_them_all() -> None:
    with pytest.raises(InvalidArgument, match=f"start of 2 node ids in fleet 'x': {A}, {B}"):
        resolve_node("6f", [B, A], cluster="x")


def test_an_id_no_node_has_is_not_found_and_lists_the_members() -> None:
    with pytest.raises(NotFound, match=f"no node 'ab' in fleet 'x' \\(its members: {A}, {B}\\)"):
        resolve_node("ab", [B, A], [C], cluster="x")
    with pytest.raises(NotFound, match="its members: none"):
        resolve_node("ab", [], cluster="x")


def test_an_empty_name_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="NODE is empty"):
        resolve_node("", [A], cluster="x")
