"""Micro-benchmark of the receive pool: a consumer that keeps its previous array, one process.

    python bench/recv_pool.py                 # 256 KiB, 4 MiB, 64 MiB
    python bench/recv_pool.py --jitter 0.05      # sizes vary by up to 5% per message
    python bench/recv_pool.py --sizes 1M,16M --hold 2 --json F

Each message does what the decoder and the consumer do with a large payload: ``take`` a
block (or ``np.empty`` when the pool answers None), build the array on it with
``np.frombuffer``, fill it with a copy from a source array (the stand-in for the copy out of
the socket), keep the newest ``--hold`` arrays and drop older ones.  After each message the
pool's ``maintain()`` runs, as the transport calls it between reads.

The rows, all measured in the same run: ``reuse`` copies into one buffer allocated once (what
the blocking-socket baseline does: the ceiling), ``empty`` allocates per message, ``old pool``
is the pool before it adapted (read from git at ``--old-rev``), ``pool`` is this tree's pool
at the old default limit and at the proposed one, compiled and pure Python.  Figures are GB/s
of the steady state (the first messages, while a pool learns, are not timed), the best of
``--repeat`` runs, and ratios against ``reuse`` and ``empty``, with the page faults per
message (the worst run): a figure a busy machine does not disturb.  Only the pool module is
loaded (``rvz._fast.recvpool`` compiled, its source as pure Python), not the rest of rvz.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import resource
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
OLD_REV = "918b549"  # the last commit with the fixed-size pool


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def load_old_pool(rev: str) -> Any:
    """The RecvPool class as it was at ``rev``, or None if git cannot show it."""
    try:
        source = subprocess.run(["git", "show", f"{rev}:rvz/_fast/recvpool.py"], cwd=ROOT,
                                check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("old_recvpool")
    exec(compile(source, f"{rev}:rvz/_fast/recvpool.py", "exec"), module.__dict__)
    return module.RecvPool


def pool_variants() -> dict[str, Any]:
    """This tree's RecvPool, compiled (if built) and pure Python, loaded side by side.

    Loaded from their files alone (the module imports nothing of rvz), so the benchmark runs
    whatever state the rest of the package is in.
    """
    out = {}
    here = ROOT / "rvz" / "_fast"
    built = sorted(here.glob("recvpool.*.so")) + sorted(here.glob("recvpool.*.pyd"))
    paths = ([("compiled", built[0])] if built else []) + [("python", here / "recvpool.py")]
    for name, path in paths:
        module_name = "recvpool" if name == "compiled" else "recvpool_py"  # the init symbol
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out[name] = module.RecvPool
    return out


def message_sizes(nbytes: int, count: int, jitter: float) -> list[int]:
    """``count`` sizes around ``nbytes`` (within +-``jitter`` of it, multiples of 8), seeded."""
    if jitter <= 0:
        return [nbytes] * count
    rng = np.random.default_rng(7)
    spread = int(nbytes * jitter)
    return [max(8, (nbytes + int(d)) // 8 * 8) for d in rng.integers(-spread, spread + 1, count)]


def run_case(sizes: list[int], warm: int, hold: int, make_pool: Callable[[], Any] | None,
             reuse: bool = False) -> tuple[float, float]:
    """Seconds for the messages after the first ``warm``, and page faults per message."""
    top = max(sizes)
    src = np.ones(top, np.uint8)
    pool = make_pool() if make_pool is not None else None
    maintain = getattr(pool, "maintain", None)
    kept: collections.deque[np.ndarray] = collections.deque()
    one = np.empty(top, np.uint8) if reuse else None
    start = faults = 0
    for i, nbytes in enumerate(sizes):
        if i == warm:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter_ns()
        if one is not None:
            arr = one[:nbytes]
        else:
            block = pool.take(nbytes) if pool is not None else None
            arr = np.empty(nbytes, np.uint8) if block is None else np.frombuffer(block, np.uint8, nbytes)
            del block
        np.copyto(arr, src[:nbytes])
        kept.append(arr)
        del arr
        if len(kept) > hold:
            kept.popleft()
        if maintain is not None:
            maintain()
    secs = (time.perf_counter_ns() - start) / 1e9
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return secs, faults / (len(sizes) - warm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256K,4M,64M")
    parser.add_argument("--hold", type=int, default=1, help="arrays the consumer keeps (1: the previous)")
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="message sizes vary within +- this fraction (0.05: 5%%)")
    parser.add_argument("--volume", default="1G", help="bytes per timed run and size")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--old-limit", default="64M", help="the old default recv_pool")
    parser.add_argument("--new-limit", default="256M", help="the proposed default recv_pool")
    parser.add_argument("--old-rev", default=OLD_REV)
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    volume = parse_size(args.volume)
    old_limit = parse_size(args.old_limit)
    new_limit = parse_size(args.new_limit)
    old_pool = load_old_pool(args.old_rev)
    variants = pool_variants()

    rows: list[tuple[str, Callable[[], Any] | None, bool]] = [("reuse (one buffer)", None, True),
                                                                 ("empty (np.empty)", None, False)]
    if old_pool is not None:
        for limit in (old_limit, new_limit):
            rows.append((f"old pool {limit // MiB}M", functools.partial(old_pool, limit), False))
    for name, cls in variants.items():
        for limit in (old_limit, new_limit):
            rows.append((f"pool {limit // MiB}M {name}", functools.partial(cls, limit), False))

    results: list[dict[str, Any]] = []
    print(f"hold={args.hold} jitter={args.jitter}  (GB/s, steady state; x reuse / x empty)")
    for nbytes in sizes:
        messages = max(8, volume // nbytes)
        warm = 2 * args.hold + 4
        sizes_seq = message_sizes(nbytes, warm + messages, args.jitter)
        secs: dict[str, float] = {}
        faults: dict[str, float] = {}
        for _ in range(args.repeat):
            for label, make, reuse in rows:
                t, f = run_case(sizes_seq, warm, args.hold, make, reuse)
                secs[label] = min(secs.get(label, t), t)
                faults[label] = max(faults.get(label, f), f)
        base = secs["reuse (one buffer)"]
        empty = secs["empty (np.empty)"]
        print(f"{nbytes // 1024} KiB x {messages}")
        for label, _, _ in rows:
            gbps = sum(sizes_seq[warm:]) / secs[label] / 1e9
            print(f"  {label:24s} {gbps:7.2f} GB/s  {base / secs[label]:5.2f}x reuse  "
                  f"{empty / secs[label]:5.2f}x empty  {faults[label]:7.1f} faults/msg")
            results.append({"size": nbytes, "row": label, "hold": args.hold, "jitter": args.jitter,
                            "gbps": gbps,
                            "vs_reuse": base / secs[label], "vs_empty": empty / secs[label],
                            "faults_per_msg": faults[label]})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
