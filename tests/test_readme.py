"""The README's code blocks, run as written (issue 12 item 7).

Every fenced block of README.md is covered, and `COVERAGE` says how: "run" blocks
execute against real processes (`kvstore serve` and `kvstore worker` children on
free ports, over data dirs in tmp_path); "parse" blocks (installs, the test
script, benchmarks that take minutes) have each `kvstore` command they name
parsed by the real `kvstore.cli.build_parser`, so a renamed flag fails here too.
A block added to the README without an entry fails `test_every_block_is_covered`.

Only what the README itself names as placeholders is substituted: the engine's
data (`prompt_token_ids`, `kv_rows`, `index_rows`, `window_rows`, `tail`, given
as names defined before a block runs, never by editing its text), the addresses
`127.0.0.1:50051` / `127.0.0.1:50061` (the servers' real ports), `/tmp/` and
`./kvstore-data` (this test's folder). Python blocks run in a fresh interpreter
that has imported nothing the block does not import itself.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
SERVER, WORKER = "127.0.0.1:50051", "127.0.0.1:50061"
PLACEHOLDERS = ("prompt_token_ids", "kv_rows", "index_rows", "window_rows", "tail")
START_DEADLINE_S = 90.0


@dataclass(frozen=True)
class Block:
    heading: str
    lang: str
    index: int  # among the blocks of its language under its heading
    text: str

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.heading, self.lang, self.index)


def readme_blocks() -> list[Block]:
    """Every fenced block of the README, with the heading it sits under."""
    blocks: list[Block] = []
    heading = ""
    lines = README.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        elif line.startswith("```") and line[3:].strip():
            lang, body = line[3:].strip(), []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            index = sum(1 for b in blocks if (b.heading, b.lang) == (heading, lang))
            blocks.append(Block(heading, lang, index, "\n".join(body) + "\n"))
        i += 1
    return blocks


def block(heading: str, lang: str, index: int = 0) -> Block:
    return next(b for b in readme_blocks() if b.key == (heading, lang, index))


#: How each block is covered: "run" by the test named, "parse" by test_every_kvstore_command_parses.
COVERAGE = {
    ("Run it", "sh", 0): "parse",
    ("Test it", "sh", 0): "parse",
    ("A worker, in a few lines", "python", 0): "run: test_worker_and_swa_examples_run",
    ("Sliding-window state and bulk transfers", "python", 0): "run: test_worker_and_swa_examples_run",
    ("Resume a conversation: the planner and the worker", "sh", 0): "run: test_resume_section_runs",
    ("Resume a conversation: the planner and the worker", "python", 0): "run: test_resume_section_runs",
    ("Watch it", "sh", 0): "run (stats, check) and parse (bench): test_watch_it_runs",
    ("Watch it", "json", 0): "run: test_the_json_error_is_what_stats_prints",
    ("Run it for many tenants", "sh", 0): "run: test_many_tenants_runs",
}


def test_every_block_is_covered() -> None:
    assert {b.key for b in readme_blocks()} == set(COVERAGE)


def kvstore_commands(text: str) -> list[list[str]]:
    """The argv of every `kvstore ...` command in a shell block (comments, `&`, `&&` chains handled)."""
    found = []
    for line in text.splitlines():
        line = re.sub(r"^.*\$\((kvstore [^)]*)\).*$", r"\1", line.split(" #")[0])  # VAR=$(kvstore ...)
        for part in re.split(r"&&|;|(?<!&)&(?!&)", line):
            words = shlex.split(part)
            if words and words[0] == "kvstore":
                found.append(words[1:])
    return found


def test_every_kvstore_command_parses() -> None:
    commands = [argv for b in readme_blocks() if b.lang == "sh" for argv in kvstore_commands(b.text)]
    assert len(commands) >= 23  # every `kvstore` line was found
    for argv in commands:
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit:
            pytest.fail(f"README: `kvstore {shlex.join(argv)}` does not parse")
    assert (README.parent / "scripts" / "test.sh").is_file()  # the "Test it" block


# -- real processes --


class Child:
    """A `kvstore serve` or `kvstore worker` child that prints "listening on HOST:PORT"."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", *argv], stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_env())
        deadline = time.monotonic() + START_DEADLINE_S
        while not (match := re.search(r"listening on ([\d.]+:\d+)", log.read_text())):
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        self.target = match.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in reversed(started):
        child.stop()


def substitute(text: str, tmp: Path, addresses: dict[str, str]) -> str:
    """The README's own placeholders for addresses and folders, filled in."""
    for written, real in addresses.items():
        text = text.replace(written, real)
    return (text.replace("/tmp/", f"{tmp}/").replace("/var/lib/kvstore/", f"{tmp}/")
            .replace("./kvstore-data", str(tmp / "kvstore-data")))


def with_target(line: str, target: str) -> str:
    """`line` with `--target target` added to its kvstore command when it takes one and names none
    (the README's commands use the default, 127.0.0.1:50051)."""
    command = line.split(" #")[0].rstrip()
    for argv in kvstore_commands(command):
        if "--data-dir" in argv:  # works on a data dir, not a server (`kvstore tenant` takes etcd:// there)
            continue
        if "--target" not in argv and hasattr(build_parser(argv).parse_args(argv), "target"):
            return f"{command} --target {target}"
    return command


def run_sh_line(line: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["bash", "-c", line], cwd=tmp, capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 0, f"README line `{line}` failed:\n{done.stdout}\n{done.stderr}"
    return done


#: Run before a Python block, in its own namespace: the placeholders the README names, and nothing else.
#: The engine's arrays come as torch tensors or as numpy arrays (the same values), at an even or an odd T.
_PLACEHOLDER_DATA = """
def _placeholders(kind, T, first_token):
    import numpy as np
    from kvstore.geometry import V4_1_FLASH as g
    rng = np.random.default_rng(T)

    def data(shape, dtype):
        a = (rng.integers(0, 256, shape, dtype=np.uint8) if dtype == "uint8"
             else rng.standard_normal(shape, dtype=np.float32))
        if kind == "numpy":
            return a
        import torch
        return torch.from_numpy(a)

    return {"prompt_token_ids": list(range(first_token, first_token + T)),
            "kv_rows": {l: data((T // g.compress_ratios[l], 288), "uint8") for l in g.kv_source_layers},
            "index_rows": {l: data((T // g.compress_ratios[l], 68), "uint8") for l in g.kv_source_layers},
            "window_rows": data((g.num_layers, min(T, g.window), g.window_row_bytes), "uint8"),
            "tail": data((len(g.ratio2_source_layers), 2, g.head_dim), "float32") if T % 2 else None}
"""


@dataclass(frozen=True)
class Placeholders:
    """What the engine's names are filled with: `kind` "torch" or "numpy", prompt length `length`."""

    kind: str = "torch"
    length: int = 256
    first_token: int = 1000

    def call(self) -> str:
        return f"_placeholders({self.kind!r}, {self.length}, {self.first_token})"


def run_python(blocks: list[str], postlude: str, tmp: Path, name: str,
               placeholders: Placeholders = Placeholders()) -> dict[str, object]:
    """Run blocks one after another in one fresh namespace; `postlude` prints a JSON of what to check.

    The postlude also sees `given`: the placeholders as they were before the blocks ran
    (a block may rebind one: the SWA block's `rows, tail = ...`).
    """
    script = tmp / f"{name}.py"
    sources = json.dumps(json.dumps(blocks))
    check = json.dumps("import json\n" + postlude)
    script.write_text(f"""{_PLACEHOLDER_DATA}
import json
_given = {placeholders.call()}
_g = {{"__name__": "__readme__", **_given}}
for _src in json.loads({sources}):
    exec(compile(_src, "README.md", "exec"), _g)
exec({check}, {{**_g, "given": _given}})
""")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp, capture_output=True, text=True, timeout=120,
                          env=_env())
    assert done.returncode == 0, f"{name}: the README's blocks failed:\n{done.stdout}\n{done.stderr}"
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    result["stdout"] = done.stdout
    return result


def test_the_readme_names_its_placeholders() -> None:
    text = README.read_text()
    for name in PLACEHOLDERS:
        assert f"`{name}`" in text.split("Placeholders:", 1)[1].split("\n\n", 1)[0], name


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    """One `kvstore serve` for every run of the worker example (each stores its own prompt)."""
    folder = tmp_path_factory.mktemp("readme-serve")
    server = Child(["serve", "--port", "0", "--data-dir", str(folder / "kv")], folder / "serve.log")
    yield server
    server.stop()


DATA_KINDS = ("torch", "numpy")
#: Four full 64-token blocks; the odd length adds one token past them, and the snapshot's raw tail.
LENGTHS = (256, 257)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("kind", DATA_KINDS)
def test_worker_and_swa_examples_run(readme_server: Child, tmp_path: Path, kind: str, length: int) -> None:
    # Each run's prompt starts at its own token, so no run hits another's blocks or snapshot.
    first_token = 1000 * (1 + DATA_KINDS.index(kind) * len(LENGTHS) + LENGTHS.index(length))
    fill = {SERVER: readme_server.target}
    worker = substitute(block("A worker, in a few lines", "python").text, tmp_path, fill)
    swa = substitute(block("Sliding-window state and bulk transfers", "python").text, tmp_path, fill)
    # The worker's block twice (a miss that stores the prompt's blocks, then a hit that loads
    # them), then the SWA block; the postlude checks what each left behind, against `given`.
    postlude = """
import numpy as np
last = max(kv_rows)
same = lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b)))
print(json.dumps({
    "kinds": sorted({type(a).__module__.split(".")[0] for pair in given_rows for a in pair}),
    "hit_blocks": hit_after_worker.found_blocks, "found_tokens": hit_after_worker.found_tokens,
    "loaded_rows_equal": same(np.asarray(kv).reshape(-1, 288), np.asarray(kv_rows[last])[: kv.shape[0] * kv.shape[1]]),
    "loaded_index_equal": same(np.asarray(index).reshape(-1, 68),
                               np.asarray(index_rows[last])[: index.shape[0] * index.shape[1]]),
    "swa_position": hit.swa_position, "window_rows_equal": same(rows, given["window_rows"]),
    "tail_given": given["tail"] is not None,
    "tail_equal": (tail is None) if given["tail"] is None else (tail is not None and same(tail, given["tail"])),
    "fetched_bytes": state.bytes_moved, "block_bytes": client.block_bytes}))
"""
    keep_hit = "hit_after_worker = hit\ngiven_rows = [new_rows[layer] for layer in new_rows]\n"
    got = run_python([worker, worker, keep_hit, swa], postlude, tmp_path, "worker",
                     Placeholders(kind, length, first_token))
    assert got["kinds"] == [kind]  # the engine's rows reached join_blocks as the kind under test
    assert got["hit_blocks"] == 4 and got["found_tokens"] == 256
    assert got["loaded_rows_equal"] and got["loaded_index_equal"]
    assert got["window_rows_equal"] and got["tail_given"] == (length % 2 == 1) and got["tail_equal"]
    assert got["swa_position"] == SWA_POSITION[length]
    assert got["fetched_bytes"] == 4 * int(got["block_bytes"])  # type: ignore[call-overload]


#: What the lookup's `swa_positions=[T]` finds: at T = 256 the snapshot, which the four found blocks
#: reach; at T = 257 none, as the README's comment says: the found blocks end at 256, and a snapshot at
#: an odd T serves only T itself (kvstore.swa_snapshot.serves, resume_length).
SWA_POSITION: dict[int, int | None] = {256: 256, 257: None}


def test_resume_section_runs(children: list[Child], tmp_path: Path) -> None:
    fill: dict[str, str] = {}
    for line in block("Resume a conversation: the planner and the worker", "sh").text.splitlines():
        command = line.split(" #")[0].strip()
        if command.endswith("&"):  # a server: started on a free port instead of the written one
            argv = shlex.split(substitute(command[:-1], tmp_path, fill))[1:]
            written = argv[argv.index("--port") + 1]
            argv[argv.index("--port") + 1] = "0"
            child = Child(argv, tmp_path / f"{argv[0]}.log")
            children.append(child)
            fill[f"127.0.0.1:{written}"] = child.target
        else:
            out = run_sh_line(substitute(command, tmp_path, fill), tmp_path)
    assert set(fill) == {SERVER, WORKER}
    assert "chose full-prefill" in out.stdout  # the plan of a prompt never stored
    python = substitute(block("Resume a conversation: the planner and the worker", "python").text, tmp_path, fill)
    got = run_python([python], 'print(json.dumps({"vocab": list(logits.shape)}))', tmp_path, "resume")
    assert str(got["stdout"]).startswith("fetch+snapshot 64 ")  # the hit the README's comment promises
    assert got["vocab"] == [128]


def test_watch_it_runs(children: list[Child], tmp_path: Path) -> None:
    data = tmp_path / "kvstore-data"
    server = Child(["serve", "--port", "0", "--data-dir", str(data)], tmp_path / "serve.log")
    children.append(server)
    lines = [line.split(" #")[0].strip() for line in block("Watch it", "sh").text.splitlines()]
    checks = [line for line in lines if line.startswith("kvstore check")]
    for line in (line for line in lines if line.startswith("kvstore stats")):
        out = run_sh_line(substitute(line, tmp_path, {SERVER: server.target}), tmp_path).stdout
        assert "--json" not in line or json.loads(out)["capacity_bytes"] > 0
        assert "--json" in line or f"kvstore at {server.target}" in out
    run_sh_line(substitute(checks[0], tmp_path, {}), tmp_path)  # read-only, beside the server
    server.stop()
    for line in checks[1:]:  # --repair: the server stopped, as the README says
        run_sh_line(substitute(line, tmp_path, {}), tmp_path)
    assert len(checks) == 2


def test_the_json_error_is_what_stats_prints(tmp_path: Path) -> None:
    written = json.loads(block("Watch it", "json").text)["error"]
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "stats", "--json", "--target", "127.0.0.1:1",
                           "--timeout", "5"], capture_output=True, text=True, timeout=60, env=_env())
    printed = json.loads(done.stdout)["error"]
    assert done.returncode == 2 and set(printed) == set(written)
    assert {k: printed[k] for k in ("code", "type", "hint", "retryable")} == \
        {k: written[k] for k in ("code", "type", "hint", "retryable")}
    assert printed["message"].startswith(written["message"].split("...")[0].rstrip("; "))



def test_many_tenants_runs(children: list[Child], tmp_path: Path) -> None:
    """The block as one shell script (its first line exports the admin token the others use)."""
    server = Child(["serve", "--port", "0", "--data-dir", str(tmp_path / "kvstore-data")], tmp_path / "serve.log")
    children.append(server)
    lines = block("Run it for many tenants", "sh").text.splitlines()
    script = "set -e\n" + "\n".join(substitute(with_target(line, SERVER), tmp_path, {SERVER: server.target})
                                     for line in lines)
    done = run_sh_line(script, tmp_path)
    assert "auth: " in (tmp_path / "serve.log").read_text()
    out = done.stdout
    assert "tenant acme: policy changed (audited)" in out and "retention_hours" in out  # set, then the log
    assert "tenant acme: 0 blocks exported to" in out and (tmp_path / "acme.kvx").is_file()
    assert "0 blocks read, 0 written" in out and "tenant acme: 0 blocks purged" in out
    assert f"{server.target} kvstore.v1.KVStore: SERVING" in out
    assert (tmp_path / "kvstore-data" / "tenants.json").is_file()  # auth is on from the first token
