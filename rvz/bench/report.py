"""Figures into tables: statistics, the readable output, issue 3's targets, the plot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

_UNITS = (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10))


def parse_size(text: str) -> int:
    """``64``, ``4K``, ``256KiB``, ``4M``, ``1G`` (binary multiples) to bytes."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    factor = 1
    for suffix, value in _UNITS:
        if s.endswith(suffix):
            s, factor = s[:-1], value
            break
    try:
        n = int(float(s) * factor)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number with an optional K, M or G") from None
    if n < 1:
        raise ValueError(f"size {text!r}: messages carry at least 1 byte")
    return n


def parse_sizes(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()]


def size_label(n: int) -> str:
    for suffix, value in _UNITS:
        if n >= value and n % value == 0:
            return f"{n // value}{suffix}"
    return f"{n}B" if n < 1024 else str(n)


def rate_label(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def ratio_label(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def latency_stats(samples_ns: Sequence[int]) -> dict[str, Any]:
    """Percentiles in microseconds."""
    if not samples_ns:
        return {"count": 0, "min_us": None, "p50_us": None, "p90_us": None, "p99_us": None,
                "max_us": None, "mean_us": None}
    a = np.asarray(samples_ns, dtype=np.float64) / 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"count": int(a.size), "min_us": float(a.min()), "p50_us": float(p50),
            "p90_us": float(p90), "p99_us": float(p99), "max_us": float(a.max()),
            "mean_us": float(a.mean())}


def subsample(samples: Sequence[int], limit: int = 2000) -> list[int]:
    if len(samples) <= limit:
        return list(samples)
    step = len(samples) / limit
    return [samples[int(i * step)] for i in range(limit)]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[bool] | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if right is None:
        right = [i > 0 for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        parts = [c.rjust(w) if right[i] else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  " + "  ".join(parts).rstrip())
        if n == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- targets ---------------------------------------------------------------------------------------

MEMORY_SIZE = 64 << 20


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 3's targets, each with its figure and met / not met (None: not measured)."""
    stream = results.get("stream", [])
    pingpong = results.get("pingpong", [])
    rendezvous = results.get("rendezvous_summary", [])
    out: list[dict[str, Any]] = []

    def add(tid: str, what: str, required: str, figure: float | None, ok: bool | None,
            detail: str) -> None:
        out.append({"id": tid, "target": what, "required": required, "figure": figure,
                    "met": ok, "detail": detail})

    for size, floor in ((256 << 10, 0.85), (4 << 20, 0.85), (64 << 20, 0.85), (4 << 10, 0.6)):
        row = _find(stream, variant="rvz", mode="send", size=size)
        r = row.get("ratio_socket") if row else None
        detail = (f"{row['gbytes_per_s']:.2f} GB/s vs socket {row['baseline_socket_gbps']:.2f} GB/s"
                  if row and r is not None else "not measured")
        add(f"stream-send-{size_label(size)}", f"stream send-driven {size_label(size)} vs socket",
            f">= {floor}x", r, None if r is None else r >= floor, detail)

    row = _find(stream, variant="rvz", mode="send", size=64)
    r = row.get("ratio_streams") if row else None
    loop = row.get("loop") if row else "uvloop"
    detail = (f"{rate_label(row['msgs_per_s'])} msg/s vs {loop} streams "
              f"{rate_label(row['baseline_streams_msgs'])} msg/s (concurrency {row['concurrency']})"
              if row and r is not None else "not measured")
    add("stream-send-64B", f"stream send-driven 64B msg rate vs {loop} streams", ">= 2.5x", r,
        None if r is None else r >= 2.5, detail)

    row = _find(pingpong, variant="rvz", mode="recv", size=64)
    r = row.get("ratio_streams") if row else None
    loop = row.get("loop") if row else "uvloop"
    detail = (f"p50 {row['p50_us']:.1f} us vs {loop} echo {row['baseline_streams_p50_us']:.1f} us"
              if row and r is not None else "not measured")
    add("pingpong-recv-64B", f"pingpong recv-driven 64B p50 vs {loop} echo", "<= 1.5x", r,
        None if r is None else r <= 1.5, detail)

    for order, ceiling in (("producer-first", 0.6), ("consumer-first", 1.1)):
        row = _find(rendezvous, order=order)
        r = row.get("send_over_recv_p50") if row else None
        detail = (f"send {row['send_p50_us']:.1f} us vs recv {row['recv_p50_us']:.1f} us (p50)"
                  if row and r is not None else "not measured")
        add(f"rendezvous-{order}", f"rendezvous {order}: send p50 / recv p50", f"<= {ceiling}x",
            r, None if r is None else r <= ceiling, detail)

    worst: tuple[float, dict[str, Any]] | None = None
    for row in stream:
        if row.get("variant") == "rvz" and row.get("size") == MEMORY_SIZE and row.get("memory"):
            tensors = row["memory"]["peak_above_idle"] / MEMORY_SIZE
            if worst is None or tensors > worst[0]:
                worst = (tensors, row)
    if worst is None:
        add("memory-64M", "consumer peak RSS above idle, streaming 64M", "< 3 tensors", None, None,
            "not measured")
    else:
        tensors, row = worst
        mem = row["memory"]
        detail = (f"{row['mode']}-driven: idle {mem['idle_rss'] / 2**20:.0f} MiB, peak "
                  f"{mem['peak_rss'] / 2**20:.0f} MiB" + ("" if mem["peak_was_reset"]
                                                          else " (peak not resettable)"))
        add("memory-64M", "consumer peak RSS above idle, streaming 64M", "< 3 tensors", tensors,
            tensors < 3.0, detail)

    comp = results.get("impl_compare")
    r = comp.get("ratio") if comp else None
    detail = (f"compiled {rate_label(comp['compiled_msgs_per_s'])} msg/s vs python "
              f"{rate_label(comp['python_msgs_per_s'])} msg/s" if comp and r is not None
              else "not measured")
    add("compiled-vs-python-64B", "stream 64B compiled / pure Python", ">= 1.5x", r,
        None if r is None else r >= 1.5, detail)
    return out


def targets_table(targets: list[dict[str, Any]]) -> str:
    rows = []
    for t in targets:
        status = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT MET")
        figure = "-" if t["figure"] is None else (
            f"{t['figure']:.2f}" + ("" if t["id"] == "memory-64M" else "x"))
        rows.append([t["target"], t["required"], figure, status, t["detail"]])
    return table(["target (issue 3)", "required", "figure", "status", "detail"], rows,
                 right=[False, True, True, False, False])


# -- the plot ----------------------------------------------------------------------------------------

def plot(results: dict[str, Any], path: str) -> None:
    """Throughput vs size and latency distributions; needs matplotlib (optional extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'rvz[plot]'") from None
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    ax = axes[0]
    series: dict[str, list[tuple[int, float]]] = {}
    for row in results.get("stream", []):
        series.setdefault(row["label"], []).append((row["size"], row["gbytes_per_s"]))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tensor size (bytes)")
    ax.set_ylabel("GB/s (log)")
    ax.set_title("stream: one-way throughput")
    if ax.get_lines():
        ax.legend(fontsize=8)
    ax = axes[1]
    for row in results.get("pingpong", []):
        samples = sorted(row.get("samples_us") or [])
        if samples:
            name = f"{row['label']} {size_label(row['size'])}"
            ax.plot(samples, np.linspace(0, 1, len(samples)), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("round trip (us)")
    ax.set_ylabel("fraction")
    ax.set_title("pingpong: latency CDF")
    if ax.get_lines():
        ax.legend(fontsize=8)
    ax = axes[2]
    data, labels = [], []
    for row in results.get("rendezvous", []):
        if row.get("samples_us"):
            data.append(row["samples_us"])
            labels.append(f"{row['order']}\n{row['mode']}")
    if data:
        ax.boxplot(data, showfliers=False)
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("us from the later call to recv done")
    ax.set_title("rendezvous latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
