"""Figures into tables: statistics, the readable output, the targets, the plot."""

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
    except (ValueError, OverflowError):  # OverflowError: "inf", "1e400"
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


def ratio(x: float | None, base: float | None) -> float | None:
    """``x / base`` of two same-run figures; None when either is missing."""
    if x is None or not base:
        return None
    return x / base


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


HOLD_SIZES = (256 << 10, 4 << 20, 64 << 20)


class _Verdicts:
    """The targets evaluated so far, each a row of ``evaluate_targets``."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []

    def add(self, tid: str, what: str, required: str, figure: float | None, ok: bool | None,
            detail: str, kind: str = "goal") -> None:
        self.out.append({"id": tid, "target": what, "required": required, "figure": figure,
                         "met": ok, "detail": detail, "kind": kind})


def at_least(x: float | None, floor: float) -> bool | None:
    return None if x is None else x >= floor


def at_most(x: float | None, ceiling: float) -> bool | None:
    return None if x is None else x <= ceiling


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals, then the levels already reached that must stay met ("keep"); each with
    its figure (a ratio of same-run figures) and met / not met (None: not measured)."""
    v = _Verdicts()
    stream = results.get("stream", [])
    _message_rates(v, stream, results.get("impl_compare"))
    _throughputs(v, stream)
    _into(v, stream)
    _latencies(v, results.get("pingpong", []), results.get("rendezvous_summary", []))
    _kept_levels(v, stream, results.get("rendezvous_summary", []))
    _memory(v, stream)
    if any(row.get("variant") == "memcpy" for row in stream):
        _onesided(v, stream)
    return v.out


def _message_rates(v: _Verdicts, stream: list[dict[str, Any]], comp: Any) -> None:
    # 64B Send-Driven message rate against pyzmq PUSH/PULL (a plain loop of ``send``): one
    # call per message on 64 lanes, the batch API with 64 keys per call, and a plain loop
    # of ``await send`` (1 in flight: pyzmq's own way of calling).
    for tid, variant, what, floor, key, kind in (
            ("stream-send-64B-vs-pyzmq", "rvz", "64B send-driven msg rate, 64 in flight", 0.5,
             "concurrency", "goal"),
            ("batch-send-64B-vs-pyzmq", "rvz-batch", "64B send-driven batch API, 64 keys/call", 1.0,
             "batch", "goal"),
            ("one-in-flight-64B-vs-pyzmq", "rvz-one", "64B send-driven, 1 in flight", 1.0,
             None, "keep")):
        row = _find(stream, variant=variant, mode="send", size=64)
        r = row.get("ratio_pyzmq") if row else None
        if row and r is not None and key is not None and row.get(key) != 64:
            detail = f"measured with {key} {row.get(key)}, the target is at 64"
            r = None
        elif row and r is not None:
            detail = (f"{rate_label(row['msgs_per_s'])} msg/s vs pyzmq PUSH/PULL "
                      f"{rate_label(row['baseline_pyzmq_msgs'])} msg/s")
        else:
            detail = "not measured" + ("" if row is None else " (no pyzmq baseline)")
        v.add(tid, f"{what} vs pyzmq", f">= {floor}x", r, at_least(r, floor), detail, kind=kind)

    r = comp.get("ratio") if comp else None
    detail = (f"compiled {rate_label(comp['compiled_msgs_per_s'])} msg/s vs python "
              f"{rate_label(comp['python_msgs_per_s'])} msg/s" if comp and r is not None
              else "not measured")
    v.add("compiled-vs-python-64B", "stream 64B compiled / pure Python", ">= 3x", r,
        at_least(r, 3.0), detail)


def _throughputs(v: _Verdicts, stream: list[dict[str, Any]]) -> None:
    row = _find(stream, variant="rvz-one", mode="send", size=4 << 10)
    r = row.get("ratio_socket") if row else None
    detail = (f"{row['gbytes_per_s']:.2f} GB/s vs socket {row['baseline_socket_gbps']:.2f} GB/s"
              if row and r is not None else "not measured")
    v.add("one-in-flight-4K", "4K send-driven, 1 in flight, vs socket", ">= 0.8x", r,
        at_least(r, 0.8), detail)

    for mode in ("send", "recv"):
        # the worst size counts
        worst: dict[str, Any] | None = None
        for size in HOLD_SIZES:
            row = _find(stream, variant="rvz-hold", mode=mode, size=size)
            if row and row.get("ratio_socket") is not None and (
                    worst is None or row["ratio_socket"] < worst["ratio_socket"]):
                worst = row
        measured = sorted({r_["size"] for r_ in stream if r_.get("variant") == "rvz-hold"
                           and r_.get("mode") == mode and r_.get("ratio_socket") is not None})
        r = worst["ratio_socket"] if worst else None
        if worst is None:
            detail = "not measured"
        else:
            detail = (f"worst {size_label(worst['size'])}: {worst['gbytes_per_s']:.2f} GB/s vs "
                      f"socket {worst['baseline_socket_gbps']:.2f} GB/s (of "
                      f"{', '.join(size_label(x) for x in measured)})")
            reply = worst.get("baseline_socket_reply_gbps")
            if reply:
                # Context, not the verdict: one message in flight, each asked for, costs the
                # plain socket this much of its streaming rate here.
                detail += (f"; socket request/reply, same size: {reply:.2f} GB/s "
                           f"({reply / worst['baseline_socket_gbps']:.2f}x the socket)")
        v.add(f"holds-previous-{mode}", f"256K..64M {mode}-driven holds previous vs socket",
            ">= 0.9x", r, at_least(r, 0.9), detail)


def _into(v: _Verdicts, stream: list[dict[str, Any]]) -> None:
    """recv(..., into=) at 64M: its rate against the holds-previous stream of the same mode,
    and the consumer's memory beyond its buffers."""
    for mode in ("send", "recv"):
        row = _find(stream, variant="rvz-into", mode=mode, size=MEMORY_SIZE)
        base = _find(stream, variant="rvz-hold", mode=mode, size=MEMORY_SIZE)
        r = ratio(row["gbytes_per_s"] if row else None, base["gbytes_per_s"] if base else None)
        detail = (f"{row['gbytes_per_s']:.2f} GB/s vs numpy holds previous "
                  f"{base['gbytes_per_s']:.2f} GB/s" if row and base and r is not None
                  else "not measured")
        v.add(f"into-64M-{mode}", f"64M {mode}-driven into= vs numpy holds previous", ">= 0.95x",
              r, at_least(r, 0.95), detail)
        tensors = row["memory"]["peak_above_idle"] / MEMORY_SIZE if row and row.get("memory") else None
        v.add(f"into-memory-64M-{mode}", f"64M {mode}-driven into=: consumer peak RSS above idle",
              "< 1 tensor", tensors, None if tensors is None else tensors < 1.0,
              "not measured" if tensors is None else f"{tensors:.2f} tensors")


def _latencies(v: _Verdicts, pingpong: list[dict[str, Any]],
               rendezvous: list[dict[str, Any]]) -> None:
    for mode, ceiling in (("recv", 1.2), ("send", 1.1)):
        row = _find(pingpong, variant="rvz", mode=mode, size=64)
        r = row.get("ratio_streams") if row else None
        loop = row.get("loop") if row else "uvloop"
        detail = (f"p50 {row['p50_us']:.1f} us vs {loop} echo {row['baseline_streams_p50_us']:.1f} us"
                  if row and r is not None else "not measured")
        if row and row.get("busy_poll_us"):
            detail += f" (both busy-polling {row['busy_poll_us']:g} us)"
        v.add(f"pingpong-{mode}-64B", f"pingpong {mode}-driven 64B p50 vs {loop} echo",
            f"<= {ceiling}x", r, at_most(r, ceiling), detail)

    row = _find(pingpong, variant="rvz-sent", mode="recv", size=64)
    r = row.get("ratio_streams") if row else None
    detail = (f"p50 {row['p50_us']:.1f} us vs {row['loop']} echo {row['baseline_streams_p50_us']:.1f} us"
              if row and r is not None else "not measured")
    v.add("already-sent-recv-64B", "recv-driven recv of a value already sent, 64B p50 vs echo",
          "<= 1.1x", r, at_most(r, 1.1), detail)

    row = _find(rendezvous, order="consumer-first")
    r = row.get("send_over_recv_p50") if row else None
    detail = (f"send {row['send_p50_us']:.1f} us vs recv {row['recv_p50_us']:.1f} us (p50)"
              if row and r is not None else "not measured")
    host = row.get("socket_push_over_reply_p50") if row else None
    if host is not None:
        # Context, not the verdict: what the same rounds cost on a plain socket here.
        detail += f"; plain socket, same rounds: push / request+reply {host:.2f}x"
    v.add("rendezvous-consumer-first", "rendezvous consumer-first: send p50 / recv p50", "<= 1.0x",
        r, at_most(r, 1.0), detail)


def _kept_levels(v: _Verdicts, stream: list[dict[str, Any]],
                 rendezvous: list[dict[str, Any]]) -> None:
    """Levels already reached: they must stay met."""
    for size, floor in ((4 << 20, 0.85), (64 << 20, 0.85), (4 << 10, 0.6)):
        row = _find(stream, variant="rvz", mode="send", size=size)
        r = row.get("ratio_socket") if row else None
        detail = (f"{row['gbytes_per_s']:.2f} GB/s vs socket {row['baseline_socket_gbps']:.2f} GB/s"
                  if row and r is not None else "not measured")
        v.add(f"stream-send-{size_label(size)}", f"stream send-driven {size_label(size)} vs socket",
            f">= {floor}x", r, at_least(r, floor), detail, kind="keep")

    row = _find(rendezvous, order="producer-first")
    r = row.get("send_over_recv_p50") if row else None
    detail = (f"send {row['send_p50_us']:.1f} us vs recv {row['recv_p50_us']:.1f} us (p50)"
              if row and r is not None else "not measured")
    v.add("rendezvous-producer-first", "rendezvous producer-first: send p50 / recv p50", "<= 0.6x",
        r, at_most(r, 0.6), detail, kind="keep")


def _memory(v: _Verdicts, stream: list[dict[str, Any]]) -> None:
    worst_mem: tuple[float, dict[str, Any]] | None = None
    for row in stream:
        if row.get("variant") == "rvz" and row.get("size") == MEMORY_SIZE and row.get("memory"):
            tensors = row["memory"]["peak_above_idle"] / MEMORY_SIZE
            if worst_mem is None or tensors > worst_mem[0]:
                worst_mem = (tensors, row)
    if worst_mem is None:
        v.add("memory-64M", "consumer peak RSS above idle, streaming 64M", "< 3 tensors", None, None,
            "not measured", kind="keep")
    else:
        tensors, row = worst_mem
        mem = row["memory"]
        detail = (f"{row['mode']}-driven: idle {mem['idle_rss'] / 2**20:.0f} MiB, peak "
                  f"{mem['peak_rss'] / 2**20:.0f} MiB" + ("" if mem["peak_was_reset"]
                                                          else " (peak not resettable)"))
        v.add("memory-64M", "consumer peak RSS above idle, streaming 64M", "< 3 tensors", tensors,
            tensors < 3.0, detail, kind="keep")


# The one-sided holds-previous rows against the same rows over TCP and a same-size copy.
ONESIDED_FLOORS = ((4 << 20, 1.5, 0.5), (64 << 20, 2.0, 0.7))


def _onesided(v: _Verdicts, stream: list[dict[str, Any]]) -> None:
    for mode in ("send", "recv"):
        for size, tcp_floor, copy_floor in ONESIDED_FLOORS:
            row = _find(stream, variant="rvz-hold", mode=mode, size=size)
            name = f"{size_label(size)} {mode}-driven holds previous, one-sided"
            for base, floor in (("tcp", tcp_floor), ("memcpy", copy_floor)):
                r = row.get(f"ratio_{base}") if row else None
                detail = (f"{row['gbytes_per_s']:.2f} GB/s vs {base} "
                          f"{row[f'baseline_{base}_gbps']:.2f} GB/s"
                          if row and r is not None else "not measured")
                v.add(f"onesided-hold-{mode}-{size_label(size)}-vs-{base}", f"{name} vs {base}",
                      f">= {floor}x", r, at_least(r, floor), detail)


def targets_table(targets: list[dict[str, Any]]) -> str:
    rows = []
    for t in targets:
        status = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT MET")
        figure = "-" if t["figure"] is None else (
            f"{t['figure']:.2f}" + ("" if t["id"] == "memory-64M" else "x"))
        rows.append([t["target"], t["kind"], t["required"], figure, status, t["detail"]])
    return table(["target (goal: to reach; keep: reached, must stay met)", "kind", "required",
                  "figure", "status", "detail"], rows,
                 right=[False, False, True, True, False, False])


# -- the plot ----------------------------------------------------------------------------------------

def plot_unavailable() -> str | None:
    """Why ``--plot`` cannot work here (None: it can); asked before a run starts."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "needs matplotlib: pip install 'rvz[plot]'"
    return None


def plot_panels(results: dict[str, Any]) -> list[str]:
    """The panels that have data, in order: ``stream``, ``pingpong``, ``rendezvous``."""
    panels = []
    if results.get("stream"):
        panels.append("stream")
    if any(row.get("samples_us") for row in results.get("pingpong", [])):
        panels.append("pingpong")
    if any(row.get("samples_us") for row in results.get("rendezvous", [])):
        panels.append("rendezvous")
    return panels


def plot(results: dict[str, Any], path: str) -> bool:
    """Throughput vs size and latency distributions, one panel per kind of result this run
    has; needs matplotlib (the ``plot`` extra).  False, and no file, when there is nothing to
    draw."""
    why = plot_unavailable()
    if why:
        raise RuntimeError(f"--plot {why}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogFormatter, NullLocator

    panels = plot_panels(results)
    if not panels:
        return False
    # Plain numbers on log axes (20, 50, 0.1), not 2x10^1; minor ticks labelled only when the
    # axis spans about a decade, so labels never crowd.
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "stream":
            series: dict[str, list[tuple[int, float]]] = {}
            for row in results["stream"]:
                series.setdefault(row["label"], []).append((row["size"], row["gbytes_per_s"]))
            for label, points in sorted(series.items()):
                points.sort()
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
            sizes = sorted({row["size"] for row in results["stream"]})
            ax.set_xscale("log", base=2)
            # One tick per measured size, written as the CLI writes it (4K, not 2^12).
            ax.xaxis.set_major_locator(FixedLocator(sizes))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: size_label(int(round(x)))))
            if len(sizes) == 1:
                ax.set_xlim(sizes[0] / 2, sizes[0] * 2)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(plain)
            ax.set_xlabel("tensor size (bytes)")
            ax.set_ylabel("GB/s (log scale)")
            ax.set_title("stream: one-way throughput")
            ax.grid(True, which="major", alpha=0.3)
        elif panel == "pingpong":
            for row in results["pingpong"]:
                samples = sorted(row.get("samples_us") or [])
                if samples:
                    name = f"{row['label']} {size_label(row['size'])}"
                    ax.plot(samples, np.linspace(0, 1, len(samples)), label=name)
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))
            ax.set_xlabel("round trip (us, log scale)")
            ax.set_ylabel("fraction of round trips")
            ax.set_title("pingpong: latency CDF")
            ax.grid(True, alpha=0.3)
        else:
            data, labels = [], []
            for row in results["rendezvous"]:
                if row.get("samples_us"):
                    data.append(row["samples_us"])
                    labels.append(f"{row['order']}\n{row['mode']}-driven")
            ax.boxplot(data, showfliers=False)
            ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))
            ax.set_ylabel("us from the later call to recv done (log scale)")
            ax.set_title("rendezvous latency")
            ax.grid(True, axis="y", alpha=0.3)
        if ax.get_lines() and panel != "rendezvous":
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
