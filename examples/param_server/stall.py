"""``python -m examples.param_server.stall``: pull latency while a shard writes a checkpoint.

One shard process (asp, lazy Adam, checkpoints on) and one worker in this process. The
worker fills the shard's table with ``--rows`` rows, pulls ``--ids`` ids back to back for
``--warm`` pulls, then pushes once: the push ends clock 0, which makes the shard start a
full checkpoint of the whole table. The worker keeps pulling, one pull in flight, until the
checkpoint's manifest is on disk, then for as long again with no checkpoint running, and
prints the median and the longest pull before, during and after the write, and how many
pulls were answered while it was written. The window after is the bound the machine sets:
on a shared machine a pull can wait for a core with no checkpoint at all.

A shard that wrote its checkpoint on its event loop would answer no pull meanwhile; the
shard copies the rows a slice per loop pass that has no request to run (copy on write keeps
the checkpoint's moment) and a helper thread writes them (server.py,
``ShardServer.checkpoint``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import rvz

from .checkpoint import MANIFEST
from .client import PSClient
from .launch import Processes, PSConfig, local_cluster, start_shards
from .protocol import WORKER_JOB


async def _worker(cluster: dict[str, Any], manifest: Path, rows: int, dim: int, n: int, warm: int,
                  timeout: float) -> dict[str, Any]:
    async with rvz.Node(cluster, WORKER_JOB, 0, mode="recv") as node:
        client = PSClient(node, 1, dim)
        rng = np.random.default_rng(0)
        all_ids = np.unique(rng.integers(0, 1 << 62, rows + rows // 50 + 64))[:rows]
        fill = 1 << 16
        for start in range(0, rows, fill):
            await asyncio.wait_for(client.lookup_unique(all_ids[start:start + fill]), timeout)
        before: list[float] = []
        during: list[float] = []

        async def pull() -> float:
            ids = np.unique(rng.choice(all_ids, n))
            t0 = time.perf_counter()
            await asyncio.wait_for(client.lookup_unique(ids), timeout)
            return time.perf_counter() - t0

        for _ in range(warm):
            before.append(await pull())
        grads = np.full((n, dim), 1e-3, dtype=np.float32)
        t0 = time.perf_counter()
        await asyncio.wait_for(client.push_unique(all_ids[:n], grads), timeout)  # clock 1: a checkpoint
        push = time.perf_counter() - t0
        deadline = time.monotonic() + timeout
        while not manifest.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no checkpoint within {timeout} s")
            during.append(await pull())
        written = time.perf_counter() - t0
        after: list[float] = []
        end = time.perf_counter() + written
        while time.perf_counter() < end:
            after.append(await pull())
        await client.close()
    return {"before": before, "during": during, "after": after, "push_s": push, "written_s": written}


def _ms(xs: list[float], q: float | None = None) -> float | None:
    if not xs:
        return None
    return 1e3 * (max(xs) if q is None else float(np.quantile(xs, q)))


def measure(rows: int, dim: int = 16, ids: int = 4096, warm: int = 200, timeout: float = 120.0,
            fsync: bool = True, root: str | None = None) -> dict[str, Any]:
    """Run the scenario (see the module's description); the pull figures in milliseconds."""
    with tempfile.TemporaryDirectory(prefix="rvz-stall-", dir=root) as tmp:
        cfg = PSConfig(dim=dim, optimizer="adam", consistency="asp", checkpoint_dir=tmp, checkpoint_every=1,
                       fsync=fsync, mode="recv")
        cluster = local_cluster(1, 1)
        manifest = Path(tmp) / "ps0" / "default" / MANIFEST
        with Processes() as procs:
            start_shards(procs, cluster, cfg)
            out = rvz.run(_worker(cluster, manifest, rows, dim, ids, warm, timeout))
            procs.wait(timeout)
    before, during, after = out["before"], out["during"], out["after"]
    return {"rows": rows, "dim": dim, "ids": ids, "pulls_before": len(before), "pulls_during": len(during),
            "pulls_after": len(after), "median_ms_before": _ms(before, 0.5), "max_ms_before": _ms(before),
            "median_ms_during": _ms(during, 0.5), "max_ms_during": _ms(during),
            "median_ms_after": _ms(after, 0.5), "max_ms_after": _ms(after),
            "median_ms": _ms(before + during, 0.5),
            "push_ms": 1e3 * out["push_s"], "checkpoint_s": out["written_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.param_server.stall", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--ids", type=int, default=4096, help="ids per pull")
    p.add_argument("--warm", type=int, default=200, help="pulls before the checkpoint")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    r = measure(a.rows, a.dim, a.ids, a.warm)
    ratio = r["max_ms_during"] / r["median_ms"] if r["max_ms_during"] else float("nan")
    print(f"checkpoint of {r['rows']} rows (dim {r['dim']}, Adam) written in {r['checkpoint_s']:.2f} s "
          f"after the push that started it ({r['push_ms']:.1f} ms)")
    print(f"pulls of {r['ids']} ids: before, median {r['median_ms_before']:.2f} ms, max "
          f"{r['max_ms_before']:.2f} ms ({r['pulls_before']}); during the write, median "
          f"{r['median_ms_during']:.2f} ms, max {r['max_ms_during']:.2f} ms ({r['pulls_during']} pulls)")
    if r["max_ms_after"] is not None:
        print(f"after the write, as long again with no checkpoint: median {r['median_ms_after']:.2f} ms, "
              f"max {r['max_ms_after']:.2f} ms ({r['pulls_after']} pulls; "
              f"{r['max_ms_after'] / r['median_ms']:.2f}x the median)")
    print(f"longest pull during the write / median pull of the run: {ratio:.2f}x "
          f"({'met' if ratio <= 2 else 'NOT met'}: at most 2x)")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
