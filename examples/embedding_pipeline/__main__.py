"""``python -m examples.embedding_pipeline``: generate Criteo-format data, train, compare.

``generate`` writes planted synthetic data in the Criteo format and prints the oracle's
held-out AUC (the best any model can reach on it). ``train`` reads Criteo files (``--data``
and ``--eval-data``; plain or gzip) or generates planted data itself (``--samples``), parses
them once into a column cache, then runs each requested configuration on fresh PS shard
processes and N worker processes: ``--compare-staleness 0,1,2`` and ``--compare-workers
1,2`` run the same data at each setting and print them side by side, with throughput ratios
measured in this run. ``--reference`` also runs the sequential reference in this process
and checks that staleness 0 with one worker reproduces its losses bit for bit.

On several hosts, ``train --cluster JSON --job ps|worker --task N`` (or the cluster and the
task from ``TF_CONFIG``) runs one process of one run: a PS shard, or a worker (which
prepares its own copy of the data). Every process gets the same options.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np  # the thread settings are applied by the package (examples/__init__.py)

import rvz

from ..common import (
    LOCAL_HOST,
    Stopped,
    add_log_option,
    add_tls_options,
    configure_logging,
    stop_on_signals,
    tls_files,
)
from ..param_server import cut
from ..param_server.launch import PSConfig, resolve_task, run_shard
from ..param_server.protocol import PS_JOB, WORKER_JOB
from .criteo import Columns, LoadStats, encode
from .launch import JobFailed, JobSpec, ps_config, run_job, train_worker, worker_threads
from .synthetic import Planted
from .trainer import TrainConfig


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.embedding_pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="write planted synthetic data in the Criteo format")
    g.add_argument("--samples", type=int, default=100_000)
    g.add_argument("--eval-samples", type=int, default=20_000)
    g.add_argument("--out", required=True, help="directory for train.tsv.gz and eval.tsv.gz")
    g.add_argument("--plain", action="store_true", help="write .tsv instead of .tsv.gz")
    g.add_argument("--seed", type=int, default=0)
    add_log_option(g)

    t = sub.add_parser("train", help="train and evaluate (see the description)")
    data = t.add_argument_group("data")
    data.add_argument("--data", help="training file in the Criteo format (plain or gzip)")
    data.add_argument("--eval-data", help="held-out file in the Criteo format (needed with --data)")
    data.add_argument("--samples", type=int, default=200_000, help="planted samples (no --data)")
    data.add_argument("--eval-samples", type=int, default=20_000, help="planted held-out samples")
    data.add_argument("--cache-dir", help="keep the parsed columns here and reuse them (default: "
                      "a temporary directory, removed at the end)")
    data.add_argument("--strict", action="store_true",
                      help="a bad line is an error naming its line number (default: skip and count)")
    run = t.add_argument_group("runs")
    run.add_argument("--staleness", type=int, default=0)
    run.add_argument("--compare-staleness", type=int_list, help="e.g. 0,1,2: one run per staleness")
    run.add_argument("--workers", type=int, default=1)
    run.add_argument("--compare-workers", type=int_list, help="e.g. 1,2: one run per worker count")
    run.add_argument("--max-steps", type=int, help="stop after this many steps (default: one pass)")
    run.add_argument("--repeat", type=int, default=1, help="runs per setting (to show they reproduce)")
    run.add_argument("--reference", action="store_true",
                     help="also run the sequential reference and compare with staleness 0, 1 worker")
    model = t.add_argument_group("model")
    model.add_argument("--batch-size", type=int, default=1024, help="global batch (split over workers)")
    model.add_argument("--dim", type=int, default=16, help="embedding width")
    model.add_argument("--hidden", type=int_list, default=[256, 128], help="MLP hidden layers")
    model.add_argument("--optimizer", choices=("sgd", "adagrad", "adam", "ftrl"), default="adam",
                       help="sparse optimizer on the PS (lazy Adam by default)")
    model.add_argument("--lr", type=float, default=0.01, help="sparse (PS) learning rate")
    model.add_argument("--dense-lr", type=float, default=1e-3)
    model.add_argument("--seed", type=int, default=0)
    infra = t.add_argument_group("processes")
    infra.add_argument("--shards", type=int, default=2, help="PS shard processes")
    infra.add_argument("--mode", choices=("recv", "send"), default="send", help="rvz mode of every node")
    infra.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    infra.add_argument("--timeout", type=float, default=60.0, help="bound on every wait, seconds")
    infra.add_argument("--run-timeout", type=float, default=3600.0, help="bound on each run, seconds")
    infra.add_argument("--switch-interval", type=float, default=0.0005,
                       help="the GIL switch interval of the worker processes, seconds")
    infra.add_argument("--host", default=LOCAL_HOST, help="the address the run's processes listen on "
                       "(one machine)")
    infra.add_argument("--cluster", default=None, help="several hosts: the cluster JSON (or a file "
                       "holding it), else TF_CONFIG's; this process runs --job/--task of it")
    infra.add_argument("--job", choices=(PS_JOB, WORKER_JOB), default=None)
    infra.add_argument("--task", type=int, default=None)
    add_tls_options(infra)
    ckpt = t.add_argument_group("whole-job checkpoints")
    ckpt.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                      help="every N steps, a consistent cut of every shard and worker (0: none)")
    ckpt.add_argument("--checkpoint-dir", default=None, help="where the cuts go (default: --resume's)")
    ckpt.add_argument("--resume", default=None, metavar="DIR",
                      help="restart the whole job, with fresh processes, from DIR's newest complete cut")
    ckpt.add_argument("--crash-job-at", type=int, default=None, metavar="STEP",
                      help="a demo: worker 0 SIGKILLs every process of the job (its process group) at "
                      "STEP, once the last cut before it is complete")
    infra.add_argument("--kill-worker", help="W:STEP: worker W kills itself (SIGKILL) at STEP (a demo "
                       "of the failure report, or with --worker-rejoin of the rejoin)")
    infra.add_argument("--consistency", choices=("bsp",), default="bsp",
                       help="the PS consistency: bsp, which the pipeline's exact staleness needs")
    infra.add_argument("--worker-rejoin", type=float, default=0.0, metavar="S",
                       help="a killed worker is started again as its task and replays the step it "
                       "died in, bit for bit; the others wait for it up to S seconds (0: a killed "
                       "worker fails the run)")
    infra.add_argument("--journal-dir", default=None, metavar="DIR",
                       help="with --worker-rejoin: where each worker writes its state every step "
                       "(default: a temporary directory; needed with --cluster)")
    out = t.add_argument_group("output")
    out.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N steps")
    out.add_argument("--json", help="write the report here")
    out.add_argument("--plot", help="draw loss and AUC against step here (needs matplotlib)")
    out.add_argument("--progress-every", type=float, default=10.0, metavar="S",
                     help="seconds between progress lines of each worker (0: none)")
    add_log_option(out)
    args = p.parse_args(argv)
    try:
        check_args(args)
    except ValueError as exc:
        sub.choices[args.command].error(str(exc))  # exit 2, before anything runs
    if args.command == "train":
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                p.error("--plot needs matplotlib, which is not installed (the 'plot' extra of rvz)")
        if args.data and not args.eval_data:
            p.error("--data needs --eval-data (the held-out file)")
    return args


class UsageError(ValueError):
    """An option that does not fit the data (known once it is loaded): exit 2, as argparse."""


def check_args(args: argparse.Namespace) -> None:
    """Refuse what would crash a child, hang, be silently ignored or train nothing."""
    def at_least(name: str, low: float, value: Any = None) -> None:
        if value is None:
            value = getattr(args, name.lstrip("-").replace("-", "_"))
        if isinstance(value, list):
            for v in value:
                at_least(name, low, v)
        elif not value >= low:
            raise ValueError(f"{name} must be at least {low:g}, not {value}")

    if args.command == "generate":
        at_least("--samples", 1)
        at_least("--eval-samples", 1)
        return
    args.tls = tls_files(args)
    args.cluster_spec = None
    if args.cluster or args.job is not None or os.environ.get("TF_CONFIG"):
        args.cluster_spec, args.job, args.task = resolve_task(
            args.cluster, args.job, args.task, (PS_JOB, WORKER_JOB), "train")
        for name in ("compare_staleness", "compare_workers", "reference", "kill_worker", "plot"):
            if getattr(args, name):
                raise ValueError(f"--{name.replace('_', '-')} runs several processes itself: not with "
                                 f"--cluster (one process of one run)")
        if args.repeat != 1:
            raise ValueError("--repeat runs several processes itself: not with --cluster")
        args.workers = len(args.cluster_spec[WORKER_JOB])
        args.shards = len(args.cluster_spec[PS_JOB])
    if args.data:
        for name, path in (("--data", args.data), ("--eval-data", args.eval_data)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{name} {path}: no such file")
    else:
        at_least("--samples", 1)
        at_least("--eval-samples", 1)
    for name in ("--workers", "--shards", "--dim", "--batch-size", "--repeat", "--hidden"):
        at_least(name, 1)
    for name in ("--staleness", "--eval-every", "--progress-every"):
        at_least(name, 0)
    if args.max_steps is not None:
        at_least("--max-steps", 1)
    for name in ("--lr", "--dense-lr", "--timeout", "--run-timeout", "--switch-interval"):
        value = getattr(args, name[2:].replace("-", "_"))
        if not value > 0:
            raise ValueError(f"{name} must be positive, not {value}")
    if args.compare_staleness is not None:
        if not args.compare_staleness:
            raise ValueError("--compare-staleness needs at least one staleness")
        at_least("--compare-staleness", 0)
    if args.compare_workers is not None:
        if not args.compare_workers:
            raise ValueError("--compare-workers needs at least one worker count")
        at_least("--compare-workers", 1)
    worker_counts = args.compare_workers or [args.workers]
    for n in worker_counts:
        if args.batch_size % n:
            raise ValueError(f"--batch-size {args.batch_size} does not split into {n} equal shares "
                             f"(one per worker)")
    at_least("--checkpoint-every", 0)
    if args.resume and not args.checkpoint_dir and args.checkpoint_every:
        args.checkpoint_dir = args.resume  # go on writing cuts where they were
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir (where to write the cuts)")
    if args.resume or args.checkpoint_every:
        for name in ("compare_staleness", "compare_workers", "reference"):
            if getattr(args, name):
                raise ValueError(f"--{name.replace('_', '-')} runs several jobs: not with --resume or "
                                 f"--checkpoint-every (one job)")
        if args.repeat != 1:
            raise ValueError("--repeat runs several jobs: not with --resume or --checkpoint-every")
    if args.resume and not os.path.isdir(args.resume):
        raise ValueError(f"--resume {args.resume}: no such directory")
    if args.crash_job_at is not None:
        at_least("--crash-job-at", 1)
    at_least("--worker-rejoin", 0)
    if args.journal_dir and not args.worker_rejoin:
        raise ValueError("--journal-dir is for --worker-rejoin")
    if args.worker_rejoin and args.cluster_spec is not None and not args.journal_dir:
        raise ValueError("--worker-rejoin with --cluster needs --journal-dir (on the worker's host, "
                         "where its restarted process finds it)")
    if args.kill_worker:
        try:
            w, step = (int(x) for x in args.kill_worker.split(":"))
        except ValueError:
            raise ValueError("--kill-worker takes W:STEP") from None
        if not 0 <= w < min(worker_counts):
            raise ValueError(f"--kill-worker {args.kill_worker}: "
                             + (f"worker {w} does not exist" if w < 0 or w >= max(worker_counts) else
                                f"worker {w} does not exist in the runs with {min(worker_counts)} worker(s)")
                             + f" (--workers/--compare-workers {','.join(map(str, worker_counts))})")
        if step < 0 or args.max_steps is not None and step >= args.max_steps:
            raise ValueError(f"--kill-worker {args.kill_worker}: step {step} is not within the run "
                             f"(steps 0 to {(args.max_steps or 0) - 1})")
        args.kill_worker = (w, step)


# -- data -------------------------------------------------------------------------------------------

def generate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = ".tsv" if args.plain else ".tsv.gz"
    planted = Planted(args.seed)
    started = time.perf_counter()
    planted.write(out / f"train{suffix}", args.samples, sample_seed=1)
    oracle = planted.write(out / f"eval{suffix}", args.eval_samples, sample_seed=2)
    (out / "oracle.json").write_text(json.dumps(oracle.__dict__, indent=1))
    print(f"wrote {args.samples} + {args.eval_samples} samples to {out} in "
          f"{time.perf_counter() - started:.1f} s; held-out CTR "
          f"{oracle.positives / max(1, oracle.samples):.3f}, "
          f"oracle AUC {oracle.auc:.4f}, oracle logloss {oracle.logloss:.4f}")
    return 0


def describe_load(name: str, stats: LoadStats) -> str:
    text = f"{name}: {stats.samples} samples from {stats.lines} lines"
    if stats.bad:
        shown = "; ".join(f"line {n}: {why}" for n, why in stats.bad_examples[:3])
        text += f", {stats.bad} bad lines skipped ({shown})"
    return text


def prepare(args: argparse.Namespace, cache: Path) -> tuple[str, str, dict[str, Any] | None]:
    """Parse (or generate and parse) the data into the column cache; returns its two
    directories and the oracle's figures (planted data only)."""
    train_dir, eval_dir = cache / "train", cache / "eval"
    params = {"data": args.data, "eval_data": args.eval_data, "samples": args.samples,
              "eval_samples": args.eval_samples, "seed": args.seed}
    stamp = cache / "params.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("params") == params:
        saved = json.loads(stamp.read_text())
        print(f"data: reusing the parsed columns in {cache}", flush=True)
        return str(train_dir), str(eval_dir), saved.get("oracle")
    started = time.perf_counter()
    oracle = None
    if args.data:
        train_src, eval_src = args.data, args.eval_data
    else:
        planted = Planted(args.seed)
        train_src, eval_src = str(cache / "train.tsv.gz"), str(cache / "eval.tsv.gz")
        planted.write(train_src, args.samples, sample_seed=1)
        oracle = planted.write(eval_src, args.eval_samples, sample_seed=2).__dict__
        print(f"data: wrote {args.samples} + {args.eval_samples} planted samples in the Criteo format "
              f"(gzip); oracle held-out AUC {oracle['auc']:.4f}, logloss {oracle['logloss']:.4f}", flush=True)
    for name, src, dst in (("train", train_src, train_dir), ("eval", eval_src, eval_dir)):
        stats = encode(src, dst, strict=args.strict)
        print("data: " + describe_load(name, stats), flush=True)
    stamp.write_text(json.dumps({"params": params, "oracle": oracle}))
    print(f"data: ready in {time.perf_counter() - started:.1f} s", flush=True)
    return str(train_dir), str(eval_dir), oracle


# -- runs -------------------------------------------------------------------------------------------

def settings(args: argparse.Namespace) -> list[tuple[int, int]]:
    workers = args.compare_workers or [args.workers]
    ks = args.compare_staleness or [args.staleness]
    return [(w, k) for w in workers for k in ks]


def summary_line(r: dict[str, Any]) -> str:
    def share(name: str) -> float:
        return 100 * r[name] / r["seconds"] if r["seconds"] else 0.0

    return (f"workers {r['workers']} staleness {r['staleness']}: {r['steps']} steps in "
            f"{r['seconds']:.1f} s = "
            f"{r['steps_per_s']:.2f} steps/s ({r['samples_per_s']:.0f} samples/s); AUC {r['auc']:.4f}, "
            f"logloss {r['logloss']:.4f}; of the time MG computed {share('mg_compute'):.0f}%, waited for "
            f"embeddings {share('mg_waiting'):.0f}%, EG was in PS calls {share('eg_ps'):.0f}%; "
            f"processes used {r['cpu_seconds']:.0f} CPU-s; losses {r['loss_digest']}")


def table(runs: list[dict[str, Any]], oracle: dict[str, Any] | None) -> str:
    """Side by side. Each worker count's baseline is its first staleness (the mean of its
    runs, when a setting ran more than once): ``x base`` is the steps/s ratio to it."""
    first_k: dict[int, int] = {}
    for r in runs:
        first_k.setdefault(r["workers"], r["staleness"])
    base = {w: [r for r in runs if (r["workers"], r["staleness"]) == (w, k)] for w, k in first_k.items()}
    speed = {w: float(np.mean([r["steps_per_s"] for r in rs])) for w, rs in base.items()}
    first = runs[0]
    lines = ["workers  staleness  steps/s  x base  AUC     dAUC vs base  dAUC vs first run  logloss  losses"]
    for r in runs:
        b = base[r["workers"]][0]
        lines.append(f"{r['workers']:>7}  {r['staleness']:>9}  {r['steps_per_s']:>7.2f}  "
                     f"{r['steps_per_s'] / speed[r['workers']]:>6.2f}  {r['auc']:.4f}  "
                     f"{r['auc'] - b['auc']:>+12.4f}  "
                     f"{r['auc'] - first['auc']:>+17.4f}  {r['logloss']:.4f}   {r['loss_digest']}")
    if oracle:
        lines.append(f"oracle (planted model) held-out AUC {oracle['auc']:.4f}, "
                     f"logloss {oracle['logloss']:.4f}")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        label = f"{r['workers']} worker(s), staleness {r['staleness']}"
        ax_loss.plot(range(len(r["losses"])), r["losses"], label=label, linewidth=0.8)
        ax_auc.plot([h["step"] for h in r["history"]], [h["auc"] for h in r["history"]], marker="o",
                    label=label)
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss")
    ax_auc.set(xlabel="step", ylabel="held-out AUC", title="AUC")
    ax_loss.legend()
    ax_auc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def ps_settings(args: argparse.Namespace) -> PSConfig:
    """The PS settings of the run; resuming, the cut to start from (its settings checked)."""
    where, clock = resume_point(args)
    return PSConfig(dim=args.dim, optimizer=args.optimizer, lr=args.lr, seed=args.seed, mode=args.mode,
                    loop=args.loop, tls=args.tls, cut_every=args.checkpoint_every,
                    cut_root=args.checkpoint_dir, resume_cut=where, start_clock=clock)


def train_settings(args: argparse.Namespace, workers: int, k: int) -> TrainConfig:
    return TrainConfig(staleness=k, num_workers=workers, global_batch=args.batch_size,
                       hidden=tuple(args.hidden), dense_lr=args.dense_lr, seed=args.seed,
                       eval_every=args.eval_every, timeout=args.timeout, max_steps=args.max_steps,
                       progress_every=args.progress_every, checkpoint_every=args.checkpoint_every,
                       checkpoint_dir=args.checkpoint_dir, worker_rejoin=args.worker_rejoin,
                       journal=args.journal_dir)


# What must be the same for a job to resume from another's cut (--max-steps may grow).
JOB_SETTINGS = ("workers", "shards", "staleness", "batch_size", "dim", "hidden", "optimizer", "lr",
                "dense_lr", "seed", "data", "eval_data", "samples", "eval_samples", "eval_every")


def job_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in JOB_SETTINGS}


def resume_point(args: argparse.Namespace) -> tuple[str | None, int]:
    """(cut directory, its clock) to resume from, or (None, 0); UsageError when the job's
    settings differ from the checkpoint's, CutError when no cut is complete."""
    if not args.resume:
        if args.checkpoint_every:
            cut.write_job(args.checkpoint_dir, job_settings(args))
        return None, 0
    saved = cut.read_job(args.resume)
    mine = job_settings(args)
    for name in JOB_SETTINGS:
        if saved.get(name) != mine[name]:
            option = "--" + name.replace("_", "-")
            also = (f", or reshard the checkpoint first: python -m examples.param_server reshard --from "
                    f"{args.resume} --shards {mine[name]} --to NEW_DIR, then --resume NEW_DIR"
                    if name == "shards" else "")
            raise UsageError(f"--resume {args.resume}: its job ran with {option} {saved.get(name)}, this "
                             f"one with {mine[name]}; give {option} {saved.get(name)} to resume it{also}")
    clock, where = cut.latest(args.resume, args.shards, args.workers)
    if args.checkpoint_every and os.path.abspath(args.checkpoint_dir) != os.path.abspath(args.resume):
        cut.write_job(args.checkpoint_dir, mine)
    logging.getLogger(__name__).info("resuming the job from %s (step %d)", where, clock)
    return str(where), clock


def steps_of(args: argparse.Namespace, train_dir: str) -> tuple[int, int]:
    """(training samples, steps of the run); UsageError when not one step fits."""
    n = len(Columns.open(train_dir))
    steps = n // args.batch_size if args.max_steps is None else min(args.max_steps, n // args.batch_size)
    if steps == 0:
        raise UsageError(f"--batch-size {args.batch_size} is more than the {n} training samples: "
                         f"not one step to train")
    return n, steps


def one_task(args: argparse.Namespace) -> int:
    """One process of a run on several hosts: a PS shard, or a worker."""
    cluster, job, task = args.cluster_spec, args.job, args.task
    ps = ps_settings(args)
    if job == PS_JOB:
        summary = rvz.run(run_shard(cluster, task, ps_config(ps, args.workers, args.worker_rejoin)),
                          loop=args.loop)
        print(json.dumps({"done": job, "task": task, "live": summary["live"],
                          "global_step": summary["global_step"]}), flush=True)
        return 0
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="rvz-pipeline-"))
    cache.mkdir(parents=True, exist_ok=True)
    try:
        train_dir, eval_dir, _ = prepare(args, cache)
        steps_of(args, train_dir)
        spec = JobSpec(train_dir, eval_dir, train_settings(args, args.workers, args.staleness), ps,
                       shards=args.shards, timeout=args.run_timeout, switch_interval=args.switch_interval)
        worker_threads(spec)
        result = rvz.run(train_worker(cluster, task, spec), loop=args.loop)
        print(f"worker {task} of {args.workers}: {result['steps']} steps, {result['steps_per_s']:.2f} "
              f"steps/s" + ("" if result["auc"] is None else
                            f", AUC {result['auc']:.4f}, logloss {result['logloss']:.4f}")
              + f"; losses {result['loss_digest']}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({k: result[k] for k in REPORT if k in result}, indent=1))
        return 0
    finally:
        if not args.cache_dir:
            shutil.rmtree(cache, ignore_errors=True)


# What --json keeps of a run.
REPORT = ("auc", "logloss", "steps_per_s", "samples_per_s", "staleness", "workers", "history",
          "steps", "samples", "seconds", "eval_seconds", "mg_waiting", "mg_compute", "eg_ps", "pulled_ids",
          "cpu_seconds", "loss_digest", "losses")


def train(args: argparse.Namespace) -> int:
    if args.cluster_spec is not None:
        return one_task(args)
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="rvz-pipeline-"))
    cache.mkdir(parents=True, exist_ok=True)
    try:
        train_dir, eval_dir, oracle = prepare(args, cache)
        ps = ps_settings(args)
        n, steps = steps_of(args, train_dir)
        if args.kill_worker and args.kill_worker[1] >= steps:
            raise UsageError(f"--kill-worker {args.kill_worker[0]}:{args.kill_worker[1]}: the runs have "
                             f"{steps} steps (0 to {steps - 1})")
        print(f"embedding_pipeline: {n} training samples, global batch {args.batch_size}, dim {args.dim}, "
              f"MLP {26 * args.dim + 13}-{'-'.join(map(str, args.hidden))}-1, {args.shards} PS shard "
              f"processes (bsp), mode={args.mode}, rvz {rvz.implementation()}, "
              f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
        runs: list[dict[str, Any]] = []
        for workers, k in settings(args):
            for _ in range(args.repeat):
                cfg = train_settings(args, workers, k)
                spec = JobSpec(train_dir, eval_dir, cfg, ps, shards=args.shards, timeout=args.run_timeout,
                               kill_worker=args.kill_worker, switch_interval=args.switch_interval,
                               host=args.host, crash_job_at=args.crash_job_at)
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                result = run_job(spec)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                # CPU of every process of the run (PS shards and workers, start-up included):
                # when it is close to wall time x free cores, no core was left for overlap.
                result["cpu_seconds"] = (after.ru_utime + after.ru_stime
                                         - before.ru_utime - before.ru_stime)
                for w, first in sorted(result.get("rejoined", {}).items()):
                    print(f"worker {w} was killed and started again; its new process replayed from step "
                          f"{first}", flush=True)
                print(summary_line(result), flush=True)
                runs.append(result)
                if args.checkpoint_every:
                    cut.prune(args.checkpoint_dir, args.shards, workers)
        ok = True
        if len(runs) > 1:
            print(table(runs, oracle))
            for workers, k in dict.fromkeys(settings(args)):
                mine = [r for r in runs if (r["workers"], r["staleness"]) == (workers, k)]
                same = {r["loss_digest"] for r in mine}
                if len(mine) > 1:
                    print(f"workers {workers} staleness {k}: {len(mine)} runs "
                          + ("bit-identical" if len(same) == 1 else f"DIFFER ({sorted(same)})"))
                    ok &= len(same) == 1
        if args.reference:
            from .reference import sequential
            cfg = TrainConfig(global_batch=args.batch_size, hidden=tuple(args.hidden), dense_lr=args.dense_lr,
                              seed=args.seed, max_steps=args.max_steps)
            ref = sequential(Columns.open(train_dir), cfg, ps)
            mine = [r for r in runs if (r["workers"], r["staleness"]) == (1, 0)]
            same = all(r["loss_digest"] == ref.loss_digest() for r in mine)
            verdict = ("no run with 1 worker and staleness 0 to compare" if not mine else
                       "bit-identical" if same else "DIFFERENT")
            print(f"sequential reference: {ref.steps} steps, losses {ref.loss_digest()}: {verdict}")
            ok &= verdict != "DIFFERENT"
        if args.json:
            reports = [{k: r[k] for k in REPORT} for r in runs]
            doc: dict[str, Any] = dict(reports[0]) if len(reports) == 1 else {"runs": reports}
            doc["oracle"] = oracle
            Path(args.json).write_text(json.dumps(doc, indent=1))
        if args.plot:
            plot(runs, args.plot)
        return 0 if ok else 1
    finally:
        if not args.cache_dir:
            shutil.rmtree(cache, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    if args.command == "generate":
        return generate(args)
    stop_on_signals()  # no child, and no temporary cache, outlives the launcher
    try:
        return train(args)
    except JobFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except UsageError as exc:
        print(f"python -m examples.embedding_pipeline train: error: {exc}", file=sys.stderr)
        return 2
    except cut.CutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:
        print(f"embedding_pipeline: stopped by {exc}; every child process was stopped", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
