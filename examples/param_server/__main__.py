"""``python -m examples.param_server``: PS shards and workers as separate processes.

Starts ``--shards`` PS shard processes and ``--workers`` worker processes on loopback, lets
every worker train the synthetic workload for ``--steps`` synchronous steps, and prints what
each process reports: worker throughput and loss, and each shard's table (live rows,
capacity, rows created and evicted), its replicated hot state and its incremental exports.
"""

from __future__ import annotations

import argparse
import sys

import rvz

from .launch import Processes, PSConfig, local_cluster, start_shards
from .protocol import PS_JOB, WORKER_JOB
from .workload import WorkerConfig, worker_process


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.param_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=2, help="PS shard processes")
    p.add_argument("--workers", type=int, default=2, help="worker processes")
    p.add_argument("--steps", type=int, default=200, help="training steps per worker")
    p.add_argument("--batch", type=int, default=256, help="samples per step")
    p.add_argument("--bag", type=int, default=4, help="ids per sample")
    p.add_argument("--vocab", type=int, default=20000, help="distinct ids of the Zipf law")
    p.add_argument("--dim", type=int, default=16, help="embedding width")
    p.add_argument("--optimizer", choices=("adagrad", "adam"), default="adagrad")
    p.add_argument("--lr", type=float, default=None, help="learning rate (optimizer default)")
    p.add_argument("--mode", choices=("recv", "send"), default="recv",
                   help="rvz mode of every node: Recv-Driven or Send-Driven")
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    p.add_argument("--evict-every", type=int, default=50, help="pushes between eviction rounds (0: off)")
    p.add_argument("--min-count", type=int, default=2, help="lookups a row needs to survive a round")
    p.add_argument("--export-every", type=int, default=100, help="pushes between exports (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="bound on the whole run, seconds")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ps = PSConfig(dim=args.dim, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
                  num_workers=args.workers, evict_every=args.evict_every, min_count=args.min_count,
                  export_every=args.export_every, mode=args.mode, loop=args.loop)
    work = WorkerConfig(steps=args.steps, batch=args.batch, bag=args.bag, vocab=args.vocab,
                        seed=args.seed)
    cluster = local_cluster(args.shards, args.workers)
    print(f"param_server: {args.shards} PS shards, {args.workers} workers, mode={args.mode}, "
          f"optimizer={args.optimizer}, dim={args.dim}, rvz {rvz.implementation()}", flush=True)
    with Processes() as procs:
        start_shards(procs, cluster, ps)
        for worker in range(args.workers):
            procs.start(f"worker{worker}", worker_process, cluster, worker, ps, work)
        results = procs.wait(args.timeout)
    for worker in range(args.workers):
        r = results[(WORKER_JOB, worker)]
        print(f"worker {worker}: {r['steps']} steps in {r['seconds']:.2f} s "
              f"({r['steps'] / r['seconds']:.0f} steps/s, {r['ids_per_s'] / 1e3:.0f}k ids/s); "
              f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}")
    for shard in range(args.shards):
        r = results[(PS_JOB, shard)]
        hot = f"global step {r['step']}"
        if "beta1_power" in r:
            hot += f", beta1^t {r['beta1_power']:.4g}, beta2^t {r['beta2_power']:.4g}"
        print(f"ps {shard}: {r['live']} live rows (capacity {r['capacity']}), created {r['created']}, "
              f"evicted {r['evicted']}; {hot}; served {r['lookups']} lookups "
              f"({r['ids_looked_up']} ids), {r['pushes']} pushes")
        for since, version, rows, deleted in r["exports"]:
            print(f"  export v{since}..v{version}: {rows} changed rows, {deleted} deleted ids")
    steps = {results[(PS_JOB, s)]["step"] for s in range(args.shards)}
    print(f"replicated global step: {sorted(steps)} "
          f"({'equal on every shard' if len(steps) == 1 else 'MISMATCH'})")
    return 0 if len(steps) == 1 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RuntimeError, TimeoutError) as exc:  # a child failed or the run overran: say so, briefly
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
