"""``python -m examples.torch_dlrm``: train a torch DLRM over the parameter server, or check it
against the same model trained in one process.

``train`` reads Criteo files (``--data`` and ``--eval-data``) or generates planted data
(``--samples``), parses them once into the embedding pipeline's column cache, starts PS
shard processes (bsp, one table per categorical field) and trains at staleness k, worker 0
in this process (``--workers N``: the others in processes of their own); it prints the
held-out AUC and logloss and where a step's time went (torch's compute against rvz and the
PS). ``parity`` runs the same data twice, over the PS (one worker, ``sparse_adam``,
staleness 0 unless ``--staleness``) and with ``nn.EmbeddingBag`` + ``torch.optim.SparseAdam``
in this process, and prints the largest relative difference between their per-step losses and
both runs' AUC (exit 1 if beyond ``--tolerance`` or ``--auc-tolerance``).

Everything is float32: the PS stores float32 rows and the optimizer slots next to them, as
the torch model does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import rvz

from ..common import LOCAL_HOST, Stopped, add_log_option, configure_logging, stop_on_signals
from ..embedding_pipeline.__main__ import UsageError, int_list, prepare, steps_of
from ..embedding_pipeline.criteo import Columns
from ..param_server.optimizers import OPTIMIZERS
from .sparse_adam import NAME as SPARSE_ADAM

PROG = "python -m examples.torch_dlrm"


def add_options(p: argparse.ArgumentParser, parity: bool) -> None:
    data = p.add_argument_group("data")
    data.add_argument("--data", help="training file in the Criteo format (plain or gzip)")
    data.add_argument("--eval-data", help="held-out file in the Criteo format (needed with --data)")
    data.add_argument("--samples", type=int, default=200_000, help="planted samples (no --data)")
    data.add_argument("--eval-samples", type=int, default=20_000, help="planted held-out samples")
    data.add_argument("--cache-dir", help="keep the parsed columns here and reuse them (default: a temporary "
                      "directory, removed at the end)")
    data.add_argument("--strict", action="store_true", help="a bad line is an error naming its line number")
    data.add_argument("--keep-missing", action="store_true",
                      help="an empty categorical value is its field's own id (default: an empty bag)")
    model = p.add_argument_group("model")
    model.add_argument("--batch-size", type=int, default=1024)
    model.add_argument("--dim", type=int, default=16, help="embedding width (every table)")
    model.add_argument("--bottom", type=int_list, default=[64], help="bottom MLP hidden layers")
    model.add_argument("--top", type=int_list, default=[64, 32], help="top MLP hidden layers")
    model.add_argument("--interaction", choices=("dot", "cat"), default="dot")
    model.add_argument("--pooling", choices=("sum", "mean"), default="sum", help="the embedding bags' mode")
    if not parity:
        model.add_argument("--optimizer", choices=sorted({*OPTIMIZERS, SPARSE_ADAM}), default=SPARSE_ADAM,
                           help="sparse optimizer on the PS (torch's SparseAdam arithmetic by default)")
    model.add_argument("--lr", type=float, default=0.01, help="sparse (PS) learning rate")
    model.add_argument("--dense-optimizer", choices=("adam", "adagrad", "sgd"), default="adam")
    model.add_argument("--dense-lr", type=float, default=1e-3)
    model.add_argument("--seed", type=int, default=0)
    run = p.add_argument_group("run")
    run.add_argument("--staleness", type=int, default=0, help="rows of step t: those after the update of "
                     "step t - k - 1 (the reference in one process emulates the same)" if parity else
                     "rows of step t: those after the update of step t - k - 1")
    if parity:
        run.add_argument("--steps", type=int, default=200)
        run.add_argument("--tolerance", type=float, default=1e-5, help="largest relative loss difference")
        run.add_argument("--auc-tolerance", type=float, default=1e-3)
    else:
        run.add_argument("--max-steps", type=int, help="stop after this many steps (default: one pass)")
        run.add_argument("--workers", type=int, default=1, help="worker processes, each with an equal share "
                         "of every batch (worker 0 is this process; dense gradients summed by a ring "
                         "all-reduce)")
    infra = p.add_argument_group("processes")
    infra.add_argument("--shards", type=int, default=2, help="PS shard processes")
    infra.add_argument("--mode", choices=("recv", "send"), default="send", help="rvz mode of every node")
    infra.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    infra.add_argument("--timeout", type=float, default=60.0, help="bound on every wait, seconds")
    infra.add_argument("--host", default=LOCAL_HOST, help="the address the processes listen on")
    infra.add_argument("--switch-interval", type=float, default=0.0005,
                       help="the GIL switch interval, seconds (torch and the rvz loop share this process)")
    out = p.add_argument_group("output")
    out.add_argument("--json", help="write the report here")
    out.add_argument("--progress-every", type=float, default=10.0, metavar="S",
                     help="seconds between progress lines (0: none)")
    add_log_option(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    add_options(sub.add_parser("train", help="train over the PS and evaluate"), parity=False)
    add_options(sub.add_parser("parity", help="the PS run against nn.EmbeddingBag + SparseAdam"), parity=True)
    args = p.parse_args(argv)
    if args.command == "parity":
        args.optimizer, args.max_steps, args.workers = SPARSE_ADAM, args.steps, 1
    try:
        check_args(args)
    except ValueError as exc:
        sub.choices[args.command].error(str(exc))  # exit 2, before anything runs
    return args


def check_args(args: argparse.Namespace) -> None:
    if args.data and not args.eval_data:
        raise ValueError("--data needs --eval-data (the held-out file)")
    for name in ("data", "eval_data"):
        path = getattr(args, name)
        if path and not os.path.isfile(path):
            raise ValueError(f"--{name.replace('_', '-')} {path}: no such file")
    for name in ("samples", "eval_samples", "batch_size", "dim", "shards", "workers"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if any(h < 1 for h in args.bottom + args.top):
        raise ValueError("--bottom and --top take positive layer widths")
    if args.batch_size % args.workers:
        raise ValueError(f"--batch-size {args.batch_size} does not split into {args.workers} equal shares")
    if args.staleness < 0:
        raise ValueError("--staleness must be at least 0")
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError("--max-steps (--steps) must be at least 1")
    for name in ("lr", "dense_lr", "timeout", "switch_interval"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")


def run_config(args: argparse.Namespace, steps: int) -> Any:
    from .train import RunConfig

    return RunConfig(batch_size=args.batch_size, steps=steps, dim=args.dim, bottom=tuple(args.bottom),
                     top=tuple(args.top), interaction=args.interaction, pooling=args.pooling, lr=args.lr,
                     dense_lr=args.dense_lr, dense_optimizer=args.dense_optimizer,
                     sparse_optimizer=args.optimizer, seed=args.seed, keep_missing=args.keep_missing,
                     staleness=args.staleness, workers=args.workers, shards=args.shards, mode=args.mode,
                     loop=args.loop,
                     timeout=args.timeout, host=args.host, progress_every=args.progress_every)


def describe(cfg: Any, n: int) -> str:
    return (f"torch_dlrm: {n} training samples, {cfg.steps} steps of {cfg.batch_size}, 26 tables of dim "
            f"{cfg.dim} ({cfg.pooling} bags), bottom {'-'.join(map(str, (13, *cfg.bottom, cfg.dim)))}, "
            f"{cfg.interaction} interaction, top {'-'.join(map(str, cfg.top))}-1; {cfg.workers} worker(s), "
            f"{cfg.shards} PS shard "
            f"processes (bsp, {cfg.sparse_optimizer} lr {cfg.lr:g}), staleness {cfg.staleness}, "
            f"mode={cfg.mode}, "
            f"rvz {rvz.implementation()}, load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


def result_line(name: str, r: Any) -> str:
    return (f"{name}: {r.steps} steps in {r.seconds:.1f} s ({r.steps / r.seconds if r.seconds else 0:.1f} "
            f"steps/s); held-out AUC {r.auc:.4f}, logloss {r.logloss:.4f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    sys.setswitchinterval(args.switch_interval)
    try:
        import torch
    except ImportError:
        print(f"{PROG}: needs torch (the 'torch' extra of rvz: pip install 'rvz[torch]')", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # one core each for torch, the rvz loop and the shards
    stop_on_signals()  # no child, and no temporary cache, outlives this process
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="rvz-torch-dlrm-"))
    cache.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, cache)
    except UsageError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Stopped as exc:
        print(f"torch_dlrm: stopped by {exc}; every child process was stopped", file=sys.stderr)
        return exc.exit_code
    finally:
        if not args.cache_dir:
            shutil.rmtree(cache, ignore_errors=True)


def run(args: argparse.Namespace, cache: Path) -> int:
    from .train import max_relative_difference, run_local, run_ps

    train_dir, eval_dir, oracle = prepare(args, cache)
    n, steps = steps_of(args, train_dir)
    train, held_out = Columns.open(train_dir), Columns.open(eval_dir)
    cfg = run_config(args, steps)
    print(describe(cfg, n), flush=True)
    ps = run_ps(train, held_out, cfg, train_dir=train_dir)
    print(result_line("over the PS", ps), flush=True)
    doc: dict[str, Any] = {"config": dataclasses.asdict(cfg), "ps": ps.to_dict(), "oracle": oracle}
    ok = True
    if args.command == "train":
        print("overhead: " + ps.overhead(), flush=True)
    else:
        local = run_local(train, held_out, cfg)
        print(result_line("in one process (nn.EmbeddingBag + SparseAdam)", local), flush=True)
        rel = max_relative_difference(ps.losses, local.losses)
        same = sum(a == b for a, b in zip(ps.losses, local.losses, strict=True))
        assert ps.auc is not None and local.auc is not None
        dauc = abs(ps.auc - local.auc)
        ok = rel <= args.tolerance and dauc <= args.auc_tolerance
        print(f"parity over {steps} steps: max relative loss difference {rel:.3g} (tolerance "
              f"{args.tolerance:g}), {same} of {steps} losses bit-identical; AUC {ps.auc:.6f} over the PS, "
              f"{local.auc:.6f} in one process (difference {dauc:.3g}, tolerance {args.auc_tolerance:g}): "
              f"{'OK' if ok else 'FAILED'}",
              flush=True)
        doc.update(local=local.to_dict(), max_relative_difference=rel, identical_steps=same, ok=ok)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
