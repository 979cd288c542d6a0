"""``python -m examples.embedding_pipeline``: EG/MG training, prefetch 0 vs 2, in one run.

For each prefetch depth, starts fresh PS shard processes (so every run starts from the same
state), trains the synthetic task in this process (EG on the event loop, MG's dense compute
in a thread) and reports throughput, loss, and how much of the time MG waited for
embeddings. The last line compares the throughputs as a ratio measured in this run: the
gain of overlapping lookups with dense compute.
"""

from __future__ import annotations

import argparse
import os
import sys

# One BLAS thread per process, set before numpy loads. On a small machine OpenBLAS's own
# threads spin while they wait and steal the cores that EG, MG and the PS shards need (the
# dense step measured ~10x slower with them). Child processes inherit the setting.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import rvz  # noqa: E402

from ..param_server.client import PSClient  # noqa: E402
from ..param_server.launch import Processes, PSConfig, local_cluster, start_shards  # noqa: E402
from ..param_server.protocol import WORKER_JOB  # noqa: E402
from .data import Batch, TaskSpec, synthetic_batches  # noqa: E402
from .model import DenseModel  # noqa: E402
from .trainer import RunResult, train  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.embedding_pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefetch", type=int, nargs="+", default=[0, 2], help="prefetch depths to compare")
    p.add_argument("--batches", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--fields", type=int, default=4)
    p.add_argument("--bag", type=int, default=2, help="ids per field (mean-pooled)")
    p.add_argument("--vocab", type=int, default=5000, help="distinct ids per field")
    p.add_argument("--dim", type=int, default=16, help="embedding width")
    p.add_argument("--hidden", type=int, default=1024, help="MLP hidden units")
    p.add_argument("--shards", type=int, default=2, help="PS shard processes")
    p.add_argument("--optimizer", choices=("adagrad", "adam"), default="adagrad")
    p.add_argument("--lr", type=float, default=0.1, help="sparse (PS) learning rate")
    p.add_argument("--dense-lr", type=float, default=3e-3)
    p.add_argument("--mode", choices=("recv", "send"), default="send",
                   help="rvz mode of every node: Recv-Driven or Send-Driven")
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="bound on each run, seconds")
    return p.parse_args(argv)


async def run_trainer(cluster: dict[str, list[str]], args: argparse.Namespace, prefetch: int,
                      batches: list[Batch]) -> RunResult:
    model = DenseModel(args.fields * args.dim, args.hidden, lr=args.dense_lr, seed=args.seed)
    async with rvz.Node(cluster, WORKER_JOB, 0, mode=args.mode) as node:
        ps = PSClient(node, len(cluster["ps"]), args.dim)
        try:
            return await train(ps, batches, model, prefetch=prefetch)
        finally:
            await ps.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ps_cfg = PSConfig(dim=args.dim, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
                      num_workers=1, mode=args.mode, loop=args.loop)
    print(f"embedding_pipeline: {args.batches} batches of {args.batch_size} x {args.fields} fields x "
          f"{args.bag} ids, dim {args.dim}, MLP {args.fields * args.dim}-{args.hidden}-1, "
          f"{args.shards} PS shard processes, mode={args.mode}, rvz {rvz.implementation()}", flush=True)
    # Generated up front so that both runs read the same batches and neither run's time
    # includes making them.
    spec = TaskSpec(batch_size=args.batch_size, fields=args.fields, bag=args.bag, vocab=args.vocab,
                    seed=args.seed)
    batches = list(synthetic_batches(spec, args.batches))
    results: dict[int, RunResult] = {}
    for prefetch in args.prefetch:
        cluster = local_cluster(args.shards, 1)
        with Processes() as procs:
            start_shards(procs, cluster, ps_cfg)
            result = rvz.run(run_trainer(cluster, args, prefetch, batches), loop=args.loop)
            shards = procs.wait(args.timeout)
        first, last = result.loss_drop()
        live = sum(s["live"] for s in shards.values())
        print(f"prefetch {prefetch}: {result.batches} batches in {result.seconds:.2f} s = "
              f"{result.batches_per_s:.1f} batches/s; loss {first:.4f} -> {last:.4f}; "
              f"MG waited {100 * result.mg_waiting / result.seconds:.0f}% of the time for embeddings; "
              f"max lookahead {result.max_lookahead}; {live} rows on the PS; "
              f"exchange freed {result.exchange.freed if result.exchange else 0} batches", flush=True)
        results[prefetch] = result
    if len(results) > 1:
        base = min(results)
        for prefetch, result in sorted(results.items()):
            if prefetch != base:
                ratio = result.batches_per_s / results[base].batches_per_s
                print(f"throughput prefetch {prefetch} / prefetch {base}: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RuntimeError, TimeoutError) as exc:  # a child failed or the run overran: say so, briefly
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
