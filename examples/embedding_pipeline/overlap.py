"""``python -m examples.embedding_pipeline.overlap``: staleness 0 against 1 where there is wire time.

Every PS shard and every worker runs in a network namespace of its own (``examples/netns.py``),
joined through a bridge by veth pairs; each worker's link is shaped to ``--rate`` (``tbf``,
both ways, a bucket of ``--burst``), so a step's pulls and pushes take wire time that
staleness 1 can hide behind MG's compute. Runs staleness 0 and 1 alternately ``--rounds``
times on the same data (one ``train --cluster`` process per host and role), prints each run
(with its time per step in MG's compute, in EG's PS calls, and on the wire), the medians of
steps/s, their ratio, the final AUCs and what a full overlap would give, and removes every
process and namespace it made, also when a run fails or the command is interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .. import netns

ROOT = str(Path(__file__).resolve().parents[2])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.embedding_pipeline.overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternations of staleness 0 and 1")
    p.add_argument("--rate", default="1gbit", help="each worker link's rate (tc tbf)")
    p.add_argument("--burst", default="1mb",
                   help="the tbf bucket: bytes that pass at the veth's speed once it has refilled "
                        "(a step's 1-2 MB mostly do at 1mb; 32kb paces them at the rate)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--steps", type=int, default=60, help="steps per run")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", default="256,128")
    p.add_argument("--eval-samples", type=int, default=20_000)
    p.add_argument("--timeout", type=float, default=300.0, help="bound on each run, seconds")
    p.add_argument("--json", help="write every run and the summary here")
    return p.parse_args(argv)


def train_args(a: argparse.Namespace, cache: str) -> list[str]:
    """The options every process of a run shares (the data is prepared once in ``cache``)."""
    return ["--samples", str(a.steps * a.batch_size), "--eval-samples", str(a.eval_samples),
            "--batch-size", str(a.batch_size), "--max-steps", str(a.steps), "--dim", str(a.dim),
            "--hidden", a.hidden, "--shards", str(a.shards), "--workers", str(a.workers),
            "--cache-dir", cache, "--timeout", "60", "--progress-every", "0", "--log-level", "WARNING"]


def prepare_data(a: argparse.Namespace, cache: str) -> None:
    """Parse the planted data into the shared column cache once, before any timed run."""
    from .__main__ import parse_args as train_parse
    from .__main__ import prepare
    Path(cache).mkdir(parents=True, exist_ok=True)
    prepare(train_parse(["train", *train_args(a, cache)]), Path(cache))


def link_rate(src: netns.Host, dst: netns.Host, nbytes: int = 64 << 20) -> float:
    """Bytes per second from ``src`` to ``dst`` over one TCP connection (a check of the shaping)."""
    code = ("import socket,sys,time\n"
            "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('{dst.address}',6999));s.listen(1);print('up',flush=True)\n"
            "c,_=s.accept();n=0\n"
            "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
            "print(n,flush=True)\n")
    sink = subprocess.Popen([*netns.prefix(dst.netns), sys.executable, "-c", code],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "up"
        send = ("import socket,time\n"
                f"c=socket.create_connection(('{dst.address}',6999));b=bytes(1<<20);t=time.perf_counter()\n"
                f"for _ in range({nbytes >> 20}): c.sendall(b)\n"
                "c.shutdown(socket.SHUT_WR);c.recv(1);print(time.perf_counter()-t)\n")
        out = subprocess.run([*netns.prefix(src.netns), sys.executable, "-c", send],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        sink.wait(timeout=30)
        return nbytes / float(out.strip())
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait(timeout=10)


class Run:
    """One job: a ``train --cluster`` process per host and role, each in its own session."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[str]]] = []

    def start(self, host: netns.Host, argv: list[str], env: dict[str, str]) -> None:
        command = [*netns.prefix(host.netns), sys.executable, "-m", "examples.embedding_pipeline", *argv]
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        self.procs.append((host.name, proc))

    def wait(self, timeout: float) -> dict[str, tuple[int, str, str]]:
        """Every process's exit code and output; raises if one fails or the bound passes."""
        deadline = time.monotonic() + timeout
        outs: dict[str, tuple[int, str, str]] = {}
        # Collect output concurrently: a blocked pipe must not hold a process up.
        threads = []
        for name, proc in self.procs:
            def collect(name: str = name, proc: subprocess.Popen[str] = proc) -> None:
                try:
                    out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    out, err = "", f"no exit within {timeout:.0f} s"
                outs[name] = (proc.returncode if proc.returncode is not None else -1, out, err)
            threads.append(threading.Thread(target=collect, daemon=True))
            threads[-1].start()
        for t in threads:
            t.join(max(1.0, deadline - time.monotonic()) + 5)
        failed = {n: o for n, o in outs.items() if o[0] != 0} or (
            {"?": (-1, "", "a process gave no outcome")} if len(outs) < len(self.procs) else {})
        if failed:
            raise RuntimeError("; ".join(f"{n} exited {c}: {(e or o)[-1500:]}"
                                         for n, (c, o, e) in failed.items()))
        return outs

    def stop(self) -> None:
        """Kill whatever of the run is still alive (its own sessions only) and reap it."""
        for _, proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def one_run(a: argparse.Namespace, hosts: dict[str, netns.Host], cache: str, k: int, port: int,
            out_dir: str) -> dict[str, Any]:
    cluster = {"ps": [f"{hosts[f'ps{s}'].address}:{port}" for s in range(a.shards)],
               "worker": [f"{hosts[f'w{w}'].address}:{port}" for w in range(a.workers)]}
    common = ["train", "--cluster", json.dumps(cluster), *train_args(a, cache), "--staleness", str(k)]
    # Off loopback every node wants the cluster's secret; a fresh one per run.
    env = dict(os.environ, RVZ_SECRET=secrets.token_hex(16))
    report = os.path.join(out_dir, f"k{k}-{port}.json")
    run = Run()
    try:
        for s in range(a.shards):
            run.start(hosts[f"ps{s}"], [*common, "--job", "ps", "--task", str(s)], env)
        for w in range(a.workers):
            run.start(hosts[f"w{w}"], [*common, "--job", "worker", "--task", str(w)]
                      + (["--json", report] if w == 0 else []), env)
        run.wait(a.timeout)
    finally:
        run.stop()
    result = json.loads(Path(report).read_text())
    return {"staleness": k, "steps_per_s": result["steps_per_s"], "auc": result["auc"],
            "logloss": result["logloss"], "steps": result["steps"], "mg_compute": result.get("mg_compute"),
            "mg_waiting": result.get("mg_waiting"), "eg_ps": result.get("eg_ps"),
            "pulled_ids": result.get("pulled_ids"), "seconds": result.get("seconds")}


def per_step(r: dict[str, Any], dim: int, rate: float) -> dict[str, float]:
    """Milliseconds per step of one run: the step, MG's compute, EG's PS calls, and the wire
    time of the step's payload on worker 0's link at the measured ``rate`` (bytes/s), each
    way: up, each unique id twice (pull, push) and its gradient; down, its row."""
    steps = max(1, r["steps"])
    ids = r["pulled_ids"] / steps
    return {"step": 1e3 / r["steps_per_s"], "compute": 1e3 * r["mg_compute"] / steps,
            "ps": 1e3 * r["eg_ps"] / steps, "wire_up": 1e3 * ids * (16 + 4 * dim) / rate,
            "wire_down": 1e3 * ids * 4 * dim / rate}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_k = {k: [r for r in runs if r["staleness"] == k] for k in (0, 1)}
    med = {k: statistics.median(r["steps_per_s"] for r in rs) for k, rs in by_k.items()}
    auc = {k: statistics.median(r["auc"] for r in rs) for k, rs in by_k.items()}
    return {"median_steps_per_s": med, "ratio": med[1] / med[0], "auc": auc,
            "auc_gap": abs(auc[1] - auc[0])}


def compare(a: argparse.Namespace, say: Any = print) -> dict[str, Any]:
    """Make the hosts, run staleness 0 and 1 alternately, tear everything down; the summary."""
    names = [f"ps{s}" for s in range(a.shards)] + [f"w{w}" for w in range(a.workers)]
    with tempfile.TemporaryDirectory(prefix="rvz-wire-") as tmp:
        cache = os.path.join(tmp, "data")
        prepare_data(a, cache)
        with netns.hosts(names, slow={f"w{w}": a.rate for w in range(a.workers)}, burst=a.burst) as hosts:
            rate = link_rate(hosts["ps0"], hosts["w0"])
            say(f"link ps0 -> w0: {rate * 8 / 1e9:.2f} Gbit/s measured (shaped to {a.rate}, burst "
                f"{a.burst}); {a.shards} shards, {a.workers} worker(s), batch {a.batch_size}, dim {a.dim}, "
                f"{a.steps} steps; load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
            runs = []
            port = 7100
            for i in range(a.rounds):
                for k in (0, 1):
                    port += 1  # a fresh port per run: nothing of the previous run's sockets in the way
                    r = one_run(a, hosts, cache, k, port, tmp)
                    r["ms_per_step"] = ms = per_step(r, a.dim, rate)
                    runs.append(r)
                    say(f"round {i} staleness {k}: {r['steps_per_s']:.2f} steps/s, AUC {r['auc']:.4f}, "
                        f"logloss {r['logloss']:.4f}; per step {ms['step']:.1f} ms: MG computes "
                        f"{ms['compute']:.1f}, EG in PS calls {ms['ps']:.1f}, wire up "
                        f"{ms['wire_up']:.1f} + down {ms['wire_down']:.1f}")
    summary = summarize(runs)
    summary["runs"] = runs
    summary["link_gbit_s"] = rate * 8 / 1e9
    m, auc = summary["median_steps_per_s"], summary["auc"]
    say(f"median steps/s: staleness 0 {m[0]:.2f}, staleness 1 {m[1]:.2f}: ratio {summary['ratio']:.2f}x; "
        f"AUC {auc[0]:.4f} vs {auc[1]:.4f} (gap {summary['auc_gap']:.4f})")
    # What staleness 1 can hide at best: a step of staleness 0 is about compute + PS calls,
    # one of staleness 1 about the larger of the two (when EG and MG each have a core).
    zero = [r["ms_per_step"] for r in runs if r["staleness"] == 0]
    compute = statistics.median(ms["compute"] for ms in zero)
    ps = statistics.median(ms["ps"] for ms in zero)
    wire = statistics.median(ms["wire_up"] + ms["wire_down"] for ms in zero)
    summary["bound"] = {"compute_ms": compute, "ps_ms": ps, "wire_ms": wire,
                        "ratio": (compute + ps) / max(compute, ps)}
    say(f"staleness 0, median per step: MG computes {compute:.1f} ms, EG in PS calls {ps:.1f} ms "
        f"(the payload's wire time at the measured rate, up and down: {wire:.1f} ms): overlapping "
        f"them fully would give {summary['bound']['ratio']:.2f}x")
    return summary


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every ``finally`` (processes, namespaces) runs.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        summary = compare(a)
    except netns.NamespacesUnavailable as exc:
        print(f"wire: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
