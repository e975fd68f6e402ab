"""`kvstore bench load` runs end to end in its short form and prints its figures (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_load_json_figures() -> None:
    run = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "load", "--json", "--seconds", "2",
                          "--clients", "2", "--prompt-blocks", "4"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["bench"] == "load"
    figures = {f["name"]: f for f in report["figures"]}
    rpcs = {f"{rpc} p{pct}" for rpc in ("lookup", "get", "put") for pct in (50, 99)}
    assert {"lookup -> get -> put cycles per second", "block bytes moved (get + put)", *rpcs} <= figures.keys()
    for name in ("lookup -> get -> put cycles per second", *rpcs):
        f = figures[name]
        assert set(f) == {"name", "value", "unit", "baseline", "baseline_value", "ratio"}
        assert f["value"] > 0 and f["baseline_value"] > 0 and f["baseline"].startswith("raw gRPC echo")
    assert figures["put p99"]["unit"] == "ms" and figures["put p99"]["value"] >= figures["put p50"]["value"]
    p50 = figures["get p50"]
    assert p50["ratio"] == p50["baseline_value"] / p50["value"]  # a time: above 1 is faster than the baseline
    assert figures["server RSS before"]["unit"] == "MiB" and figures["server RSS after"]["value"] > 0
    notes = report["notes"]
    assert notes["clients"] == 2 and notes["cycles"]["kvstore"] > 0 and notes["cycles"]["raw"] > 0
    assert notes["errors"] == 0 and notes["lookup_misses"] == 0  # every cycle found its stored half
    assert notes["refreshes_exercised"] is False  # 2 s: no block reached R5's refresh (60 s after its Put)
    assert set(notes["server_memory_mib"]["after"]) == {"VmRSS", "RssAnon", "RssFile"}
    assert notes["server_memory_mib"]["samples"][0][0] == 0.0  # sampled from the start of the load
    for rpc in ("lookup", "get", "put"):  # issue 25 item 4: the spread of every call, beside the echo's
        spread = figures[f"{rpc} p99 / p50"]
        assert spread["unit"] == "x" and spread["value"] >= 1.0 and spread["baseline_value"] >= 1.0
        # How much of each call was its client waiting for a CPU (/proc's schedstat), and the spread without it.
        wait = figures[f"{rpc} client run-queue wait p99"]
        assert wait["unit"] == "ms" and wait["value"] >= 0 and wait["baseline_value"] >= 0
        assert wait["value"] <= figures[f"{rpc} p99"]["value"] * 10  # a part of calls that long, not a clock's garbage
        net = figures[f"{rpc} p99 / p50, the client's run-queue wait taken out"]
        assert net["unit"] == "x" and net["value"] >= 1.0 and net["baseline_value"] >= 1.0
    assert figures["errors"]["value"] == 0 and figures["errors"]["baseline_value"] == 0
    for side in ("server", "client"):  # what a cycle costs in CPU on each side, against the echo's
        cpu = figures[f"{side} CPU per cycle"]
        assert cpu["unit"] == "ms" and cpu["value"] > 0 and cpu["baseline_value"] > 0
    loop = figures["server event-loop thread CPU per cycle"]  # the loop's thread alone: a part of the whole
    assert loop["unit"] == "ms" and 0 < loop["value"] <= figures["server CPU per cycle"]["value"]
    assert 0 < loop["baseline_value"] <= figures["server CPU per cycle"]["baseline_value"]
    assert figures["server anonymous RSS after"]["value"] > 0
    waited = figures["server run-queue wait per cycle"]  # the server's threads' wait for a CPU, each side
    assert waited["unit"] == "ms" and waited["value"] >= 0 and waited["baseline_value"] >= 0
    # Every cycle's Put writes a new chain, and the Puts waiting behind a commit share the next: at most one commit
    # a Put (LMDB's own count of write transactions over the load, read beside the server).
    commits = figures["server commits per Put"]
    assert commits["unit"] == "x" and 0 < commits["value"] <= 1.0
    assert notes["server_commits_per_s"] > 0


def test_bench_load_client_counts_are_checked() -> None:
    run = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "load", "--clients", "16,x"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--clients takes counts like 16 or 16,64" in run.stderr


def test_bench_load_soak_samples_the_server_memory() -> None:
    # A 3 s "soak" sampled every half second: the settled growth is reported, the samples span the load.
    run = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "load", "--json", "--seconds", "1",
                          "--soak-minutes", "0.05", "--rss-every-s", "0.5", "--clients", "2", "--prompt-blocks", "4"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    figures = {f["name"]: f for f in report["figures"]}
    samples = report["notes"]["server_memory_mib"]["samples"]
    assert len(samples) >= 4 and samples[0][0] == 0.0 and samples[-1][0] >= 3.0
    assert all(set(m) == {"VmRSS", "RssAnon", "RssFile"} for _, m in samples)
    growth = figures["server anonymous RSS growth after the first tenth"]
    assert growth["unit"] == "MiB"
    settled = [m["RssAnon"] for t, m in samples if t >= 0.3]  # past the first tenth
    assert growth["value"] == round(settled[-1] - settled[0], 1)
    assert report["notes"]["cycles"]["kvstore_seconds"] >= 3.0  # the kvstore side ran the soak's time
    load = report["notes"]["load_average"]
    assert len(load["before"]) == 3 and len(load["after"]) == 3


def test_latencies_less_the_client_wait() -> None:
    from kvstore.bench.load import _net, _Side

    def side(latencies: list[float], waits: list[float]) -> _Side:
        return _Side(seconds=1.0, cycles=len(latencies), latencies_s={"lookup": latencies}, errors=0, misses=0,
                     client_cpu_s=0.0, server_cpu_s=None, server_loop_cpu_s=None, memory=[],
                     client_waits_s={"lookup": waits})

    assert _net(side([0.010, 0.030], [0.002, 0.025]), "lookup") == pytest.approx([0.008, 0.005])
    assert _net(side([0.010, 0.030], [0.002]), "lookup") is None  # a wait not read for every call: no figure
    assert _net(side([0.001], [0.004]), "lookup") == [1e-9]  # never below zero


def test_call_clock_counts_the_wait_for_a_cpu() -> None:
    # In a child pinned to one CPU beside two busy processes pinned to the same CPU, the child's own busy loop gets
    # about a third of it: the clock's wait (time runnable, not running) outgrows the child's CPU time, which it
    # would equal if the clock read the time on the CPU instead.
    child = r"""
import os, subprocess, sys, time
from kvstore.bench.harness import process_run_queue_s
from kvstore.bench.load import _CallClock
cpu = sorted(os.sched_getaffinity(0))[0]
os.sched_setaffinity(0, {cpu})
hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
try:
    clock = _CallClock()
    clock.find_threads()
    used, process_waited = time.thread_time(), process_run_queue_s(os.getpid())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        clock.timed(lambda: sum(range(10000)))
        if sum(clock.waits) > 0.3:
            break
    print(all(w >= 0 for w in clock.waits), round(sum(clock.waits), 4), round(time.thread_time() - used, 4),
          round(process_run_queue_s(os.getpid()) - process_waited, 4))
finally:
    for hog in hogs:
        hog.kill()
"""
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    ok, waited, on_cpu, process_waited = run.stdout.split()
    assert ok == "True" and float(waited) > 0.3
    assert float(waited) > 1.3 * float(on_cpu)
    assert float(process_waited) >= 0.9 * float(waited)  # the server's figure reads the same field of every thread
