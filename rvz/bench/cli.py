"""``rvz-bench``: throughput, latency and rendezvous-order benchmarks of rvz, with baselines.

Every figure comes from two worker processes (``rvz.bench.worker``): side ``a`` produces
(or echoes), side ``b`` consumes (or pings) and measures.  Every ``stream`` and ``pingpong``
result is printed next to baselines measured in the same run, on the same sizes and host
pair: plain blocking sockets, raw asyncio/uvloop streams and, when pyzmq imports, pyzmq
PUSH/PULL and REQ/REP; rvz's figure is a ratio of each.  Besides one call per message on
``--concurrency`` lanes, ``stream`` measures the batch API (``send_many``/``recv_many``),
one message in flight (4K) and a consumer that holds its previous array (256K and up).
With ``--transport shm`` or ``verbs`` the holds-previous rows get two more same-run
baselines: the same rows over TCP, and a numpy copy of the same size (``memcpy``: a
one-sided write costs one such copy, made by the writer, the reader copying nothing).
The development machine is shared and noisy, so only the ratios mean much.

Two hosts: run ``rvz-bench --server --addr 0.0.0.0:7300`` on one (it plays side ``a``) and
``rvz-bench stream --client --addr HOST:7300`` on the other.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import signal
import sys
import time
from typing import Any, TextIO, cast

import rvz
from rvz import _impl, cluster
from rvz.errors import ConfigError
from rvz.poll import check_budget

from . import control, report
from .control import LocalWorker, RemoteWorker, WorkerError, WorkerLink
from .report import MEMORY_SIZE, rate_label, ratio, ratio_label, size_label
from .worker import calibrate, machine, versions, zmq_available

COMMANDS = ("stream", "pingpong", "rendezvous", "all")
MODES = {"recv": ["recv"], "send": ["send"], "both": ["send", "recv"]}
ORDERS = ("producer-first", "consumer-first", "random")
DEFAULT_SIZES = {"stream": "64,4K,256K,4M,64M", "pingpong": "64", "rendezvous": "64",
                 "all": "64,4K,256K,4M,64M"}
# What ``all`` runs unless told otherwise: short, but every target gets its figure.
ALL_DURATION = 0.2
ALL_REPEAT = 3
ALL_ROUNDS = 100
RDV_PERIOD_NS = 5_000_000   # one round of the rendezvous experiment
RDV_GAP_NS = 1_000_000      # how much earlier the first side calls in an ordered round
RDV_SPREAD_NS = 2_000_000   # random order: each side waits uniformly in [0, spread)
RDV_LEAD_NS = 300_000_000   # time for both workers to set up before round 0
RDV_WIRE = {"send": "push", "recv": "request+reply"}  # each mode's bytes, in the socket replica
# Recv-Driven's own baseline from HOLD_MIN_SIZE up: the blocking socket again, each message
# asked for with a request first, as many requests out as rvz has lanes at that size
# (``socket_stream``'s ``reply``).
SOCKET_REPLY = "socket-reply"
ALREADY_SENT = "rvz-sent"   # pingpong's Recv-Driven recv of a value the producer sent before
MEMCPY = "memcpy"
BASELINES = ("socket", "streams", "zmq", SOCKET_REPLY, MEMCPY)
# A one-sided run's holds-previous rows, again over TCP: their "vs tcp" baseline.
HOLD_TCP = "rvz-hold-tcp"
ONESIDED = ("shm", "verbs")
BATCH_MAX_SIZE = 4 << 10    # batch rows up to this size (the small-message regime)
ONE_IN_FLIGHT_SIZES = (64, 4 << 10)
HOLD_MIN_SIZE = 256 << 10   # "holds previous" rows from this size (the receive pool's range)
# "into" rows: the consumer receives into= one preallocated buffer per lane, torch tensors
# both ways where torch is installed (compared with the holds-previous numpy stream).
TORCH = importlib.util.find_spec("torch") is not None
PATTERNS = {"rvz": "lanes", "rvz-batch": "batch", "rvz-one": "one-in-flight",
            "rvz-hold": "holds-previous", HOLD_TCP: "holds-previous",
            "rvz-into": "into"}


def slot_budget(size: int) -> int:
    """The consumer's slot budget in a one-sided run: the default, or four values' worth.
    A consumer holding its previous array keeps two values lent (that one and the one
    arriving), and lent arrays may take half the budget before values are copied."""
    return max(64 << 20, 4 * (size + 4096))


class UsageError(Exception):
    """A bad option: printed without a traceback, exit status 2."""


# Which option groups each subcommand takes: its --help lists only those.
GROUPS = {
    "stream": ("run", "repeat", "lanes", "batch", "baselines", "compare", "output", "client"),
    "pingpong": ("run", "repeat", "lanes", "baselines", "output", "client"),
    "rendezvous": ("run", "order", "baselines", "output", "client"),
    "all": ("run", "repeat", "lanes", "order", "batch", "baselines", "output", "client",
            "server"),
}


def _add_options(parser: argparse.ArgumentParser, groups: tuple[str, ...]) -> None:
    g = parser.add_argument_group("what to run")
    g.add_argument("--transport", default="tcp", choices=("tcp", "shm", "verbs", "auto"),
                   help="rvz transport (default tcp; shm/verbs fail with the reason when this "
                   "host or build lacks them; the baselines stay on TCP)")
    g.add_argument("--shm-copy", action="store_true",
                   help="shm/verbs: rvz nodes copy every value out of the peer's memory "
                   "instead of lending it (Node(shm_copy=True)): what that protection costs")
    g.add_argument("--mode", default="both", choices=tuple(MODES),
                   help="Recv-Driven, Send-Driven or both (default both)")
    g.add_argument("--sizes", help="tensor sizes, e.g. 64,4K,256K,4M,64M (K/M/G are binary; "
                   "default: that list for stream and all, 64 for pingpong and rendezvous)")
    n = g.add_mutually_exclusive_group()
    n.add_argument("--iters", type=int, help="measured messages (stream), round trips "
                   "(pingpong) or rounds (rendezvous) per case")
    n.add_argument("--duration", type=float, help="seconds per case instead of --iters "
                   "(default 1.0; all: 0.2, three times)")
    if "repeat" in groups:
        g.add_argument("--repeat", type=int, help="measure each case this many times, "
                       "interleaved with its baselines, and keep the median (default 1; all: 3)")
    g.add_argument("--warmup", type=int, help="messages (rounds) before measuring; default "
                   "depends on size")
    if "lanes" in groups:
        g.add_argument("--concurrency", type=int, help="operations in flight (stream lanes; "
                       "default 64 up to 4K tensors, 4 up to 256K, 1 above; pingpong 1); the "
                       "4K '1 in flight' row always runs one plain send loop")
    g.add_argument("--busy-poll", type=float, default=0.0, metavar="US",
                   help="rvz nodes keep their loop polling while a recv waits on a peer, up "
                   "to US microseconds (Node(busy_poll=); default 0: off); pingpong's asyncio "
                   "streams echo polls the same way, the other baselines do not")
    g.add_argument("--loop", default="auto", choices=("auto", "uvloop", "asyncio"),
                   help="event loop of the workers (default: uvloop when installed)")
    g.add_argument("--impl", choices=("compiled", "python"),
                   help="rvz hot paths in the workers (default: what this process loads; "
                   "python sets RVZ_NO_EXTENSIONS=1)")
    if "order" in groups:
        g.add_argument("--order", default="all", help="rendezvous arrival orders: "
                       "producer-first, consumer-first, random or all (comma-separated)")
    if "batch" in groups:
        g.add_argument("--batch", type=int, default=64, metavar="N",
                       help="stream: keys per send_many/recv_many call in the batch rows, one "
                       "message per key (sizes up to 4K; default 64; 0: no batch rows)")
    if "baselines" in groups:
        g.add_argument("--no-baselines", action="store_true",
                       help="skip the socket, streams and pyzmq baselines (no ratios; in "
                       "rendezvous, the plain-socket replica of the rounds); pyzmq "
                       "rows need pyzmq (pip install 'rvz[compare]'), else they are skipped "
                       "with the reason")
    if "compare" in groups:
        g.add_argument("--compare-impl", action="store_true",
                       help="also run 64B stream on the pure-Python hot paths (all does)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write every figure, the machine, versions "
                   "and the exact options")
    o.add_argument("--plot", metavar="FILE.png", help="plots of what was measured (needs "
                   "matplotlib: pip install 'rvz[plot]')")
    o.add_argument("--profile", metavar="DIR", help="cProfile each worker, one .prof per case and side")
    o.add_argument("--quiet", action="store_true", help="no progress lines")
    o.add_argument("--targets", action="store_true", help="also print the performance "
                   "targets, met or not by this run's figures")
    h = parser.add_argument_group("two hosts")
    if "server" in groups:
        h.add_argument("--server", action="store_true",
                       help="serve one side for a --client (no measurement here)")
        h.add_argument("--once", action="store_true", help="--server: exit after one client")
    h.add_argument("--client", action="store_true", help="run against a --server at --addr")
    h.add_argument("--addr", metavar="HOST:PORT", help="--client: where the server is"
                   + ("; --server: where to listen" if "server" in groups else ""))


def build_parser() -> argparse.ArgumentParser:
    """``rvz-bench [COMMAND] [options]``: each subcommand takes only the options it uses;
    the others get their defaults, so ``Options`` reads one namespace for every command."""
    parser = argparse.ArgumentParser(
        prog="rvz-bench",
        description="Benchmarks of rvz over two processes, with same-run baselines (blocking "
        "socket, asyncio/uvloop streams, pyzmq when installed). Without a subcommand: all "
        "(a short run of the three, about a minute).")
    _add_options(parser, GROUPS["all"])
    # Every option's default, so a subcommand without an option still has its attribute.
    union = argparse.ArgumentParser(add_help=False)
    _add_options(union, tuple({g for groups in GROUPS.values() for g in groups}))
    every = {a.dest: a.default for a in union._actions}
    sub = parser.add_subparsers(dest="command", metavar="{stream,pingpong,rendezvous,all}")
    helps = {"stream": "one-way throughput of tensors (GB/s, tensors/s): lanes, batch API "
                       "(up to 4K), one in flight (4K), consumer holding its previous array "
                       "(256K and up)",
             "pingpong": "round-trip latency of a key exchanged back and forth",
             "rendezvous": "latency from the later of send/recv to recv done, by arrival order",
             "all": "a short representative run of the three (batch rows at 64B only, one in "
                    "flight Send-Driven only); --server serves a --client on another host"}
    for name in COMMANDS:
        p = sub.add_parser(name, help=helps[name], description=helps[name])
        _add_options(p, GROUPS[name])
        own = {a.dest for a in p._actions}
        p.set_defaults(**{dest: default for dest, default in every.items() if dest not in own})
    return parser


# -- options ------------------------------------------------------------------------------------

class Options:
    """The parsed command line with every default resolved (recorded in --json)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.command: str = args.command or "all"
        self.args = args
        command = self.command
        try:
            self.sizes = report.parse_sizes(args.sizes or DEFAULT_SIZES[command])
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if not self.sizes:
            raise UsageError("--sizes is empty")
        if command == "rendezvous" and len(self.sizes) > 1:  # it would measure the first only
            raise UsageError("rendezvous measures one size: give --sizes a single value")
        limit = _impl.codec.DEFAULT_MAX_PAYLOAD  # the workers' nodes keep the default max_payload
        for size in self.sizes:
            if size > limit:
                raise UsageError(f"--sizes: {size_label(size)} is above {size_label(limit)}, the largest "
                                 "message an rvz node accepts by default")
        self.modes = MODES[args.mode]
        self.loop = args.loop if args.loop != "auto" else _auto_loop_name()
        self.impl = args.impl or rvz.implementation()
        self.transport = args.transport
        self.iters: int | None = args.iters
        self.duration: float | None = args.duration
        if self.iters is None and self.duration is None:
            self.duration = ALL_DURATION if command == "all" else 1.0
        if self.iters is not None and self.iters < 1:
            raise UsageError("--iters must be at least 1")
        if self.duration is not None and not (0 < self.duration < math.inf):  # NaN fails too
            raise UsageError("--duration must be a positive, finite number of seconds")
        self.repeat: int = (args.repeat if args.repeat is not None
                            else ALL_REPEAT if command == "all" else 1)
        if self.repeat < 1:
            raise UsageError("--repeat must be at least 1")
        if args.concurrency is not None and args.concurrency < 1:
            raise UsageError("--concurrency must be at least 1")
        if args.warmup is not None and args.warmup < 0:
            raise UsageError("--warmup must not be negative")
        self.busy_poll: float = args.busy_poll / 1e6  # seconds
        try:
            check_budget(self.busy_poll)
        except ValueError as exc:
            raise UsageError(f"--busy-poll {args.busy_poll:g} (microseconds): {exc}") from None
        orders = ORDERS if args.order == "all" else tuple(o.strip() for o in args.order.split(","))
        for order in orders:
            if order not in ORDERS:
                raise UsageError(f"--order {order!r}: choose from {', '.join(ORDERS)} or all")
        self.orders = orders
        self.baselines = not args.no_baselines
        if args.batch < 0:
            raise UsageError("--batch must not be negative")
        self.batch: int = args.batch
        self.compare_impl = args.compare_impl or command == "all"
        if args.client and not args.addr:
            raise UsageError("--client needs --addr HOST:PORT of the server")
        if args.client:
            check_addr(args.addr)
        if args.json:
            check_writable(args.json, "--json")
        if args.profile:
            try:
                os.makedirs(args.profile, exist_ok=True)
            except OSError as exc:
                raise UsageError(f"--profile {args.profile}: {exc.strerror or exc}") from None
        self.remote: str | None = args.addr if args.client else None

    def stream_concurrency(self, size: int) -> int:
        if self.args.concurrency is not None:
            return int(self.args.concurrency)
        return 64 if size <= 4096 else 4 if size <= 262144 else 1

    def stream_warmup(self, size: int) -> int:
        if self.args.warmup is not None:
            return int(self.args.warmup)
        return max(2, min(2000, (64 << 20) // size))

    def rounds(self) -> tuple[int, int]:
        """(measured, warmup) rounds of the rendezvous experiment."""
        if self.iters is not None:
            measured = self.iters
        elif self.command == "all" and self.args.duration is None:
            measured = ALL_ROUNDS
        else:
            assert self.duration is not None
            measured = max(1, int(self.duration * 1e9 / RDV_PERIOD_NS))
        warmup = self.args.warmup if self.args.warmup is not None else 20
        return measured, warmup

    def record(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self.args).items()}
        out.update(command=self.command, sizes=self.sizes, modes=self.modes, loop=self.loop,
                   impl=self.impl, iters=self.iters, duration=self.duration,
                   orders=list(self.orders), baselines=self.baselines, repeat=self.repeat,
                   compare_impl=self.compare_impl, batch=self.batch)
        return out


# -- running cases -------------------------------------------------------------------------------

class Bench:
    """Owns the workers of one run and executes its cases."""

    def __init__(self, opts: Options, out: TextIO, err: TextIO) -> None:
        self.opts = opts
        self.out = out
        self.err = err
        self.sessions: dict[str, tuple[WorkerLink, WorkerLink]] = {}
        self.done = 0
        self.total = 0
        self.case_no = 0
        # Why optional rows are skipped (None: they run); settled once the workers said hello.
        self.zmq_missing: str | None = zmq_available()
        self.batch_missing: str | None = (
            None if hasattr(rvz.Node, "send_many") and hasattr(rvz.Node, "recv_many")
            else "rvz.Node has no send_many/recv_many")

    # workers

    def session(self, impl: str) -> tuple[WorkerLink, WorkerLink]:
        pair = self.sessions.get(impl)
        if pair is not None:
            return pair
        a: WorkerLink
        b: WorkerLink
        if self.opts.remote:
            ra = RemoteWorker("a (server)", self.opts.remote, impl)
            self.sessions[impl] = (ra, ra)  # registered at once so close() finds it
            b = LocalWorker("b", impl)
            self.sessions[impl] = (ra, b)
            b.host = ra.local_host
            a = ra
        else:
            a = LocalWorker("a", impl)
            self.sessions[impl] = (a, a)
            b = LocalWorker("b", impl)
            self.sessions[impl] = (a, b)
        for link in (a, b):
            hello = link.start()
            loaded = hello.get("implementation")
            if loaded != impl:
                raise WorkerError(
                    f"worker {link.name} was asked for the {impl} hot paths but loaded {loaded} "
                    f"(RVZ_NO_EXTENSIONS={hello.get('env_no_extensions')!r}); "
                    + ("are the compiled modules built? (pip install -e .)" if impl == "compiled"
                       else ""))
        if self.opts.remote:
            a.offset_ns = control.clock_offset(a)
        for link in (a, b):  # a remote server may lack what this host has
            if link.hello.get("pyzmq_missing") and not self.zmq_missing:
                self.zmq_missing = f"worker {link.name}: {link.hello['pyzmq_missing']}"
            if link.hello.get("batch_api") is False and not self.batch_missing:
                self.batch_missing = f"worker {link.name}: rvz.Node has no send_many/recv_many"
        return a, b

    def close(self, interrupted: bool = False) -> None:
        """Stop every worker: politely after a run, at once after Ctrl-C or an error
        (a worker in the middle of a case would not read its quit command)."""
        grace = 0.0 if interrupted else 3.0
        for a, b in self.sessions.values():
            for link in (b, a):
                try:
                    link.close(grace)
                except Exception:  # closing must not hide the error that brought us here
                    pass
        self.sessions.clear()

    def progress(self, text: str) -> None:
        if not self.opts.args.quiet:
            print(text, file=self.err, flush=True)

    def run_case(self, case: dict[str, Any], impl: str | None = None,
                 timeout: float | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        a, b = self.session(impl or self.opts.impl)
        self.case_no += 1
        sides = {}
        for role, link in (("a", a), ("b", b)):
            side = dict(case, role=role, bind_host=link.host,
                        transport=case.get("transport", self.opts.transport),
                        loop=self.opts.loop, busy_poll=self.opts.busy_poll)
            if self.opts.args.shm_copy:
                side["node_options"] = {**(case.get("node_options") or {}), "shm_copy": True}
            if self.opts.args.profile:  # (Options made the directory)
                name = f"{self.case_no:02d}-{case['kind']}-{case['impl']}-{case.get('mode', '')}-" \
                       f"{size_label(int(case.get('size', 0)))}-{role}.prof"
                side["profile"] = os.path.abspath(os.path.join(self.opts.args.profile, name))
            sides[role] = side
        addrs = {"a": a.request({"op": "prepare", "case": sides["a"]})["addr"],
                 "b": b.request({"op": "prepare", "case": sides["b"]})["addr"]}
        for _ in range(8):
            # Each worker picks a free port on its own, so on one host both can pick the same
            # one (each released it before answering): ask again.
            if addrs["b"] is None or addrs["b"] != addrs["a"]:
                break
            addrs["b"] = b.request({"op": "prepare", "case": sides["b"]})["addr"]
        if "t0_ns" in case:  # the rendezvous schedule, in each worker's own clock
            for role, link in (("a", a), ("b", b)):
                sides[role]["t0_ns"] = case["t0_ns"] + link.offset_ns
        a.send({"op": "run", "case": sides["a"], "addrs": addrs})
        b.send({"op": "run", "case": sides["b"], "addrs": addrs})
        if timeout is None:
            timeout = 60.0 + (20.0 * self.opts.duration if self.opts.duration else 540.0)
        ra, rb = control.wait_all([a, b], timeout)
        return ra["result"], rb["result"]

    def step(self, text: str) -> None:
        self.done += 1
        self.progress(f"[{self.done:>2}/{self.total}] {text}")

    # stream

    def stream_case(self, variant: str, mode: str, size: int, impl: str | None = None) -> dict[str, Any]:
        opts = self.opts
        pattern = PATTERNS.get(variant)
        # The request/reply replica keeps as many requests out as rvz's Recv-Driven lanes.
        concurrency = (opts.stream_concurrency(size)
                       if variant in ("rvz", "rvz-hold", HOLD_TCP, "rvz-into", SOCKET_REPLY)
                       else 1)
        batch = opts.batch if variant == "rvz-batch" else None
        impl_of = "socket" if variant == SOCKET_REPLY else variant
        case = {"kind": "stream", "impl": "rvz" if pattern else impl_of, "mode": mode, "size": size,
                "warmup": opts.stream_warmup(size), "iters": opts.iters,
                "duration": opts.duration, "concurrency": concurrency,
                # --duration: still a few large messages (the slow streams baseline fewer)
                "min_messages": 3 if variant == "streams" else 10}
        if pattern:
            case["pattern"] = pattern
        if batch:
            case["batch"] = batch
        if variant == SOCKET_REPLY:
            case["reply"] = True
        if variant == "rvz-one":
            case["producer_yield"] = False  # a plain ``await send`` loop, nothing else
        if variant in ("rvz-hold", HOLD_TCP):
            case["hold_previous"] = True
        if variant == "rvz-into":  # torch tensors both ways where torch is installed
            case["into"] = "torch" if TORCH else "numpy"
        if variant == HOLD_TCP:
            case["transport"] = "tcp"
        elif pattern and opts.transport in ONESIDED:
            case["node_options"] = {"onesided": {"slot_budget": slot_budget(size)}}
        ra, rb = self.run_case(case, impl)
        row: dict[str, Any] = {"variant": variant, "mode": mode if pattern else None,
                               "size": size, "loop": opts.loop, "impl": impl or opts.impl,
                               "concurrency": concurrency, "label": label(variant, mode, opts.loop),
                               "pattern": pattern, "batch": batch,
                               "in_flight": batch or concurrency}
        row.update(rb)
        row["process"] = {"a": ra.get("process"), "b": rb.get("process")}
        self.step(f"stream {row['label']:<16} {size_label(size):>5}: "
                  f"{row['gbytes_per_s']:.3f} GB/s, {rate_label(row['msgs_per_s'])} msg/s")
        return row

    def stream(self) -> list[dict[str, Any]]:
        opts = self.opts
        rows = []
        for size in opts.sizes:
            runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
            for _ in range(opts.repeat):  # interleaved, so a burst of noise hits them all
                for variant, mode in self.stream_variants(size):
                    runs.setdefault((variant, mode), []).append(self.stream_case(variant, mode, size))
            for same in runs.values():
                same.sort(key=lambda r: r["gbytes_per_s"])
                row = dict(same[(len(same) - 1) // 2])  # the median run (lower median)
                row["runs_gbytes_per_s"] = [r["gbytes_per_s"] for r in same]
                row["runs_msgs_per_s"] = [r["msgs_per_s"] for r in same]
                row["runs_peak_above_idle"] = [r["memory"]["peak_above_idle"] for r in same
                                               if r.get("memory")]
                if row.get("memory") and row["runs_peak_above_idle"]:
                    # the worst peak of all runs counts, not the median's
                    worst = max(same, key=lambda r: r["memory"]["peak_above_idle"])
                    row["memory"] = worst["memory"]
                rows.append(row)
        for row in rows:
            base = {r["variant"]: r for r in rows if r["size"] == row["size"] and r["variant"] in BASELINES}
            sock, strm, zmq = base.get("socket"), base.get("streams"), base.get("zmq")
            row["baseline_socket_gbps"] = sock["gbytes_per_s"] if sock else None
            row["baseline_streams_msgs"] = strm["msgs_per_s"] if strm else None
            row["baseline_pyzmq_msgs"] = zmq["msgs_per_s"] if zmq else None
            row["ratio_socket"] = ratio(row["gbytes_per_s"], sock["gbytes_per_s"] if sock else None)
            row["ratio_streams"] = ratio(row["gbytes_per_s"], strm["gbytes_per_s"] if strm else None)
            row["ratio_pyzmq"] = ratio(row["gbytes_per_s"], zmq["gbytes_per_s"] if zmq else None)
            reply = base.get(SOCKET_REPLY)
            if reply is not None and row["mode"] == "recv":
                row["baseline_socket_reply_gbps"] = reply["gbytes_per_s"]
                row["ratio_socket_reply"] = ratio(row["gbytes_per_s"], reply["gbytes_per_s"])
            memcpy = base.get(MEMCPY)
            tcp = _find_row(rows, variant=HOLD_TCP, mode=row["mode"], size=row["size"])
            if memcpy is not None and row["variant"] == "rvz-hold":
                row["baseline_memcpy_gbps"] = memcpy["gbytes_per_s"]
                row["ratio_memcpy"] = ratio(row["gbytes_per_s"], memcpy["gbytes_per_s"])
                row["baseline_tcp_gbps"] = tcp["gbytes_per_s"] if tcp else None
                row["ratio_tcp"] = ratio(row["gbytes_per_s"], tcp["gbytes_per_s"] if tcp else None)
        return rows

    def baseline_variants(self) -> list[tuple[str, str]]:
        if not self.opts.baselines:
            return []
        base = [("socket", ""), ("streams", "")]
        return base + ([] if self.zmq_missing else [("zmq", "")])

    def variants(self) -> list[tuple[str, str]]:
        """Pingpong's: the baselines, then rvz in each mode."""
        return self.baseline_variants() + [("rvz", mode) for mode in self.opts.modes]

    def stream_variants(self, size: int) -> list[tuple[str, str]]:
        """Stream's at ``size``: the baselines, rvz's lanes, and the rows of the patterns
        that apply to this size."""
        out = self.variants()
        modes = self.opts.modes
        if size >= HOLD_MIN_SIZE and self.opts.baselines and "recv" in modes:
            out.insert(len(self.baseline_variants()), (SOCKET_REPLY, ""))
        # ``all`` stays short: there the batch and one-in-flight rows run only where a
        # target reads them (batch at 64B, one in flight Send-Driven).
        lean = self.opts.command == "all"
        if (size <= BATCH_MAX_SIZE and self.opts.batch and not self.batch_missing
                and not (lean and size != 64)):
            out += [("rvz-batch", mode) for mode in modes]
        if size in ONE_IN_FLIGHT_SIZES:
            out += [("rvz-one", mode) for mode in modes if not (lean and mode != "send")]
        if size >= HOLD_MIN_SIZE:
            out += [("rvz-hold", mode) for mode in modes]
            if not lean or size == MEMORY_SIZE:
                out += [("rvz-into", mode) for mode in modes]
            if self.opts.transport in ONESIDED and self.opts.baselines:
                out += [(MEMCPY, "")] + [(HOLD_TCP, mode) for mode in modes]
        return out

    def impl_compare(self) -> dict[str, Any] | None:
        """64B stream (Send-Driven if asked for) on compiled and on pure-Python workers,
        interleaved ``--repeat`` times; the medians are compared."""
        mode = "send" if "send" in self.opts.modes else self.opts.modes[0]
        runs: dict[str, list[float]] = {"compiled": [], "python": []}
        try:
            for _ in range(self.opts.repeat):
                for impl in runs:
                    runs[impl].append(self.stream_case("rvz", mode, 64, impl=impl)["msgs_per_s"])
        except WorkerError as exc:
            # e.g. the compiled modules are not built: say so, keep the rest of the run
            self.progress(f"compiled vs python: {exc}")
            return {"mode": mode, "size": 64, "error": str(exc), "ratio": None}
        finally:
            for impl in ("python", "compiled"):
                if impl != self.opts.impl and impl in self.sessions:
                    a, b = self.sessions.pop(impl)
                    b.close()
                    a.close()
        median = {impl: sorted(v)[(len(v) - 1) // 2] for impl, v in runs.items()}
        return {"mode": mode, "size": 64, "compiled_msgs_per_s": median["compiled"],
                "python_msgs_per_s": median["python"], "runs_msgs_per_s": runs,
                "ratio": ratio(median["compiled"], median["python"])}

    # pingpong

    def pingpong_case(self, variant: str, mode: str, size: int) -> dict[str, Any]:
        opts = self.opts
        concurrency = opts.args.concurrency or 1 if variant == "rvz" else 1
        warmup = opts.args.warmup if opts.args.warmup is not None else 200
        rvz_row = variant in ("rvz", ALREADY_SENT)
        case = {"kind": "pingpong", "impl": "rvz" if rvz_row else variant, "mode": mode,
                "size": size, "warmup": warmup, "iters": opts.iters, "duration": opts.duration,
                "concurrency": concurrency}
        if variant == ALREADY_SENT:  # (no claim_timeout: no value is pushed unasked)
            case.update(pattern="already-sent", node_options={"claim_timeout": None})
        ra, rb = self.run_case(case)
        samples = rb.pop("samples_ns")
        polls = variant in ("rvz", "streams") and opts.busy_poll > 0
        row = {"variant": variant, "mode": mode if rvz_row else None, "size": size,
               "loop": opts.loop, "impl": opts.impl, "concurrency": concurrency,
               "busy_poll_us": opts.busy_poll * 1e6 if polls else 0.0,
               "label": label(variant, mode, opts.loop, "pingpong")}
        row.update(report.latency_stats(samples))
        row["process"] = {"a": ra.get("process"), "b": rb.get("process")}
        # loop passes busy polling kept awake, both sides (None: neither polled)
        spins = [side["spins"] for side in (ra, rb) if side.get("spins") is not None]
        row["busy_poll_spins"] = sum(spins) if spins else None
        row["_samples"] = samples
        self.step(f"pingpong {row['label']:<16} {size_label(size):>5}: p50 {row['p50_us']:.1f} us, "
                  f"p99 {row['p99_us']:.1f} us")
        return row

    def pingpong(self) -> list[dict[str, Any]]:
        opts = self.opts
        rows = []
        sizes = opts.sizes if opts.command == "pingpong" else [64]
        for size in sizes:
            runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
            # The recv of a value already sent: Recv-Driven's one request and its answer.
            sent = [(ALREADY_SENT, "recv")] if "recv" in opts.modes else []
            for _ in range(opts.repeat):
                for variant, mode in self.variants() + sent:
                    runs.setdefault((variant, mode), []).append(self.pingpong_case(variant, mode, size))
            for same in runs.values():
                # one distribution from every run's round trips
                samples = [s for r in same for s in r.pop("_samples")]
                row = dict(same[0])
                row.update(report.latency_stats(samples))
                row["runs_p50_us"] = [r["p50_us"] for r in same]
                if row["busy_poll_spins"] is not None:
                    row["busy_poll_spins"] = sum(r["busy_poll_spins"] or 0 for r in same)
                row["samples_us"] = [s / 1e3 for s in report.subsample(samples)]
                rows.append(row)
        for row in rows:
            base = {r["variant"]: r for r in rows if r["size"] == row["size"] and r["variant"] in BASELINES}
            sock, strm, zmq = base.get("socket"), base.get("streams"), base.get("zmq")
            row["baseline_socket_p50_us"] = sock["p50_us"] if sock else None
            row["baseline_streams_p50_us"] = strm["p50_us"] if strm else None
            row["baseline_pyzmq_p50_us"] = zmq["p50_us"] if zmq else None
            row["ratio_socket"] = ratio(row["p50_us"], sock["p50_us"] if sock else None)
            row["ratio_streams"] = ratio(row["p50_us"], strm["p50_us"] if strm else None)
            row["ratio_pyzmq"] = ratio(row["p50_us"], zmq["p50_us"] if zmq else None)
        return rows

    # rendezvous

    def rendezvous_case(self, order: str, size: int) -> list[dict[str, Any]]:
        """One arrival order; the modes alternate round by round (same conditions).

        With baselines, the same rounds run again on a plain socket (``socket_rendezvous``):
        each mode's bytes without rvz, the host's own share of its latency.
        """
        modes = self.opts.modes
        measured, warmup = self.opts.rounds()
        rounds = measured * len(modes) + warmup
        case = {"kind": "rendezvous", "impl": "rvz", "mode": modes[0], "modes": modes,
                "size": size, "order": order, "rounds": rounds, "period_ns": RDV_PERIOD_NS,
                "gap_ns": RDV_GAP_NS, "spread_ns": RDV_SPREAD_NS,
                "seed": 20240 + ORDERS.index(order), "warmup": warmup, "concurrency": 1}
        latencies = self.rendezvous_rounds(case)
        rows = []
        for mode, (latency, idx, sends, calls, done) in zip(modes, latencies, strict=True):
            n = len(idx)
            row = {"order": order, "mode": mode, "size": size, "rounds": n,
                   "warmup_rounds": warmup, "interleaved_with": [m for m in modes if m != mode],
                   "loop": self.opts.loop, "impl": self.opts.impl,
                   "producer_waited": sum(1 for i in idx if sends[i] < calls[i]) / n,
                   "consumer_waited": sum(1 for i in idx if calls[i] < sends[i]) / n,
                   "recv_call_p50_us": report.latency_stats([done[i] - calls[i] for i in idx])["p50_us"],
                   "clock": "CLOCK_MONOTONIC (one host)" if not self.opts.remote else
                            "offset estimated over the control channel (two hosts)",
                   "baseline_socket_p50_us": None}
            row.update(report.latency_stats(latency))
            row["samples_us"] = [x / 1e3 for x in latency]
            rows.append(row)
            self.step(f"rendezvous {order:<14} {mode}-driven: p50 {row['p50_us']:.1f} us, "
                      f"producer waited {row['producer_waited']:.0%}, consumer waited "
                      f"{row['consumer_waited']:.0%}")
        if self.opts.baselines:
            replica = self.rendezvous_rounds(dict(case, impl="socket"))
            for row, (latency, *_) in zip(rows, replica, strict=True):
                row["baseline_socket_p50_us"] = report.latency_stats(latency)["p50_us"]
                self.step(f"rendezvous {order:<14} socket {RDV_WIRE[row['mode']]}: "
                          f"p50 {row['baseline_socket_p50_us']:.1f} us")
        return rows

    def rendezvous_rounds(self, case: dict[str, Any]) -> list[tuple[list[int], list[int], list[int],
                                                                   list[int], list[int]]]:
        """Run the rounds of ``case`` from a schedule starting shortly; per mode: the
        latencies (ns from the later call to the recv's end), the measured rounds' indices,
        and the producer's call, the consumer's call and its end of every round."""
        modes = case["modes"]
        warmup, rounds = case["warmup"], case["rounds"]
        case = dict(case, t0_ns=time.monotonic_ns() + RDV_LEAD_NS)
        a, b = self.session(self.opts.impl)
        ra, rb = self.run_case(case, timeout=60.0 + rounds * RDV_PERIOD_NS / 1e9 * 3)
        # Into the parent's clock (offsets are 0 on one host: CLOCK_MONOTONIC is system-wide).
        sends = [t - a.offset_ns for t in ra["send_ns"]]
        calls = [t - b.offset_ns for t in rb["recv_ns"]]
        done = [t - b.offset_ns for t in rb["done_ns"]]
        out = []
        for k in range(len(modes)):
            idx = [i for i in range(warmup, rounds) if i % len(modes) == k]
            out.append(([done[i] - max(sends[i], calls[i]) for i in idx], idx, sends, calls, done))
        return out

    def rendezvous(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        rows = []
        size = self.opts.sizes[0] if self.opts.command == "rendezvous" else 64
        for order in self.opts.orders:
            rows.extend(self.rendezvous_case(order, size))
        summary = []
        for order in self.opts.orders:
            send = _find_row(rows, order=order, mode="send")
            recv = _find_row(rows, order=order, mode="recv")
            if send and recv:
                summary.append({"order": order, "send_p50_us": send["p50_us"],
                                "recv_p50_us": recv["p50_us"],
                                "send_over_recv_p50": ratio(send["p50_us"], recv["p50_us"]),
                                # the same ratio of the socket replica: the host's own
                                "socket_push_over_reply_p50": ratio(
                                    send["baseline_socket_p50_us"], recv["baseline_socket_p50_us"])})
        return rows, summary

    # the whole run

    def count_cases(self) -> int:
        opts = self.opts
        n = 0
        if opts.command in ("stream", "all"):
            n += sum(len(self.stream_variants(size)) for size in opts.sizes) * opts.repeat
            if opts.compare_impl:
                n += 2 * opts.repeat
        if opts.command in ("pingpong", "all"):
            n += ((len(opts.sizes) if opts.command == "pingpong" else 1) * len(self.variants())
                  * opts.repeat)
        if opts.command in ("rendezvous", "all"):
            n += len(opts.orders) * len(opts.modes) * (2 if opts.baselines else 1)
        return n

    def run(self) -> dict[str, Any]:
        opts = self.opts
        started = time.time()
        self.session(opts.impl)  # the workers' hellos settle which optional rows can run
        if not opts.baselines:
            self.zmq_missing = self.zmq_missing or "--no-baselines"
        self.total = self.count_cases()
        results: dict[str, Any] = {
            "tool": "rvz-bench", "schema": 1, "command": opts.command,
            "argv": sys.argv[1:], "options": opts.record(),
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": dict(machine(), calibration=calibrate()), "versions": versions(),
            "transport": opts.transport, "loop": opts.loop, "impl": opts.impl,
            "stream": [], "pingpong": [], "rendezvous": [], "rendezvous_summary": [],
            "impl_compare": None,
            "pyzmq": {"used": False, "skipped": self.zmq_missing if opts.command != "rendezvous" else None},
            "batch": {"keys_per_call": opts.batch, "skipped": self.batch_missing
                      if opts.command in ("stream", "all") and opts.batch else None},
            "notes": self.notes(),
        }
        self.progress(f"rvz-bench {opts.command}: {self.total} cases, {opts.loop}, {opts.impl} hot "
                      f"paths, {opts.transport}" + (f", server {opts.remote}" if opts.remote else ""))
        if opts.command in ("stream", "all"):
            results["stream"] = self.stream()
            if opts.compare_impl:
                results["impl_compare"] = self.impl_compare()
        if opts.command in ("pingpong", "all"):
            results["pingpong"] = self.pingpong()
        if opts.command in ("rendezvous", "all"):
            results["rendezvous"], results["rendezvous_summary"] = self.rendezvous()
        results["pyzmq"]["used"] = any(r["variant"] == "zmq"
                                       for r in results["stream"] + results["pingpong"])
        results["workers"] = {impl: {"a": a.hello, "b": b.hello} for impl, (a, b) in self.sessions.items()}
        results["memory"] = [{"mode": r["mode"], "size": r["size"], **r["memory"]}
                             for r in results["stream"] if r["variant"] == "rvz" and r.get("memory")]
        results["targets"] = report.evaluate_targets(results)
        results["elapsed_s"] = time.time() - started
        return results


    def notes(self) -> list[str]:
        """Said once, in the report: which optional rows were skipped, and why."""
        opts = self.opts
        out = []
        if self.zmq_missing and opts.baselines and opts.command != "rendezvous":
            out.append(f"pyzmq baselines skipped: {self.zmq_missing}")
        if (self.batch_missing and opts.batch and opts.command in ("stream", "all")
                and any(size <= BATCH_MAX_SIZE for size in opts.sizes)):
            out.append(f"batch rows skipped: {self.batch_missing}")
        return out


def label(variant: str, mode: str, loop: str, kind: str = "stream") -> str:
    if variant == "socket":
        return "blocking socket"
    if variant == SOCKET_REPLY:
        return "socket request/reply"
    if variant == "streams":
        return f"{loop} streams"
    if variant == "zmq":
        return "pyzmq PUSH/PULL" if kind == "stream" else "pyzmq REQ/REP"
    if variant == MEMCPY:
        return "numpy copy (memcpy)"
    suffix = {"rvz-batch": " batch", "rvz-one": " 1 in flight", "rvz-hold": " holds previous",
              HOLD_TCP: " holds previous, tcp", "rvz-into": " into=" + (" torch" if TORCH else ""),
              ALREADY_SENT: ", value already sent"}
    return f"rvz {mode}-driven{suffix.get(variant, '')}"


def _find_row(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


# -- the printed report ---------------------------------------------------------------------------

def render(results: dict[str, Any], targets: bool = False) -> str:
    """The printed report; the development targets' table only when ``targets``."""
    parts = []
    m = results["machine"]
    parts.append(f"rvz-bench {results['command']}: rvz {results['versions']['rvz']}, "
                 f"{results['impl']} hot paths, {results['loop']}, {results['transport']}, "
                 f"2 processes on {m.get('hostname')} ({m.get('cpus')} CPUs, "
                 f"{m.get('cpu_model', m.get('machine'))}); {results['elapsed_s']:.1f} s")
    poll_us = (results.get("options") or {}).get("busy_poll") or 0.0
    if poll_us:  # (absent from the JSON of runs before it existed)
        parts.append(f"busy-poll {poll_us:g} us: rvz nodes and pingpong's streams echo keep their "
                     "loop polling while they wait (a CPU spins a side); other baselines sleep")
    if (results.get("options") or {}).get("shm_copy"):
        parts.append("shm-copy: rvz nodes copy every one-sided value out of the peer's memory")
    cal = m.get("calibration")
    if cal:  # (absent from the JSON of runs before it was measured)
        parts.append(f"machine speed (same run): Python loop step {cal['python_step_ns']:.0f} ns, "
                     f"getppid() {cal['syscall_ns'] / 1000:.2f} us, "
                     f"64 MiB copy {cal['copy_gb_per_s']:.1f} GB/s")
    if results["stream"]:
        parts += _stream_table(results["stream"])
    comp = results.get("impl_compare")
    if comp and comp.get("ratio") is not None:
        parts.append(f"\n  compiled vs pure Python, 64B {comp['mode']}-driven stream: "
                     f"{rate_label(comp['compiled_msgs_per_s'])} vs "
                     f"{rate_label(comp['python_msgs_per_s'])} msg/s = {comp['ratio']:.2f}x")
    if results["pingpong"]:
        rows = []
        for r in results["pingpong"]:
            rows.append([size_label(r["size"]), r["label"], f"{r['p50_us']:.1f}",
                         f"{r['p90_us']:.1f}", f"{r['p99_us']:.1f}", f"{r['max_us']:.0f}",
                         ratio_label(r.get("ratio_socket")), ratio_label(r.get("ratio_streams")),
                         ratio_label(r.get("ratio_pyzmq"))])
        parts.append("\npingpong: round-trip latency in us (ratios of p50 to the same-run baselines)")
        parts.append(report.table(["size", "variant", "p50", "p90", "p99", "max", "vs socket",
                                   "vs streams", "vs pyzmq"], rows,
                                  right=[True, False, True, True, True, True, True, True, True]))
    if results["rendezvous"]:
        rows = []
        summary = {s["order"]: s for s in results["rendezvous_summary"]}
        for r in results["rendezvous"]:
            ratios = summary.get(r["order"], {})
            socket_p50 = r.get("baseline_socket_p50_us")
            rows.append([r["order"], f"{r['mode']}-driven", f"{r['p50_us']:.1f}", f"{r['p90_us']:.1f}",
                         f"{r['p99_us']:.1f}", f"{r['max_us']:.0f}", f"{r['producer_waited']:.0%}",
                         f"{r['consumer_waited']:.0%}",
                         ratio_label(ratios.get("send_over_recv_p50")) if r["mode"] == "send" else "",
                         f"{socket_p50:.1f}" if socket_p50 is not None else "-",
                         ratio_label(ratios.get("socket_push_over_reply_p50"))
                         if r["mode"] == "send" else ""])
        parts.append("\nrendezvous: us from the later of send/recv to recv done "
                     f"({results['rendezvous'][0]['rounds']} rounds each; who called first = who waited;"
                     " socket: the same rounds' bytes on a plain socket, push for send-driven,"
                     " request+reply for recv-driven)")
        parts.append(report.table(["order", "mode", "p50", "p90", "p99", "max", "producer waited",
                                   "consumer waited", "send/recv p50", "socket p50",
                                   "socket push/reply"], rows,
                                  right=[False, False] + [True] * 9))
    for note in results.get("notes") or []:
        parts.append(f"\nnote: {note}")
    if targets:
        parts.append("")
        parts.append(report.targets_table(results["targets"]))
    return "\n".join(parts)


def _stream_table(stream: list[dict[str, Any]]) -> list[str]:
    """The stream section of the printed report: its heading and its table."""
    rows = []
    onesided = any(r["variant"] == MEMCPY for r in stream)
    for r in stream:
        mem = r.get("memory") or {}
        peak = mem.get("peak_above_idle")
        rows.append([size_label(r["size"]), r["label"], f"{r['gbytes_per_s']:.3f}",
                     rate_label(r["msgs_per_s"]), ratio_label(r.get("ratio_socket")),
                     ratio_label(r.get("ratio_streams")), ratio_label(r.get("ratio_pyzmq")),
                     r.get("in_flight", r["concurrency"]),
                     "-" if peak is None else f"{max(peak, 0) / 2**20:.0f}"])
        if onesided:
            rows[-1][5:5] = [ratio_label(r.get("ratio_tcp")), ratio_label(r.get("ratio_memcpy"))]
    heading = ("\nstream: one-way throughput (GB/s = 1e9 B/s; msg/s counts messages, also in "
               "batches; ratios of GB/s to the same-run baselines; peak = consumer RSS "
               "high-water above idle)")
    head = ["size", "variant", "GB/s", "msg/s", "vs socket", "vs streams", "vs pyzmq",
            "in flight", "peak MiB"]
    if onesided:  # the holds-previous rows against the same rows over TCP, and memcpy
        head[5:5] = ["vs tcp", "vs memcpy"]
    return [heading, report.table(head, rows, right=[h != "variant" for h in head])]


def _auto_loop_name() -> str:
    """What ``--loop auto`` resolves to here (a loop is made to find out, then closed)."""
    probe = rvz.new_event_loop("auto")
    try:
        return rvz.loop_name(probe)
    finally:
        probe.close()


# -- entry point ---------------------------------------------------------------------------------

def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop workers


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:
        from .worker import main as worker_main
        return worker_main()
    parser = build_parser()
    args = parser.parse_args(command_first(parser, argv))
    if threading_is_main():
        signal.signal(signal.SIGTERM, _terminate)
    err = sys.stderr
    if args.server:
        if not args.addr:
            print("rvz-bench: --server needs --addr HOST:PORT to listen on", file=err)
            return 2
        try:
            check_addr(args.addr)
        except UsageError as exc:
            print(f"rvz-bench: {exc}", file=err)
            return 2
        try:
            return control.serve(args.addr, args.once, lambda text: print(text, file=err, flush=True))
        except WorkerError as exc:
            print(f"rvz-bench: {exc}", file=err)
            return 1
        except KeyboardInterrupt:
            return 130
    try:
        opts = Options(args)
        check_transport(opts.transport)
        if args.plot:  # before the run, not after it
            why = report.plot_unavailable()
            if why:
                raise UsageError(f"--plot: {why}")
    except UsageError as exc:
        print(f"rvz-bench: {exc}", file=err)
        return 2
    bench = Bench(opts, sys.stdout, err)
    finished = False
    try:
        results = bench.run()
        finished = True
    except WorkerError as exc:
        print(f"rvz-bench: {exc}", file=err)
        return 1
    except KeyboardInterrupt:
        # Stop the workers before saying so: if stderr is a pipe nobody drains yet, the
        # print may block, and the workers must not outlive us waiting on it.
        bench.close(interrupted=True)
        print("rvz-bench: interrupted; workers stopped", file=err)
        return 130
    finally:
        bench.close(interrupted=not finished)
    print(render(results, targets=args.targets), file=sys.stdout, flush=True)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
                f.write("\n")
        except OSError as exc:
            print(f"rvz-bench: --json {args.json} not written: {exc}", file=err)
            return 1
    if args.plot:
        try:
            drawn = report.plot(results, args.plot)
        except RuntimeError as exc:
            print(f"rvz-bench: {exc}", file=err)
            return 1
        if not drawn:
            print(f"rvz-bench: nothing to plot, {args.plot} not written", file=err)
    return 0


def command_first(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Move the subcommand to the front (``all`` when there is none).

    Options may come before or after it; parsing them all after it keeps argparse's
    subparser defaults from overwriting options given first.
    """
    if any(a in ("-h", "--help") for a in argv) and not any(a in COMMANDS for a in argv):
        return argv
    takes_value = {opt for action in parser._actions if action.nargs != 0
                   for opt in action.option_strings}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in COMMANDS:
            return [token, *argv[:i], *argv[i + 1:]]
        if token in takes_value:
            i += 1  # skip the option's value (``--order all`` is not the command)
        i += 1
    return ["all", *argv]


def check_addr(addr: str) -> None:
    """``--addr`` must be HOST:PORT (the control connection's address)."""
    try:
        cluster.split_address(addr)
    except ConfigError as exc:
        raise UsageError(f"--addr: {exc}") from None


def check_writable(path: str, option: str) -> None:
    """Fail before the run, not after it, when ``path`` cannot be written."""
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: not writable")


def threading_is_main() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def check_transport(transport: str) -> None:
    """Fail early, in the node's own words, if this build or host lacks ``transport``."""
    try:
        rvz.Node({"a": ["127.0.0.1:1"]}, "a", 0, transport=cast("rvz.TransportName", transport))
    except ValueError as exc:
        raise UsageError(f"--transport {transport}: {exc}") from None
    if transport in ("shm", "verbs"):
        try:
            onesided = importlib.import_module("rvz.onesided")
        except ImportError as exc:
            raise UsageError(f"--transport {transport} is not available in this build: {exc}") from None
        why = onesided.available().get(transport)
        if why:
            raise UsageError(f"--transport {transport} is not available: {why}")
