"""rvz-bench itself: every subcommand runs briefly, its JSON has every field, its child
processes never outlive it.  No timing assertions: figures on a shared machine are noise.

Each test runs the CLI as ``python -m rvz.bench`` in a subprocess, so the test process's
implementation switch (``RVZ_NO_EXTENSIONS``) is inherited and the workers run the same
hot paths as the rest of the suite.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import rvz
import rvz.onesided
from rvz.bench import report
from rvz.bench.worker import zmq_available

# An example or a program, which the choice of hot paths does not change: scripts/test
# runs these in its compiled leg only.
pytestmark = pytest.mark.process

TINY = ["--warmup", "3", "--quiet"]
# What the workers (same interpreter, same environment) can run.
PYZMQ = zmq_available() is None
BATCH = hasattr(rvz.Node, "send_many") and hasattr(rvz.Node, "recv_many")
BASE_VARIANTS = {"socket", "streams"} | ({"zmq"} if PYZMQ else set())

TOP_LEVEL = {"tool", "schema", "command", "argv", "options", "started_at", "machine", "versions",
             "transport", "loop", "impl", "stream", "pingpong", "rendezvous",
             "rendezvous_summary", "impl_compare", "workers", "memory", "targets", "elapsed_s",
             "pyzmq", "batch", "notes"}
STREAM_ROW = {"variant", "mode", "size", "loop", "impl", "concurrency", "label", "messages",
              "bytes", "seconds", "msgs_per_s", "gbytes_per_s", "memory", "ratio_socket",
              "ratio_streams", "baseline_socket_gbps", "baseline_streams_msgs",
              "runs_gbytes_per_s", "runs_msgs_per_s", "ratio_pyzmq", "baseline_pyzmq_msgs",
              "pattern", "batch", "in_flight"}
MEMORY = {"idle_rss", "peak_rss", "peak_above_idle", "peak_was_reset"}
PINGPONG_ROW = {"variant", "mode", "size", "loop", "impl", "concurrency", "label", "count",
                "min_us", "p50_us", "p90_us", "p99_us", "max_us", "mean_us", "samples_us",
                "ratio_socket", "ratio_streams", "baseline_socket_p50_us",
                "baseline_streams_p50_us", "runs_p50_us", "ratio_pyzmq", "baseline_pyzmq_p50_us",
                "busy_poll_us", "busy_poll_spins"}
RENDEZVOUS_ROW = {"order", "mode", "size", "rounds", "warmup_rounds", "loop", "impl",
                  "producer_waited", "consumer_waited", "recv_call_p50_us", "clock", "count",
                  "p50_us", "p90_us", "p99_us", "max_us", "samples_us"}
TORCH = importlib.util.find_spec("torch") is not None
TARGET = {"id", "target", "required", "figure", "met", "detail", "kind"}
TARGET_IDS = {"stream-send-64B-vs-pyzmq", "batch-send-64B-vs-pyzmq", "compiled-vs-python-64B",
              "one-in-flight-64B-vs-pyzmq",
              "one-in-flight-4K", "holds-previous-send", "holds-previous-recv",
              "pingpong-recv-64B", "pingpong-send-64B", "rendezvous-consumer-first",
              "stream-send-4M", "stream-send-64M", "stream-send-4K", "rendezvous-producer-first",
              "memory-64M", "into-64M-send", "into-64M-recv", "into-memory-64M-send",
              "into-memory-64M-recv", "already-sent-recv-64B"}
ONESIDED_TARGET_IDS = {f"onesided-hold-{mode}-{size}-vs-{base}" for mode in ("send", "recv")
                       for size in ("4M", "64M") for base in ("tcp", "memcpy")}


def bench(*args: str, timeout: float = 40.0,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rvz.bench", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def run_json(tmp_path: Path, *args: str, timeout: float = 40.0,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    out = tmp_path / "result.json"
    proc = bench(*args, "--json", str(out), timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the internal targets' table is printed only when asked for
    assert ("target (goal: to reach" in proc.stdout) == ("--targets" in args)
    results: dict[str, Any] = json.loads(out.read_text())
    results["_stdout"] = proc.stdout
    assert TOP_LEVEL <= set(results), TOP_LEVEL - set(results)
    # the machine's speed, measured in the run and printed with its figures
    cal = results["machine"]["calibration"]
    assert set(cal) == {"python_step_ns", "syscall_ns", "copy_gb_per_s"}, cal
    assert all(v > 0 for v in cal.values()), cal
    assert f"getppid() {cal['syscall_ns'] / 1000:.2f} us" in proc.stdout
    # a one-sided run adds the targets of its holds-previous rows against tcp and memcpy
    extra = ONESIDED_TARGET_IDS if "--transport" in args else set()
    assert {t["id"] for t in results["targets"]} == TARGET_IDS | extra
    for target in results["targets"]:
        assert TARGET <= set(target)
        assert target["met"] in (True, False, None)
        assert target["kind"] in ("goal", "keep")
    for impl, pair in results["workers"].items():
        for side in ("a", "b"):
            assert pair[side]["implementation"] == impl
    # no worker outlives the run (pids from the workers' hellos)
    pids = [pair[side]["pid"] for pair in results["workers"].values() for side in ("a", "b")
            if pair[side].get("pid")]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], "a worker outlived the CLI"
    return results


def expected_impl() -> str:
    return "python" if os.environ.get("RVZ_NO_EXTENSIONS", "") not in ("", "0") else "compiled"


@pytest.mark.timeout(40)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_stream(tmp_path: Path, loop: str) -> None:
    r = run_json(tmp_path, "stream", "--sizes", "64,80K", "--iters", "40", "--concurrency", "4",
                 "--loop", loop, *TINY)
    assert r["command"] == "stream" and r["loop"] == loop and r["impl"] == expected_impl()
    assert r["options"]["sizes"] == [64, 80 << 10]
    rows = r["stream"]
    expected = {(v, None, s) for s in (64, 80 << 10) for v in BASE_VARIANTS}
    expected |= {(v, m, s) for s in (64, 80 << 10) for m in ("send", "recv")
                 for v in (("rvz", "rvz-one") if s == 64 else ("rvz",))}  # 1 in flight: 64B, 4K
    if BATCH:  # batch rows up to 4K only
        expected |= {("rvz-batch", m, 64) for m in ("send", "recv")}
    assert {(row["variant"], row["mode"], row["size"]) for row in rows} == expected
    for row in rows:
        assert STREAM_ROW <= set(row), STREAM_ROW - set(row)
        assert MEMORY <= set(row["memory"])
        assert row["messages"] >= 40 and row["loop"] == loop
        assert row["ratio_socket"] is not None and row["ratio_streams"] is not None
        assert (row["ratio_pyzmq"] is not None) == PYZMQ
    assert r["memory"] and all(MEMORY <= set(m) for m in r["memory"])


@pytest.mark.timeout(40)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_pingpong(tmp_path: Path, loop: str) -> None:
    r = run_json(tmp_path, "pingpong", "--iters", "30", "--loop", loop, *TINY)
    rows = r["pingpong"]
    assert {(row["variant"], row["mode"]) for row in rows} == {
        (v, None) for v in BASE_VARIANTS} | {("rvz", "send"), ("rvz", "recv"), ("rvz-sent", "recv")}
    for row in rows:
        assert PINGPONG_ROW <= set(row), PINGPONG_ROW - set(row)
        assert row["count"] == 30 and row["p50_us"] > 0
    sent = next(row for row in rows if row["variant"] == "rvz-sent")
    assert sent["label"] == "rvz recv-driven, value already sent"
    target = {t["id"]: t for t in report.evaluate_targets(r)}["already-sent-recv-64B"]
    assert target["figure"] == pytest.approx(sent["ratio_streams"])
    assert r["stream"] == [] and r["rendezvous"] == []
    if PYZMQ:
        zmq = next(row for row in rows if row["variant"] == "zmq")
        assert zmq["label"] == "pyzmq REQ/REP"
        for row in rows:
            assert row["baseline_pyzmq_p50_us"] == zmq["p50_us"]
            assert row["ratio_pyzmq"] == pytest.approx(row["p50_us"] / zmq["p50_us"])
        assert r["pyzmq"] == {"used": True, "skipped": None}


@pytest.mark.timeout(40)
def test_pingpong_busy_poll_polls_the_rvz_nodes_and_the_streams_echo_only(tmp_path: Path) -> None:
    r = run_json(tmp_path, "pingpong", "--busy-poll", "150", "--mode", "send", "--iters", "30",
                 *TINY)
    assert r["options"]["busy_poll"] == 150
    assert "busy-poll 150 us: rvz nodes and pingpong's streams echo" in r["_stdout"]
    rows = {row["variant"]: row for row in r["pingpong"]}
    assert set(rows) == BASE_VARIANTS | {"rvz"}
    for variant, row in rows.items():
        if variant in ("rvz", "streams"):
            # loop passes kept awake, both sides (the workers count their own BusyPoll)
            assert row["busy_poll_us"] == 150 and row["busy_poll_spins"] > 0, row
        else:
            assert row["busy_poll_us"] == 0 and row["busy_poll_spins"] is None, row
    plain = run_json(tmp_path, "pingpong", "--mode", "send", "--iters", "20", "--no-baselines",
                     *TINY)
    (row,) = plain["pingpong"]
    assert row["busy_poll_us"] == 0 and row["busy_poll_spins"] is None
    assert "busy-poll" not in plain["_stdout"]
    bad = bench("pingpong", "--busy-poll", "-5", *TINY)
    assert bad.returncode == 2 and "--busy-poll" in bad.stderr


@pytest.mark.timeout(40)
def test_pingpong_on_pure_python_workers(tmp_path: Path) -> None:
    r = run_json(tmp_path, "pingpong", "--impl", "python", "--mode", "recv", "--no-baselines",
                 "--iters", "20", *TINY)
    assert r["impl"] == "python" and set(r["workers"]) == {"python"}
    assert {row["variant"] for row in r["pingpong"]} == {"rvz", "rvz-sent"}
    for row in r["pingpong"]:
        assert row["ratio_socket"] is None  # no baselines: no ratios, and no crash


@pytest.mark.timeout(40)
def test_rendezvous(tmp_path: Path) -> None:
    r = run_json(tmp_path, "rendezvous", "--iters", "8", "--sizes", "1K", "--targets", *TINY)
    rows = r["rendezvous"]
    assert {(row["order"], row["mode"]) for row in rows} == {
        (o, m) for o in ("producer-first", "consumer-first", "random") for m in ("send", "recv")}
    for row in rows:
        assert RENDEZVOUS_ROW <= set(row), RENDEZVOUS_ROW - set(row)
        assert row["rounds"] == 8 and row["size"] == 1024
        assert row["producer_waited"] + row["consumer_waited"] <= 1.0
        # the same rounds on a plain socket, in the same run
        assert row["baseline_socket_p50_us"] > 0
    assert {s["order"] for s in r["rendezvous_summary"]} == {"producer-first", "consumer-first", "random"}
    for summary in r["rendezvous_summary"]:
        assert summary["socket_push_over_reply_p50"] > 0
    targets = {t["id"]: t for t in r["targets"]}
    assert targets["rendezvous-producer-first"]["figure"] is not None
    assert "plain socket, same rounds" in targets["rendezvous-consumer-first"]["detail"]


@pytest.mark.timeout(40)
def test_rendezvous_without_baselines(tmp_path: Path) -> None:
    r = run_json(tmp_path, "rendezvous", "--iters", "5", "--order", "consumer-first",
                 "--no-baselines", *TINY)
    assert [row["baseline_socket_p50_us"] for row in r["rendezvous"]] == [None, None]
    (summary,) = r["rendezvous_summary"]
    assert summary["send_over_recv_p50"] > 0 and summary["socket_push_over_reply_p50"] is None


@pytest.mark.timeout(50)
def test_all_is_the_default(tmp_path: Path) -> None:
    # No subcommand: all.  Tiny sizes and one repeat keep it short; every section is filled.
    r = run_json(tmp_path, "--sizes", "64,4K", "--duration", "0.05", "--repeat", "1", *TINY,
                 timeout=50)
    assert r["command"] == "all"
    assert r["stream"] and r["pingpong"] and r["rendezvous"]
    variants = {(row["variant"], row["mode"], row["size"]) for row in r["stream"]}
    # the one-in-flight rows at 64B and 4K (Send-Driven in all), next to their baselines
    assert {("rvz-one", "send", 64), ("rvz-one", "send", 4096), ("socket", None, 4096)} <= variants
    assert (("rvz-batch", "send", 64) in variants) == BATCH
    assert (("zmq", None, 64) in variants) == PYZMQ
    one = next(row for row in r["stream"]
               if row["variant"] == "rvz-one" and row["mode"] == "send" and row["size"] == 4096)
    assert one["in_flight"] == 1 and one["label"] == "rvz send-driven 1 in flight"
    assert {t["id"]: t for t in r["targets"]}["one-in-flight-4K"]["figure"] == one["ratio_socket"]
    comp = r["impl_compare"]
    assert comp is not None and comp["mode"] == "send"
    if expected_impl() == "compiled":
        assert comp["ratio"] is not None


@pytest.mark.timeout(20)
def test_unavailable_transport_fails_clearly() -> None:
    try:
        from rvz import onesided
    except ImportError:
        pass
    else:
        if onesided.available().get("verbs") is None:
            pytest.skip("this host has RDMA verbs")
    proc = bench("stream", "--transport", "verbs", "--iters", "5")
    assert proc.returncode == 2
    assert "--transport verbs" in proc.stderr and "not available" in proc.stderr


@pytest.mark.timeout(20)
def test_bad_options_fail_clearly() -> None:
    proc = bench("stream", "--sizes", "12Q")
    assert proc.returncode == 2 and "12Q" in proc.stderr
    proc = bench("rendezvous", "--order", "sideways")
    assert proc.returncode == 2 and "sideways" in proc.stderr


def _one_line_error(proc: subprocess.CompletedProcess[str], status: int, *words: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == status and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("rvz-bench: "), proc.stderr
    assert all(w in lines[0] for w in words), lines[0]


@pytest.mark.timeout(60)
def test_bad_values_fail_before_the_run_in_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for args, words in [
        (["--sizes", "inf"], ["inf"]),                 # was an OverflowError
        (["--sizes", "1e400"], ["1e400"]),
        (["--sizes", "100G"], ["100G", "4G"]),          # was a worker's MemoryError
        (["--duration", "nan"], ["--duration"]),        # ran, and wrote NaN into the JSON
        (["--duration", "inf"], ["--duration"]),        # ran until killed
        (["--repeat", "0"], ["--repeat"]),              # ran once, as if not given
        (["--client", "--addr", "nonsense"], ["--addr", "nonsense"]),
        (["--json", str(tmp_path / "no" / "such" / "dir.json")], ["--json", "does not exist"]),
        (["--json", str(tmp_path)], ["--json", "directory"]),  # was lost after the whole run
        (["--profile", str(blocker / "prof")], ["--profile"]),  # a file in the way
    ]:
        count = [] if "--duration" in args else ["--iters", "5"]
        proc = bench("stream", "--sizes", "64", *count, *args, "--quiet", timeout=20)
        _one_line_error(proc, 2, *words)
    _one_line_error(bench("--server", "--addr", "nonsense", timeout=20), 2, "--addr", "nonsense")
    # rendezvous measured the first size only, and the JSON listed them all
    proc = bench("rendezvous", "--sizes", "64,4K", "--iters", "3", "--quiet", timeout=20)
    _one_line_error(proc, 2, "one size")


@pytest.mark.timeout(60)
def test_server_problems_are_one_line_errors() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _one_line_error(bench("--server", "--addr", f"127.0.0.1:{port}", timeout=20), 1,
                        f"127.0.0.1:{port}")
    # nobody listens there (the socket above is closed): was a ConnectionRefusedError
    proc = bench("stream", "--client", "--addr", f"127.0.0.1:{port}", "--iters", "5", "--quiet",
                 timeout=20)
    _one_line_error(proc, 1, f"127.0.0.1:{port}", "server")


@pytest.mark.timeout(60)
def test_server_survives_a_client_that_is_not_rvz_bench(tmp_path: Path) -> None:
    with _bench_server() as (server, addr):
        for junk in (b"GET / HTTP/1.0\r\n\r\n", b"[1, 2]\n", b"\xff\xfe\n"):
            with socket.create_connection(("127.0.0.1", int(addr.rsplit(":", 1)[1])), 5) as s:
                s.sendall(junk)
                s.settimeout(5)
                assert b"spawn" in s.recv(200)
        assert server.poll() is None, server.stderr.read() if server.stderr else ""
        # ... and still serves a real client
        r = run_json(tmp_path, "rendezvous", "--client", "--addr", addr, "--iters", "3",
                     "--order", "producer-first", "--mode", "send", "--no-baselines", *TINY)
        assert r["rendezvous"][0]["rounds"] == 3


def _workers(pid: int) -> set[int]:
    """The rvz-bench worker processes among ``pid``'s children (not, say, an ldconfig)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return set()
    found = set()
    for child in text.split():
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"_worker" in cmdline:
            found.add(int(child))
    return found


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_every_worker(sig: int) -> None:
    # Started as from a terminal: a shell runs background jobs (CI's among them, maybe)
    # with SIGINT ignored, children inherit that, and Python then leaves it ignored.
    proc = subprocess.Popen([sys.executable, "-m", "rvz.bench", "stream", "--sizes", "64",
                             "--duration", "30", "--no-baselines", "--mode", "send"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    try:
        workers: set[int] = set()
        deadline = time.monotonic() + 15
        while len(workers) < 2 and time.monotonic() < deadline:
            workers |= _workers(proc.pid)
            time.sleep(0.05)
        assert len(workers) == 2, "the workers did not start"
        time.sleep(1.0)  # let the case start: both workers are busy measuring
        proc.send_signal(sig)
        # communicate, not wait: the CLI and its workers write to these pipes, and a full
        # pipe must not be what this test measures
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the CLI did not exit within 15 s of signal {sig}; it printed: {err[-3000:]}")
        assert proc.returncode != 0, err
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in workers if _alive(p)], "a worker outlived the CLI"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(40)
def test_server_and_client(tmp_path: Path) -> None:
    with _bench_server() as (server, addr):
        r = run_json(tmp_path, "rendezvous", "--client", "--addr", addr, "--iters", "5",
                     "--order", "producer-first", "--mode", "send", *TINY)
        (row,) = r["rendezvous"]
        assert "two hosts" in row["clock"] and row["rounds"] == 5
        server.wait(15)
        assert server.returncode == 0, server.stderr.read() if server.stderr else ""


@contextlib.contextmanager
def _bench_server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``rvz-bench --server --once`` on a free loopback port, listening: ``(process, addr)``;
    killed at the end if it is still running."""
    addr = f"127.0.0.1:{_free_port()}"
    server = subprocess.Popen([sys.executable, "-m", "rvz.bench", "--server", "--addr", addr,
                               "--once"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_listening(server, 15)
        yield server, addr
    finally:
        if server.poll() is None:
            server.kill()
        server.communicate()


def _wait_listening(server: subprocess.Popen[str], timeout: float) -> bool:
    assert server.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = server.stderr.readline()
        if "listening" in line:
            return True
        if not line and server.poll() is not None:
            return False
    return False


@pytest.mark.timeout(40)
def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    proc = bench("pingpong", "--iters", "10", "--mode", "recv", "--plot", str(out), *TINY)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(20)
def test_plot_without_matplotlib_fails_before_the_run(tmp_path: Path) -> None:
    # A matplotlib that cannot be imported, first on the path.
    (tmp_path / "matplotlib.py").write_text("raise ImportError('matplotlib is not installed')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = tmp_path / "result.json"
    proc = bench("stream", "--sizes", "64", "--iters", "5", "--plot", str(tmp_path / "p.png"),
                 "--json", str(out), env=env)
    assert proc.returncode == 2
    assert "--plot" in proc.stderr and "rvz[plot]" in proc.stderr
    assert "cases" not in proc.stderr and not out.exists()  # nothing ran


def test_plot_draws_only_panels_with_data() -> None:
    row = {"samples_us": [1.0, 2.0]}
    assert report.plot_panels({"stream": [{"size": 64}], "pingpong": [], "rendezvous": []}) == ["stream"]
    assert report.plot_panels({"stream": [], "pingpong": [row], "rendezvous": [row]}) == [
        "pingpong", "rendezvous"]
    assert report.plot_panels({"stream": [], "pingpong": [{"samples_us": []}]}) == []


@pytest.mark.timeout(30)
def test_each_subcommand_lists_only_its_options() -> None:
    every = {"--transport", "--mode", "--sizes", "--iters", "--duration", "--warmup", "--loop",
             "--impl", "--json", "--plot", "--profile", "--quiet", "--targets", "--client",
             "--addr", "--busy-poll", "--shm-copy"}
    measured = {"--repeat", "--concurrency", "--no-baselines"}
    expected = {
        "stream": every | measured | {"--batch", "--compare-impl"},
        "pingpong": every | measured,
        "rendezvous": every | {"--order", "--no-baselines"},
        "all": every | measured | {"--batch", "--order", "--server", "--once"},
    }
    for command, options in expected.items():
        proc = bench(command, "--help")
        assert proc.returncode == 0, proc.stderr
        # the options it defines (each opens a line of the help), not those its text mentions
        listed = set(re.findall(r"^  (--[a-z][a-z-]+)", proc.stdout, re.MULTILINE)) - {"--help"}
        assert listed == options, (command, listed ^ options)


def test_sizes() -> None:
    assert report.parse_sizes("64,4K,256KiB,4M,64MB,1G") == [64, 4096, 262144, 4 << 20, 64 << 20, 1 << 30]
    assert report.size_label(4 << 20) == "4M" and report.size_label(64) == "64B"
    with pytest.raises(ValueError, match="12Q"):
        report.parse_size("12Q")
    with pytest.raises(ValueError):
        report.parse_size("0")


def test_targets_without_figures_are_not_measured() -> None:
    targets = report.evaluate_targets({"stream": [], "pingpong": [], "rendezvous_summary": []})
    assert {t["id"] for t in targets} == TARGET_IDS
    assert all(t["met"] is None for t in targets)


def test_command_may_come_after_options() -> None:
    from rvz.bench import cli

    parser = cli.build_parser()
    assert cli.command_first(parser, []) == ["all"]
    assert cli.command_first(parser, ["--order", "all", "rendezvous"]) == ["rendezvous", "--order", "all"]
    args = parser.parse_args(cli.command_first(parser, ["--loop", "asyncio", "pingpong"]))
    assert args.command == "pingpong" and args.loop == "asyncio"


def _close(x: float | None, y: float | None) -> bool:
    return x is not None and y is not None and x == pytest.approx(y)


@pytest.mark.timeout(50)
def test_stream_rows_of_each_call_pattern(tmp_path: Path) -> None:
    # Every new row at small sizes: batch (64B, 4K), one in flight (4K), holds previous
    # (256K), pyzmq PUSH/PULL; 64 messages each, whatever the lanes or the batch.
    r = run_json(tmp_path, "stream", "--sizes", "64,4K,256K", "--iters", "64", "--concurrency", "4",
                 "--batch", "8", "--mode", "send", *TINY, timeout=50)
    rows = r["stream"]
    expected = {(v, None, s) for s in (64, 4096, 262144) for v in BASE_VARIANTS}
    expected |= {("rvz", "send", s) for s in (64, 4096, 262144)}
    expected |= {("rvz-one", "send", 64), ("rvz-one", "send", 4096), ("rvz-hold", "send", 262144),
                 ("rvz-into", "send", 262144)}
    if BATCH:
        expected |= {("rvz-batch", "send", 64), ("rvz-batch", "send", 4096)}
    else:
        assert r["_stdout"].count("batch rows skipped") == 1
    assert {(row["variant"], row["mode"], row["size"]) for row in rows} == expected
    labels = {row["variant"]: row["label"] for row in rows}
    assert labels["rvz-one"] == "rvz send-driven 1 in flight"
    assert labels["rvz-hold"] == "rvz send-driven holds previous"
    assert labels["rvz-into"] == "rvz send-driven into=" + (" torch" if TORCH else "")
    for row in rows:
        assert STREAM_ROW <= set(row), STREAM_ROW - set(row)
        assert row["messages"] == 64, row
        assert row["bytes"] == 64 * row["size"]
        assert row["msgs_per_s"] == pytest.approx(row["messages"] / row["seconds"])
        assert row["gbytes_per_s"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
        base = {b["variant"]: b for b in rows if b["size"] == row["size"] and b["variant"] in BASE_VARIANTS}
        assert _close(row["ratio_socket"], row["gbytes_per_s"] / base["socket"]["gbytes_per_s"])
        assert row["baseline_socket_gbps"] == base["socket"]["gbytes_per_s"]
        if PYZMQ:
            assert _close(row["ratio_pyzmq"], row["gbytes_per_s"] / base["zmq"]["gbytes_per_s"])
            assert row["baseline_pyzmq_msgs"] == base["zmq"]["msgs_per_s"]
        else:
            assert row["ratio_pyzmq"] is None
        expect_in_flight = {"rvz-batch": 8, "rvz": 4, "rvz-hold": 4,
                            "rvz-into": 4}.get(row["variant"], 1)
        assert row["in_flight"] == expect_in_flight
    targets = {t["id"]: t for t in r["targets"]}
    hold = next(row for row in rows if row["variant"] == "rvz-hold")
    assert targets["holds-previous-send"]["figure"] == hold["ratio_socket"]
    assert targets["holds-previous-recv"]["figure"] is None  # recv mode not run
    # --batch 8, --concurrency 4: the 64-in-flight targets are not what was measured
    assert targets["stream-send-64B-vs-pyzmq"]["met"] is None
    assert targets["batch-send-64B-vs-pyzmq"]["met"] is None
    if PYZMQ:
        assert r["pyzmq"]["used"] is True
        assert "pyzmq baselines skipped" not in r["_stdout"]


@pytest.mark.timeout(60)
def test_recv_driven_rows_have_a_socket_request_reply_baseline(tmp_path: Path) -> None:
    # From 256K up, with recv in the modes: the blocking socket asked for each message.
    r = run_json(tmp_path, "stream", "--sizes", "256K", "--iters", "16", "--concurrency", "1",
                 "--mode", "both", "--targets", *TINY, timeout=50)
    rows = r["stream"]
    reply = [row for row in rows if row["variant"] == "socket-reply"]
    assert len(reply) == 1, [row["variant"] for row in rows]
    reply_row = reply[0]
    assert reply_row["label"] == "socket request/reply" and reply_row["mode"] is None
    assert reply_row["messages"] == 16 and reply_row["bytes"] == 16 * 262144
    for row in rows:
        if row["mode"] == "recv":
            assert _close(row["ratio_socket_reply"], row["gbytes_per_s"] / reply_row["gbytes_per_s"])
            assert row["baseline_socket_reply_gbps"] == reply_row["gbytes_per_s"]
        else:  # the send-driven rows and the baselines are not compared with it
            assert "ratio_socket_reply" not in row, row
    target = {t["id"]: t for t in r["targets"]}["holds-previous-recv"]
    # With three lanes the replica keeps three requests out, as rvz's lanes do (and
    # still moves exactly the messages it was asked for).
    r3 = run_json(tmp_path, "stream", "--sizes", "256K", "--iters", "16", "--concurrency", "3",
                  "--mode", "recv", *TINY, timeout=50)
    rows3 = {row["variant"]: row for row in r3["stream"] if row["variant"] in ("socket-reply", "rvz")}
    assert rows3["socket-reply"]["in_flight"] == rows3["rvz"]["in_flight"] == 3
    assert rows3["socket-reply"]["messages"] == 16
    assert target["figure"] is not None and "socket request/reply, same size" in target["detail"]


@pytest.mark.timeout(60)
def test_one_sided_holds_previous_rows_have_tcp_and_memcpy_baselines(tmp_path: Path) -> None:
    why = rvz.onesided.available().get("shm")
    if why:
        pytest.skip(f"shm not available here: {why}")
    r = run_json(tmp_path, "stream", "--transport", "shm", "--sizes", "4M", "--iters", "8",
                 "--mode", "send", "--targets", *TINY, timeout=55)
    rows = {(row["variant"], row["mode"]): row for row in r["stream"]}
    memcpy, tcp, hold = rows[("memcpy", None)], rows[("rvz-hold-tcp", "send")], rows[("rvz-hold", "send")]
    assert memcpy["label"] == "numpy copy (memcpy)" and memcpy["messages"] == 8
    assert tcp["label"] == "rvz send-driven holds previous, tcp"
    assert _close(hold["ratio_memcpy"], hold["gbytes_per_s"] / memcpy["gbytes_per_s"])
    assert _close(hold["ratio_tcp"], hold["gbytes_per_s"] / tcp["gbytes_per_s"])
    assert "ratio_tcp" not in rows[("rvz", "send")]      # only the holds-previous rows
    assert "vs memcpy" in r["_stdout"]
    targets = {t["id"]: t for t in r["targets"]}
    assert targets["onesided-hold-send-4M-vs-tcp"]["figure"] == hold["ratio_tcp"]
    assert targets["onesided-hold-send-4M-vs-memcpy"]["figure"] == hold["ratio_memcpy"]
    assert targets["onesided-hold-send-64M-vs-tcp"]["figure"] is None    # not measured


@pytest.mark.timeout(40)
def test_pyzmq_missing_is_said_once(tmp_path: Path) -> None:
    # A "zmq" package that fails to import shadows the real one in the CLI and its workers.
    fake = tmp_path / "fake" / "zmq"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("simulated: no pyzmq here")\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), *filter(None, [env.get("PYTHONPATH")])])
    r = run_json(tmp_path, "pingpong", "--iters", "10", "--mode", "send", *TINY, env=env)
    assert {row["variant"] for row in r["pingpong"]} == {"socket", "streams", "rvz"}
    assert all(row["ratio_pyzmq"] is None for row in r["pingpong"])
    assert r["pyzmq"]["used"] is False and "simulated: no pyzmq here" in r["pyzmq"]["skipped"]
    out = r["_stdout"]
    assert out.count("pyzmq baselines skipped") == 1 and "simulated: no pyzmq here" in out


def test_pyzmq_can_be_turned_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RVZ_BENCH_NO_PYZMQ", "1")
    assert zmq_available() == "RVZ_BENCH_NO_PYZMQ is set"


def test_targets_use_the_rows_they_name() -> None:
    def srow(variant: str, mode: str | None, size: int, gbps: float, **extra: Any) -> dict[str, Any]:
        row = {"variant": variant, "mode": mode, "size": size, "gbytes_per_s": gbps,
               "msgs_per_s": gbps * 1e9 / size, "concurrency": 1, "batch": None}
        row.update(extra)
        return row

    stream = [srow("zmq", None, 64, 0.064), srow("socket", None, 4096, 2.0),
              srow("rvz", "send", 64, 0.032, concurrency=64),
              srow("rvz-batch", "send", 64, 0.070, batch=64),
              srow("rvz-one", "send", 64, 0.080),
              srow("rvz-one", "send", 4096, 1.5), srow("rvz-one", "recv", 4096, 0.1)]
    for size, ratios in ((256 << 10, (0.95, 0.5)), (4 << 20, (0.91, 0.99)), (64 << 20, (1.2, 1.0))):
        stream.append(srow("socket", None, size, 4.0))
        for mode, x in zip(("send", "recv"), ratios, strict=True):
            stream.append(srow("rvz-hold", mode, size, 4.0 * x))
    mem = {"idle_rss": 0, "peak_rss": 0, "peak_above_idle": 32 << 20, "peak_was_reset": True}
    stream.append(srow("rvz-into", "send", 64 << 20, 4.0 * 1.2 * 0.97, memory=mem))
    stream.append(srow("rvz-into", "recv", 64 << 20, 4.0 * 0.9, memory={**mem, "peak_above_idle": 80 << 20}))
    for row in stream:  # as Bench.stream computes them
        base = {b["variant"]: b for b in stream if b["size"] == row["size"]}
        for name, key in (("socket", "socket"), ("zmq", "pyzmq")):
            b = base.get(name)
            row[f"ratio_{key}"] = row["gbytes_per_s"] / b["gbytes_per_s"] if b else None
        row["baseline_socket_gbps"] = base["socket"]["gbytes_per_s"] if "socket" in base else None
        row["baseline_pyzmq_msgs"] = base["zmq"]["msgs_per_s"] if "zmq" in base else None
        if row["variant"] == "rvz-hold" and row["mode"] == "recv" and row["size"] == 256 << 10:
            row["baseline_socket_reply_gbps"] = 3.2  # the socket asked for each message
    pingpong = [{"variant": "rvz", "mode": "recv", "size": 64, "loop": "uvloop", "p50_us": 30.0,
                 "ratio_streams": 1.5, "baseline_streams_p50_us": 20.0},
                {"variant": "rvz", "mode": "send", "size": 64, "loop": "uvloop", "p50_us": 21.0,
                 "ratio_streams": 1.05, "baseline_streams_p50_us": 20.0}]
    t = {x["id"]: x for x in report.evaluate_targets({"stream": stream, "pingpong": pingpong,
                                                      "rendezvous_summary": []})}
    assert t["stream-send-64B-vs-pyzmq"]["figure"] == pytest.approx(0.5)
    assert t["stream-send-64B-vs-pyzmq"]["met"] is True
    assert t["batch-send-64B-vs-pyzmq"]["figure"] == pytest.approx(70 / 64)
    one = t["one-in-flight-64B-vs-pyzmq"]  # a level reached, kept: rvz's plain loop vs pyzmq's
    assert one["figure"] == pytest.approx(80 / 64) and one["met"] is True and one["kind"] == "keep"
    assert t["one-in-flight-4K"]["figure"] == pytest.approx(0.75)  # send-driven, not recv
    assert t["one-in-flight-4K"]["met"] is False
    # the worst size of each mode counts
    assert t["holds-previous-send"]["figure"] == pytest.approx(0.91)
    assert t["holds-previous-send"]["met"] is True and "4M" in t["holds-previous-send"]["detail"]
    assert t["holds-previous-recv"]["figure"] == pytest.approx(0.5)
    assert t["holds-previous-recv"]["met"] is False
    reply = "socket request/reply, same size: 3.20 GB/s (0.80x the socket)"
    assert reply in t["holds-previous-recv"]["detail"]
    assert t["pingpong-recv-64B"]["met"] is False and t["pingpong-send-64B"]["met"] is True
    assert t["rendezvous-consumer-first"]["met"] is None
    # into= against the holds-previous row of its mode and size; its memory in tensors
    assert t["into-64M-send"]["figure"] == pytest.approx(0.97) and t["into-64M-send"]["met"]
    assert t["into-64M-recv"]["figure"] == pytest.approx(0.9) and not t["into-64M-recv"]["met"]
    assert t["into-memory-64M-send"]["figure"] == pytest.approx(0.5)
    assert t["into-memory-64M-send"]["met"] and not t["into-memory-64M-recv"]["met"]


@pytest.mark.timeout(60)
def test_engine_microbench_runs_on_this_implementation() -> None:
    """``bench/engine.py`` drives the engine's internals directly (no node), so a change
    to their signatures breaks it without any other test noticing: run it small."""
    script = Path(__file__).resolve().parents[1] / "bench" / "engine.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=50, env={**os.environ, "N": "640"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"rvz {rvz.implementation()} engine"
    rows = dict(re.fullmatch(r"(.+?):\s+(\d+) ns/message", line).groups()  # type: ignore[union-attr]
                for line in lines[1:])
    assert set(rows) == {"send (push, 64 B)", "DATA decode + dispatch", "take a queued value",
                         "send_many (64 x 64 B)", "DATA_MANY decode+dispatch",
                         "take_many (64 keys)"}, rows
    assert all(int(ns) > 0 for ns in rows.values()), rows


@pytest.mark.timeout(60)
def test_floor_bench_runs_both_lanes_on_this_implementation(tmp_path: Path) -> None:
    """``bench/floor.py`` runs the stream's lanes over a null node and over rvz nodes in
    one process; run it small and check its figures are the ones it measured."""
    script = Path(__file__).resolve().parents[1] / "bench" / "floor.py"
    out = tmp_path / "floor.json"
    proc = subprocess.run([sys.executable, str(script), "--messages", "20", "--repeat", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["implementation"] == rvz.implementation()
    runs = result["runs_ns_per_message"]
    assert len(runs["null"]) == len(runs["rvz"]) == 2
    assert result["null_ns"] == min(runs["null"]) > 0
    assert result["rvz_ns"] == min(runs["rvz"]) > 0
    assert result["ratio"] == pytest.approx(result["rvz_ns"] / result["null_ns"])
    assert f"{result['ratio']:.2f}x" in proc.stdout


@pytest.mark.timeout(60)
def test_wakeup_bench_reports_the_slope_of_the_p50s_it_measured(tmp_path: Path) -> None:
    """``bench/wakeup.py`` runs a two-process echo at each level of work; run it small and
    check that each level's p50 is the median of its runs and the slope comes from them."""
    script = Path(__file__).resolve().parents[1] / "bench" / "wakeup.py"
    out = tmp_path / "wakeup.json"
    proc = subprocess.run([sys.executable, str(script), "--work", "0,2", "--rounds", "300",
                           "--repeat", "3", "--loop", "asyncio", "--json", str(out)],
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs_p50_us"]
    assert sorted(runs) == ["0.0", "2.0"] and all(len(r) == 3 for r in runs.values())
    for level, p50 in result["p50_us"].items():
        assert p50 == statistics.median(runs[level]) > 0
    slope = (result["p50_us"]["2.0"] - result["p50_us"]["0.0"]) / 4.0
    assert result["slope"]["2.0"] == pytest.approx(slope)
    assert f"{slope:.2f}x" in proc.stdout
    bad = subprocess.run([sys.executable, str(script), "--work", "2"], capture_output=True,
                         text=True, timeout=20)
    assert bad.returncode == 2 and "two or more distinct levels" in bad.stderr

