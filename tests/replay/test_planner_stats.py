"""Usable-token stats: planners report their plans (ReportResume), the server checks and counts
them, `kvstore stats` shows them. Real server on loopback."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from kvstore.cli import main
from kvstore.client import Client
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.v1 import kvstore_pb2 as pb
from replay.plan import Action
from replay.planner import Planner


def report(client: Client, **fields: Any) -> grpc.RpcError | None:
    """A raw ReportResume; the error it got, or None."""
    request = pb.ReportResumeRequest(**{"prompt_tokens": 100, "found_tokens": 64, "usable_tokens": 64,
                                        "action": pb.RESUME_ACTION_BOUNDED_REPLAY, **fields})
    try:
        client.connection.kvstore.ReportResume(request, timeout=10)
    except grpc.RpcError as exc:
        return exc
    return None


@pytest.mark.parametrize(("fields", "says"), [
    ({"action": pb.RESUME_ACTION_UNSPECIFIED}, "not a known resume action"),
    ({"action": 99}, "not a known resume action"),
    ({"prompt_tokens": 0, "found_tokens": 0, "usable_tokens": 0}, "prompt_tokens must be in [1, "),
    ({"prompt_tokens": 65537 * 16, "found_tokens": 0, "usable_tokens": 0,
      "action": pb.RESUME_ACTION_FULL_PREFILL}, "prompt_tokens must be in [1, 1048591]"),
    ({"found_tokens": 101}, "found_tokens 101 exceeds prompt_tokens 100"),
    ({"usable_tokens": 65}, "usable_tokens 65 exceeds found_tokens 64"),
    ({"action": pb.RESUME_ACTION_FULL_PREFILL}, "a full prefill serves no tokens from cache"),
    ({"usable_tokens": 0}, "usable_tokens must be at least 1"),
    ({"namespace": "no spaces"}, "namespace"),
    ({"geometry": "llama-7b"}, "unknown geometry"),
])
def test_report_resume_refuses_bad_reports(client: Client, fields: dict[str, Any], says: str) -> None:
    error = report(client, **fields)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in (error.details() or "")
    assert client.stats().resume_plans == 0


def test_report_resume_counts_plans_by_action(client: Client) -> None:
    assert report(client) is None
    client.report_resume(prompt_tokens=50, found_tokens=32, usable_tokens=0, action="full-prefill")
    client.report_resume(prompt_tokens=200, found_tokens=160, usable_tokens=159, action="fetch+snapshot")
    client.report_resume(prompt_tokens=6000, found_tokens=5280, usable_tokens=5280, action="exact-replay")
    s = client.stats()
    assert (s.resume_plans, s.resume_prompt_tokens, s.resume_found_tokens, s.resume_usable_tokens) == (
        4, 6350, 5536, 5503)
    assert (s.resume_fetch_snapshot_plans, s.resume_bounded_replay_plans, s.resume_exact_replay_plans,
            s.resume_full_prefill_plans) == (1, 1, 1, 1)


def test_report_resume_client_checks_before_sending(client: Client) -> None:
    with pytest.raises(InvalidArgument, match="unknown resume action"):
        client.report_resume(prompt_tokens=1, found_tokens=0, usable_tokens=0, action="prefill")
    with pytest.raises(InvalidArgument, match="usable_tokens"):
        client.report_resume(prompt_tokens=1, found_tokens=0, usable_tokens=-1, action="full-prefill")
    with pytest.raises(InvalidArgument, match="usable_tokens 2 exceeds"):  # the server's check, raised
        client.report_resume(prompt_tokens=5, found_tokens=1, usable_tokens=2, action="bounded-replay")
    future = client.report_resume(prompt_tokens=5, found_tokens=1, usable_tokens=2, action="bounded-replay",
                                  wait=False)
    assert isinstance(future.exception(timeout=10), InvalidArgument)


def test_the_planner_reports_each_plan_without_waiting(client: Client) -> None:
    b = client.block_tokens
    tokens = list(range(20 * b + 5))
    client.put(tokens[: 20 * b], [os.urandom(client.block_bytes) for _ in range(20)])
    with Planner(client) as planner:
        assert planner.plan(tokens).action is Action.BOUNDED_REPLAY
        assert planner.plan(list(range(5000, 5100))).action is Action.FULL_PREFILL
    s = client.stats()
    assert (s.resume_plans, s.resume_prompt_tokens, s.resume_found_tokens, s.resume_usable_tokens) == (
        2, 425, 320, 320)
    assert (s.resume_bounded_replay_plans, s.resume_full_prefill_plans) == (1, 1)
    assert planner.background_errors == 0


def test_close_waits_for_the_reports_in_flight(server: Any, client: Client) -> None:
    """A process that plans, closes and exits still has every plan counted."""
    with Client(server.target) as own, Planner(own) as planner:
        for i in range(20):
            planner.plan(list(range(i, i + 40)))
    s = client.stats()
    assert (s.resume_plans, s.resume_full_prefill_plans) == (20, 20)


def test_report_failures_are_counted_never_raised(start_server: Callable[..., Any], store_settings: Any,
                                                  loop_thread: Any, caplog: pytest.LogCaptureFixture) -> None:
    server = start_server(store_settings)
    client = Client(server.target, timeout_s=2)
    with Planner(client, report=False) as planner:
        plan = planner.plan(list(range(100)))
        loop_thread.run(server.stop(0))
        planner.report(plan)
        planner.release("no-such-lease")
    assert planner.background_errors == 2
    assert "ReportResume failed" in caplog.text and "release of lease no-such-lease failed" in caplog.text
    with pytest.raises(Unavailable):
        planner.plan(list(range(100)))
    client.close()


def test_kvstore_stats_shows_the_usable_hit_rate(server: Any, client: Client,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    client.report_resume(prompt_tokens=400, found_tokens=320, usable_tokens=300, action="fetch+snapshot")
    client.report_resume(prompt_tokens=100, found_tokens=32, usable_tokens=0, action="full-prefill")
    assert main(["stats", "--target", server.target, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["resume_usable_hit_rate"] == pytest.approx(0.6)
    assert (data["resume_plans"], data["resume_prompt_tokens"], data["resume_usable_tokens"]) == (2, 500, 300)
    assert (data["resume_fetch_snapshot_plans"], data["resume_full_prefill_plans"]) == (1, 1)
    assert main(["stats", "--target", server.target]) == 0
    out = capsys.readouterr().out
    assert "Resume plans (planner reports)" in out
    assert "Usable hit rate (usable / prompt tokens)" in out and "60.0%" in out
    assert "Found hit rate (found / prompt tokens)" in out and "70.4%" in out
