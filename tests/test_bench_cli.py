"""rvz-bench itself: every subcommand runs briefly, its JSON has every field, its child
processes never outlive it.  No timing assertions: figures on a shared machine are noise.

Each test runs the CLI as ``python -m rvz.bench`` in a subprocess, so the test process's
implementation switch (``RVZ_NO_EXTENSIONS``) is inherited and the workers run the same
hot paths as the rest of the suite.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rvz.bench import report

TINY = ["--warmup", "3", "--quiet"]

TOP_LEVEL = {"tool", "schema", "command", "argv", "options", "started_at", "machine", "versions",
             "transport", "loop", "impl", "stream", "pingpong", "rendezvous",
             "rendezvous_summary", "impl_compare", "workers", "memory", "targets", "elapsed_s"}
STREAM_ROW = {"variant", "mode", "size", "loop", "impl", "concurrency", "label", "messages",
              "bytes", "seconds", "msgs_per_s", "gbytes_per_s", "memory", "ratio_socket",
              "ratio_streams", "baseline_socket_gbps", "baseline_streams_msgs",
              "runs_gbytes_per_s", "runs_msgs_per_s"}
MEMORY = {"idle_rss", "peak_rss", "peak_above_idle", "peak_was_reset"}
PINGPONG_ROW = {"variant", "mode", "size", "loop", "impl", "concurrency", "label", "count",
                "min_us", "p50_us", "p90_us", "p99_us", "max_us", "mean_us", "samples_us",
                "ratio_socket", "ratio_streams", "baseline_socket_p50_us",
                "baseline_streams_p50_us", "runs_p50_us"}
RENDEZVOUS_ROW = {"order", "mode", "size", "rounds", "warmup_rounds", "loop", "impl",
                  "producer_waited", "consumer_waited", "recv_call_p50_us", "clock", "count",
                  "p50_us", "p90_us", "p99_us", "max_us", "samples_us"}
TARGET = {"id", "target", "required", "figure", "met", "detail"}
TARGET_IDS = {"stream-send-256K", "stream-send-4M", "stream-send-64M", "stream-send-4K",
              "stream-send-64B", "pingpong-recv-64B", "rendezvous-producer-first",
              "rendezvous-consumer-first", "memory-64M", "compiled-vs-python-64B"}


def bench(*args: str, timeout: float = 40.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rvz.bench", *args], capture_output=True,
                          text=True, timeout=timeout)


def run_json(tmp_path: Path, *args: str, timeout: float = 40.0) -> dict[str, Any]:
    out = tmp_path / "result.json"
    proc = bench(*args, "--json", str(out), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "target (issue 3)" in proc.stdout
    results: dict[str, Any] = json.loads(out.read_text())
    assert TOP_LEVEL <= set(results), TOP_LEVEL - set(results)
    assert {t["id"] for t in results["targets"]} == TARGET_IDS
    for target in results["targets"]:
        assert TARGET <= set(target)
        assert target["met"] in (True, False, None)
    for impl, pair in results["workers"].items():
        for side in ("a", "b"):
            assert pair[side]["implementation"] == impl
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
    assert {(row["variant"], row["mode"], row["size"]) for row in rows} == {
        (v, m, s) for s in (64, 80 << 10)
        for v, m in (("socket", None), ("streams", None), ("rvz", "send"), ("rvz", "recv"))}
    for row in rows:
        assert STREAM_ROW <= set(row), STREAM_ROW - set(row)
        assert MEMORY <= set(row["memory"])
        assert row["messages"] >= 40 and row["loop"] == loop
        assert row["ratio_socket"] is not None and row["ratio_streams"] is not None
    assert r["memory"] and all(MEMORY <= set(m) for m in r["memory"])


@pytest.mark.timeout(40)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_pingpong(tmp_path: Path, loop: str) -> None:
    r = run_json(tmp_path, "pingpong", "--iters", "30", "--loop", loop, *TINY)
    rows = r["pingpong"]
    assert {(row["variant"], row["mode"]) for row in rows} == {
        ("socket", None), ("streams", None), ("rvz", "send"), ("rvz", "recv")}
    for row in rows:
        assert PINGPONG_ROW <= set(row), PINGPONG_ROW - set(row)
        assert row["count"] == 30 and row["p50_us"] > 0
    assert r["stream"] == [] and r["rendezvous"] == []


@pytest.mark.timeout(40)
def test_pingpong_on_pure_python_workers(tmp_path: Path) -> None:
    r = run_json(tmp_path, "pingpong", "--impl", "python", "--mode", "recv", "--no-baselines",
                 "--iters", "20", *TINY)
    assert r["impl"] == "python" and set(r["workers"]) == {"python"}
    (row,) = r["pingpong"]
    assert row["ratio_socket"] is None  # no baselines: no ratios, and no crash


@pytest.mark.timeout(40)
def test_rendezvous(tmp_path: Path) -> None:
    r = run_json(tmp_path, "rendezvous", "--iters", "8", "--sizes", "1K", *TINY)
    rows = r["rendezvous"]
    assert {(row["order"], row["mode"]) for row in rows} == {
        (o, m) for o in ("producer-first", "consumer-first", "random") for m in ("send", "recv")}
    for row in rows:
        assert RENDEZVOUS_ROW <= set(row), RENDEZVOUS_ROW - set(row)
        assert row["rounds"] == 8 and row["size"] == 1024
        assert row["producer_waited"] + row["consumer_waited"] <= 1.0
    assert {s["order"] for s in r["rendezvous_summary"]} == {"producer-first", "consumer-first", "random"}
    assert {t["id"]: t for t in r["targets"]}["rendezvous-producer-first"]["figure"] is not None


@pytest.mark.timeout(50)
def test_all_is_the_default(tmp_path: Path) -> None:
    # No subcommand: all.  Tiny sizes and one repeat keep it short; every section is filled.
    r = run_json(tmp_path, "--sizes", "64,4K", "--duration", "0.05", "--repeat", "1", *TINY,
                 timeout=50)
    assert r["command"] == "all"
    assert r["stream"] and r["pingpong"] and r["rendezvous"]
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


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_every_worker(sig: int) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "rvz.bench", "stream", "--sizes", "64",
                             "--duration", "30", "--no-baselines", "--mode", "send"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers: set[int] = set()
        deadline = time.monotonic() + 15
        while len(workers) < 2 and time.monotonic() < deadline:
            workers |= _workers(proc.pid)
            time.sleep(0.05)
        assert len(workers) == 2, "the workers did not start"
        time.sleep(1.0)  # let the case start: both workers are busy measuring
        proc.send_signal(sig)
        proc.wait(15)
        assert proc.returncode != 0
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
    addr = f"127.0.0.1:{_free_port()}"
    server = subprocess.Popen([sys.executable, "-m", "rvz.bench", "--server", "--addr", addr,
                               "--once"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_listening(server, 15)
        r = run_json(tmp_path, "rendezvous", "--client", "--addr", addr, "--iters", "5",
                     "--order", "producer-first", "--mode", "send", *TINY)
        (row,) = r["rendezvous"]
        assert "two hosts" in row["clock"] and row["rounds"] == 5
        server.wait(15)
        assert server.returncode == 0, server.stderr.read() if server.stderr else ""
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


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
    out = tmp_path / "plot.png"
    proc = bench("pingpong", "--iters", "10", "--mode", "recv", "--plot", str(out), *TINY)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert proc.returncode == 1 and "matplotlib" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert out.read_bytes()[:4] == b"\x89PNG"


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
