"""``python -m examples.param_server [demo|serve|train|replica|bench|reshard]``: the PS service.

* ``demo`` (the default): ``--shards`` PS shard processes and ``--workers`` worker processes
  on loopback train the synthetic workload; each process's report is printed. With
  ``--checkpoint-dir`` and ``--restart``, a shard that dies is started again from its last
  checkpoint (``--kill-shard N`` kills one with SIGKILL, to show it: when every worker
  reached ``--kill-at-step``, half of ``--steps`` by default, or after ``--kill-after S``).
* ``serve --job ps --task N``: one PS shard, on its own host. ``--restore`` restarts it from
  ``--checkpoint-dir`` (its workers rejoin it).
* ``train --job worker --task N``: one worker.
* ``replica --task N --every S``: a read-only copy of every shard (a task of the cluster's
  ``replica`` job; the shards serve it when the cluster names one), brought up to date by
  each shard's delta every S seconds until the shards end, answering the workers' reads
  (``ReplicaReader``) meanwhile; prints what it holds.
* ``bench --json out.json``: table, pull, push and checkpoint figures, each next to a
  baseline measured in the same run (see bench.py).
* ``reshard --from DIR --shards M --to DIR2``: the newest complete whole-job cut of DIR (see
  ``--cut-every``), for M shards: every row moves, unchanged, to its shard among M.

``serve`` and ``train`` take the cluster from ``--cluster`` (JSON, or a file holding it) or
from ``TF_CONFIG`` (``{"cluster": {...}, "task": {"type": "ps", "index": 0}}``); every
process of a job must get the same service options (tables, consistency, mode).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

import rvz
from rvz.poll import check_budget

from ..common import (
    LOCAL_HOST,
    Stopped,
    add_log_option,
    add_tls_options,
    configure_logging,
    stop_on_signals,
    tls_files,
)
from . import cut
from .launch import (
    Processes,
    PSConfig,
    TableSpec,
    keep_freed_memory,
    local_cluster,
    resolve_task,
    restarter,
    run_shard,
    start_shards,
)
from .optimizers import OPTIMIZERS
from .protocol import PS_JOB, REPLICA_JOB, WORKER_JOB
from .replica import run_replica
from .workload import WorkerConfig, run_worker, worker_process

COMMANDS = ("demo", "serve", "train", "replica", "bench", "reshard")


def parse_tables(text: str | None, dim: int, optimizer: str, lr: float | None) -> tuple[TableSpec, ...]:
    """``"user:16,item:32:adam"`` -> table specs (name:dim[:optimizer[:lr]]); ValueError
    naming the bad part."""
    if not text:
        return ()
    specs: list[TableSpec] = []
    for part in text.split(","):
        fields = part.split(":")
        if not fields[0] or len(fields) > 4:
            raise ValueError(f"{part!r} is not name:dim[:optimizer[:lr]]")
        try:
            spec = TableSpec(fields[0], int(fields[1]) if len(fields) > 1 else dim,
                             fields[2] if len(fields) > 2 else optimizer,
                             float(fields[3]) if len(fields) > 3 else lr)
        except ValueError:
            raise ValueError(f"{part!r}: the dim must be an integer and the lr a number") from None
        if spec.dim < 1:
            raise ValueError(f"{part!r}: the dim must be at least 1")
        if spec.optimizer not in OPTIMIZERS:
            raise ValueError(f"{part!r}: unknown optimizer {spec.optimizer!r} "
                             f"(one of {', '.join(sorted(OPTIMIZERS))})")
        if spec.lr is not None and not spec.lr > 0:
            raise ValueError(f"{part!r}: the lr must be positive")
        if any(s.name == spec.name for s in specs):
            raise ValueError(f"table {spec.name!r} is named twice")
        specs.append(spec)
    return tuple(specs)


def add_service_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=int, default=16, help="embedding width (single table)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad")
    p.add_argument("--lr", type=float, default=None, help="learning rate (optimizer default)")
    p.add_argument("--tables", default=None, help="several tables: name:dim[:optimizer[:lr]],...")
    p.add_argument("--consistency", choices=("asp", "ssp", "bsp"), default="asp")
    p.add_argument("--staleness", type=int, default=2, help="SSP bound, in clocks")
    p.add_argument("--min-count", type=int, default=0, help="admission: lookups before a row exists")
    p.add_argument("--ttl", type=int, default=None, help="evict rows idle this many steps")
    p.add_argument("--max-rows", type=int, default=None, help="evict LRU rows beyond this (per shard)")
    p.add_argument("--evict-every", type=int, default=50, help="clocks between eviction rounds (0: off)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="clocks between checkpoints (0: off)")
    p.add_argument("--full-every", type=int, default=4, help="every Nth checkpoint is full")
    p.add_argument("--mode", choices=("recv", "send"), default="recv",
                   help="rvz mode of every node: Recv-Driven or Send-Driven")
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    p.add_argument("--busy-poll", type=float, default=0.0, metavar="US",
                   help="rvz's busy_poll for every node, in microseconds (0: off); pays when "
                   "each process has a CPU of its own")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="worker processes (tasks of the worker job)")
    p.add_argument("--progress-every", type=float, default=10.0, metavar="S",
                   help="seconds between progress lines of each shard and worker (0: none)")
    p.add_argument("--cut-every", type=int, default=0, metavar="N",
                   help="whole-job cuts (bsp): every N clocks, every shard and worker at one clock")
    p.add_argument("--cut-dir", default=None, help="where the cuts go (default: --resume's)")
    p.add_argument("--worker-rejoin", type=float, default=0.0, metavar="S",
                   help="asp/ssp: a lost worker's place waits S seconds for a new process of its "
                   "task, which goes on at the clock the lost one reached (0: dropped for good)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="restart the whole job, with fresh processes, from DIR's newest complete cut")
    add_log_option(p)
    add_tls_options(p)


def add_worker_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=200, help="training steps per worker")
    p.add_argument("--batch", type=int, default=256, help="samples per step")
    p.add_argument("--bag", type=int, default=4, help="ids per sample")
    p.add_argument("--vocab", type=int, default=20000, help="distinct ids of the Zipf law")
    p.add_argument("--restart-timeout", type=float, default=60.0,
                   help="how long a worker waits for a lost shard to come back")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.param_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="shards and workers as local processes")
    add_service_options(demo)
    add_worker_options(demo)
    demo.add_argument("--shards", type=int, default=2, help="PS shard processes")
    demo.add_argument("--restart", action="store_true", help="restart a dead shard from its checkpoint")
    demo.add_argument("--kill-shard", type=int, default=None, help="SIGKILL this shard once (with --restart)")
    demo.add_argument("--kill-at-step", type=int, default=None,
                      help="the shard kills itself when every worker reached this step "
                      "(default: half of --steps)")
    demo.add_argument("--kill-after", type=float, default=None,
                      help="kill the shard after this many seconds instead of at a step")
    demo.add_argument("--timeout", type=float, default=120.0, help="bound on the whole run, seconds")
    demo.add_argument("--host", default=LOCAL_HOST, help="the address every process listens on")
    demo.add_argument("--crash-job-at", type=int, default=None, metavar="STEP",
                      help="a demo of --resume: worker 0 SIGKILLs every process of the job (its "
                      "process group) at STEP, once the last cut before it is complete")
    for name in ("serve", "train"):
        one = sub.add_parser(name, help=f"{name} one task (multi-host)")
        add_service_options(one)
        if name == "train":
            add_worker_options(one)
        one.add_argument("--cluster", default=None, help="cluster JSON (or a file), else TF_CONFIG")
        one.add_argument("--job", default=None)
        one.add_argument("--task", type=int, default=None)
        one.add_argument("--restore", action="store_true", help="restart from --checkpoint-dir")
    replica = sub.add_parser("replica", help="a read-only copy of every shard, kept current by deltas")
    add_service_options(replica)
    replica.add_argument("--cluster", default=None, help="cluster JSON (or a file), else TF_CONFIG")
    replica.add_argument("--job", default=None)
    replica.add_argument("--task", type=int, default=None)
    replica.add_argument("--every", type=float, default=1.0, metavar="S", help="seconds between syncs")
    replica.add_argument("--timeout", type=float, default=30.0, help="bound on each shard's answer, seconds")
    bench = sub.add_parser("bench", help="measure the table, pull, push and checkpoints")
    bench.add_argument("--json", default=None, help="write the figures here")
    bench.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    bench.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    add_log_option(bench)
    reshard = sub.add_parser("reshard", help="a whole-job checkpoint for another number of shards")
    reshard.add_argument("--from", dest="source", required=True, metavar="DIR",
                         help="the job's cut directory")
    reshard.add_argument("--shards", type=int, required=True, help="the new number of shards")
    reshard.add_argument("--to", dest="target", required=True, metavar="DIR2", help="a new directory")
    add_log_option(reshard)
    if not argv or argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["demo", *argv]  # the old single-command form still runs the demo
    args = p.parse_args(argv)
    if args.command == "replica":
        try:
            args.table_specs = parse_tables(args.tables, args.dim, args.optimizer, args.lr)
            args.tls = tls_files(args)
            if not args.every >= 0 or not args.timeout > 0:
                raise ValueError("--every must be at least 0 and --timeout positive")
            args.cluster_spec, args.job, args.task = resolve_task(
                args.cluster, args.job or REPLICA_JOB, args.task, REPLICA_JOB, "replica")
            args.resume_cut, args.start_clock = None, 0
        except ValueError as exc:
            replica.error(str(exc))
    if args.command in ("demo", "serve", "train"):
        parser = {"demo": demo, "serve": sub.choices["serve"], "train": sub.choices["train"]}[args.command]
        try:
            check_args(args)
        except ValueError as exc:
            parser.error(str(exc))  # exit 2, before any process starts
    return args


def check_args(args: argparse.Namespace) -> None:
    """Refuse what would crash a child, hang, or be silently ignored (ValueError)."""
    def at_least(name: str, low: float, *, optional: bool = False) -> None:
        value = getattr(args, name.lstrip("-").replace("-", "_"))
        if (value is not None or not optional) and not value >= low:
            raise ValueError(f"{name} must be at least {low:g}, not {value}")

    for name in ("--dim", "--full-every"):
        at_least(name, 1)
    for name in ("--staleness", "--min-count", "--evict-every", "--checkpoint-every", "--progress-every"):
        at_least(name, 0)
    for name in ("--ttl", "--max-rows"):
        at_least(name, 1, optional=True)
    if args.lr is not None and not args.lr > 0:
        raise ValueError(f"--lr must be positive, not {args.lr}")
    args.table_specs = parse_tables(args.tables, args.dim, args.optimizer, args.lr)
    args.tls = tls_files(args)
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir (where to write them)")
    at_least("--cut-every", 0)
    at_least("--worker-rejoin", 0)
    if args.worker_rejoin and args.consistency == "bsp":
        raise ValueError("--worker-rejoin needs --consistency asp or ssp: under bsp the interrupted "
                         "clock must be replayed exactly, and this demo's worker keeps no journal to "
                         "replay it from (the embedding pipeline's does)")
    if args.resume and args.cut_every and not args.cut_dir:
        args.cut_dir = args.resume  # go on writing cuts where they were
    if args.cut_every and not args.cut_dir:
        raise ValueError("--cut-every needs --cut-dir (where to write the cuts)")
    if (args.cut_every or args.resume) and args.consistency != "bsp":
        raise ValueError("whole-job cuts and --resume need --consistency bsp: with asp or ssp the "
                         "shards never stand at one clock together")
    if args.resume and not os.path.isdir(args.resume):
        raise ValueError(f"--resume {args.resume}: no such directory")
    if args.command in ("demo", "train"):
        for name in ("--steps", "--batch", "--bag", "--vocab"):
            at_least(name, 1)
        if not args.restart_timeout > 0:
            raise ValueError(f"--restart-timeout must be positive, not {args.restart_timeout}")
    if args.command == "demo":
        for name in ("--shards", "--workers"):
            at_least(name, 1)
        if not args.timeout > 0:
            raise ValueError(f"--timeout must be positive, not {args.timeout}")
        if args.restart and not args.checkpoint_dir:
            raise ValueError("--restart needs --checkpoint-dir (a shard restarts from its checkpoints)")
        if args.kill_shard is None:
            if args.kill_at_step is not None or args.kill_after is not None:
                raise ValueError("--kill-at-step and --kill-after need --kill-shard")
        else:
            if not 0 <= args.kill_shard < args.shards:
                raise ValueError(f"--kill-shard {args.kill_shard}: there are shards 0 to {args.shards - 1}")
            if not args.restart:
                raise ValueError("--kill-shard needs --restart (and --checkpoint-dir): without them "
                                 "the run just fails")
            if args.kill_after is not None:
                if args.kill_at_step is not None:
                    raise ValueError("give --kill-at-step or --kill-after, not both")
                if not args.kill_after >= 0:
                    raise ValueError(f"--kill-after must be at least 0, not {args.kill_after}")
            else:
                if args.kill_at_step is None:
                    args.kill_at_step = args.steps // 2
                if not 1 <= args.kill_at_step < args.steps:
                    raise ValueError(f"--kill-at-step {args.kill_at_step}: the kill must come within the "
                                     f"run, at a step from 1 to {args.steps - 1} (--steps {args.steps})")
    else:
        if args.restore and not args.checkpoint_dir:
            raise ValueError("--restore needs --checkpoint-dir (where the checkpoints are)")
        args.cluster_spec, args.job, args.task = resolve_task(
            args.cluster, args.job, args.task, PS_JOB if args.command == "serve" else WORKER_JOB,
            args.command)
    if args.command == "demo":
        shards, workers = args.shards, args.workers
        if args.crash_job_at is not None and not 1 <= args.crash_job_at < args.steps:
            raise ValueError(f"--crash-job-at {args.crash_job_at}: not a step of the run (1 to "
                             f"{args.steps - 1})")
    else:
        shards, workers = len(args.cluster_spec[PS_JOB]), len(args.cluster_spec[WORKER_JOB])
    args.resume_cut, args.start_clock = resume_point(args, shards, workers)


# What must be the same for a job to resume from another's cut (--steps may grow).
JOB_SETTINGS = ("tables", "dim", "optimizer", "lr", "consistency", "seed", "min_count", "ttl", "max_rows",
                "evict_every", "batch", "bag", "vocab")


def resume_point(args: argparse.Namespace, shards: int, workers: int) -> tuple[str | None, int]:
    """(cut directory, clock) to resume from, or (None, 0); ValueError when the job's
    settings differ from the checkpoint's (naming what to give), or no cut is complete."""
    mine = {name: getattr(args, name) for name in JOB_SETTINGS if hasattr(args, name)}
    mine.update(shards=shards, workers=workers, sharding=cut.SHARDING)
    if not args.resume:
        if args.cut_every:
            cut.write_job(args.cut_dir, mine)
        return None, 0
    try:
        saved = cut.read_job(args.resume)
        if saved.get("shards") != shards:
            raise ValueError(
                f"--resume {args.resume}: its job ran with {saved.get('shards')} shards, this one has "
                f"{shards}; run {saved.get('shards')} shards, or reshard the checkpoint first: python -m "
                f"examples.param_server reshard --from {args.resume} --shards {shards} --to NEW_DIR, then "
                f"--resume NEW_DIR")
        for name, value in mine.items():
            if name in saved and saved[name] != value:
                option = "--" + name.replace("_", "-")
                raise ValueError(f"--resume {args.resume}: its job ran with {option} {saved[name]}, this "
                                 f"one with {value}; give {option} {saved[name]} to resume it")
        clock, where = cut.latest(args.resume, shards, workers)
    except cut.CutError as exc:
        raise ValueError(str(exc)) from None
    if args.cut_every and os.path.abspath(args.cut_dir) != os.path.abspath(args.resume):
        cut.write_job(args.cut_dir, {**saved, **mine})
    return str(where), clock


def service_config(args: argparse.Namespace, num_workers: int) -> PSConfig:
    return PSConfig(dim=args.dim, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
                    tables=args.table_specs,
                    min_count=args.min_count, ttl=args.ttl, max_rows=args.max_rows,
                    num_workers=num_workers, consistency=args.consistency, staleness=args.staleness,
                    evict_every=args.evict_every, checkpoint_dir=args.checkpoint_dir,
                    checkpoint_every=args.checkpoint_every, full_every=args.full_every,
                    mode=args.mode, loop=args.loop, node_options=node_options(args),
                    progress_every=args.progress_every, tls=args.tls, cut_every=args.cut_every,
                    cut_root=args.cut_dir, resume_cut=args.resume_cut, start_clock=args.start_clock,
                    worker_rejoin=args.worker_rejoin)


def node_options(args: argparse.Namespace) -> dict[str, Any]:
    """rvz.Node options from the command line."""
    seconds = args.busy_poll / 1e6
    try:
        check_budget(seconds)
    except ValueError as exc:
        raise SystemExit(f"--busy-poll {args.busy_poll:g} (microseconds): {exc}") from None
    return {"busy_poll": seconds} if seconds else {}


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(steps=args.steps, batch=args.batch, bag=args.bag, vocab=args.vocab,
                        seed=args.seed, restart_timeout=args.restart_timeout,
                        progress_every=args.progress_every, cut_every=args.cut_every,
                        cut_root=args.cut_dir, resume_cut=args.resume_cut, start_clock=args.start_clock,
                        crash_job_at=getattr(args, "crash_job_at", None))


def print_shard(r: dict[str, Any]) -> None:
    for name, t in r["tables"].items():
        print(f"ps {r['shard']} epoch {r['epoch']} table {name}: {t['live']} live rows, created "
              f"{t['created']}, evicted {t['evicted']}, global step {t['global_step']}")
    print(f"ps {r['shard']}: served {r['lookups']} pulls ({r['ids_looked_up']} ids), {r['pushes']} "
          f"pushes, {r['aborted_steps']} aborted steps, {len(r['checkpoints'])} checkpoints, "
          f"{r['consistency']} max staleness {r['max_staleness']}"
          + ("" if r.get("busy_poll_spins") is None else f", busy-poll spins {r['busy_poll_spins']}")
          + ("" if r.get("rows_digest") is None else f", rows {r['rows_digest']}"))
    if r["lost_workers"]:
        print(f"ps {r['shard']}: {r['lost_workers']} workers lost; worker clocks {r['worker_clocks']}, "
              f"processes per worker {r['worker_processes']}")


def describe_tables(ps: PSConfig) -> str:
    """``"user (dim 4, adam lr 0.05), item (dim 8, adagrad)"``: what each table really uses."""
    return ", ".join(f"{t.name} (dim {t.dim}, {t.optimizer}{'' if t.lr is None else f' lr {t.lr:g}'})"
                     for t in ps.table_specs())


def demo(args: argparse.Namespace) -> int:
    ps = service_config(args, args.workers)
    work = worker_config(args)
    cluster = local_cluster(args.shards, args.workers, host=args.host)
    print(f"param_server: {args.shards} PS shards, {args.workers} workers, mode={args.mode}, "
          f"consistency={args.consistency}, tables {describe_tables(ps)}, "
          f"rvz {rvz.implementation()}", flush=True)
    with Processes() as procs:
        crash = (args.kill_shard, args.kill_at_step) if args.kill_at_step is not None else None
        start_shards(procs, cluster, ps, crash)
        for worker in range(args.workers):
            procs.start(f"worker{worker}", worker_process, cluster, worker, ps, work)
        if args.kill_after is not None:
            victim = procs.get(f"ps{args.kill_shard}")

            def kill() -> None:
                if victim.is_alive():
                    os.kill(victim.pid, signal.SIGKILL)

            timer = threading.Timer(args.kill_after, kill)
            timer.daemon = True
            timer.start()
        restart = restarter(procs, cluster, ps) if args.restart else None
        results = procs.wait(args.timeout, restart=restart)
        for name in procs.restarts:
            print(f"{name} died and was restarted from its checkpoint")
        if args.kill_shard is not None and f"ps{args.kill_shard}" not in procs.restarts:
            when = (f"after {args.kill_after:g} s" if args.kill_after is not None
                    else f"at step {args.kill_at_step}")
            print(f"note: shard {args.kill_shard} was NOT killed: the run ended before the kill was due "
                  f"({when})")
    for worker in range(args.workers):
        r = results[(WORKER_JOB, worker)]
        print(f"worker {worker}: {r['steps']} steps in {r['seconds']:.2f} s "
              f"({r['steps'] / r['seconds']:.0f} steps/s, {r['ids_per_s'] / 1e3:.0f}k ids/s); "
              f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}; shard restarts seen {r['restarts']}; "
              f"losses {r['loss_digest']}")
    for shard in range(args.shards):
        print_shard(results[(PS_JOB, shard)])
    if args.cut_every:
        cut.prune(args.cut_dir, args.shards, args.workers)
    steps = {results[(PS_JOB, s)]["global_step"] for s in range(args.shards)}
    print(f"global step per shard: {sorted(steps)} "
          f"({'equal on every shard' if len(steps) == 1 else 'differs: a shard was restored'})")
    return 0


def one_task(args: argparse.Namespace) -> int:
    cluster, job, index = args.cluster_spec, args.job, args.task
    num_workers = len(cluster[WORKER_JOB])
    ps = service_config(args, num_workers)
    keep_freed_memory()
    if args.command == "serve":
        summary = rvz.run(run_shard(cluster, index, ps, restore=args.restore), loop=args.loop)
        print_shard(summary)
    elif args.command == "replica":
        print(json.dumps(rvz.run(run_replica(cluster, index, ps, args.every, args.timeout), loop=args.loop)),
              flush=True)
        return 0
    else:
        r = rvz.run(run_worker(cluster, index, ps, worker_config(args)), loop=args.loop)
        print(f"worker {r['worker']}: steps {r['first_step']} to {r['steps']} in {r['seconds']:.2f} s; loss "
              f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}; shard restarts seen {r['restarts']}; "
              f"losses {r['loss_digest']}")
    print(json.dumps({"done": job, "task": index}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(args.log_level)
    if args.command == "bench":
        from .bench import main as bench_main
        return bench_main(args)
    if args.command == "reshard":
        try:
            clock, rows = cut.reshard(args.source, args.target, args.shards)
        except cut.CutError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"resharded the cut at clock {clock} ({rows} rows) into {args.shards} shards in {args.target}; "
              f"resume with --shards {args.shards} --resume {args.target}", flush=True)
        return 0
    if args.command in ("serve", "train", "replica"):
        return one_task(args)
    stop_on_signals()  # the demo's children must not outlive it, whatever ends it
    try:
        return demo(args)
    except Stopped as exc:
        print(f"param_server: stopped by {exc}; every child process was stopped", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RuntimeError, TimeoutError, ValueError, rvz.RvzError) as exc:
        # A child failed, the run overran, or a bad option: say so, briefly.
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
