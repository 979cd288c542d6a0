"""Micro-benchmarks of rvz's hot paths, compiled vs pure Python, in one process.

    python bench/micro.py            # the table
    python bench/micro.py --json F   # and every figure in F
    python bench/micro.py --quick    # shorter (for a smoke test)

Both variants are loaded side by side with ``rvz._impl.load("compiled")`` and
``rvz._impl.load("python")`` and run the same operations on the same inputs; the speed-up is
the pure-Python time over the compiled time.  Each figure is the best of several timed
repeats (the least disturbed by the rest of the machine), in nanoseconds per operation.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from rvz import _impl

SRC = "/job:worker/replica:0/task:0/device:CPU:0"
DST = "/job:ps/replica:0/task:0/device:CPU:0"


class Waiter:
    """The least a table needs of a waiter (a future's done / set_result)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None

    def done(self) -> bool:
        return self.value is not None

    def set_result(self, value: Any) -> None:
        self.value = value


def frames(codec: Any, n: int, size: int) -> bytes:
    """HELLO followed by ``n`` DATA frames of ``size``-byte uint8 tensors."""
    key = f"{SRC};0000000000000001;{DST};emb_0;0:0".encode()
    payload = bytes(size)
    data = codec.encode_data(0, 0, key, codec.dtype_code(np.dtype(np.uint8)), (size,), size) + payload
    hello = codec.encode_hello({"v": codec.VERSION, "job": "worker", "task": 0, "inc": 1,
                                "order": sys.byteorder})
    return hello + data * n


def cases(v: SimpleNamespace) -> dict[str, tuple[Callable[[int], None], int]]:
    """name -> (run(n): do the operation n times, operations per call of run)."""
    codec, keys, table_mod = v.codec, v.keys, v.table
    key_bytes = f"{SRC};0000000000000001;{DST};emb_0;0:0".encode()
    text = key_bytes.decode()
    u8 = codec.dtype_code(np.dtype(np.uint8))
    shape = (64,)

    def encode_data(n: int) -> None:
        # as the engine writes one: the header appended to the connection's write buffer
        append, out = v.arrays.append_data, bytearray()
        for _ in range(n):
            append(out, 7, 0, key_bytes, u8, shape, 64, None, False)

    def encode_request(n: int) -> None:
        # as the engine writes one: appended to the connection's write buffer
        append, out = v.arrays.append_request, bytearray()
        for _ in range(n):
            append(out, 7, 12345, key_bytes)

    def decoder(size: int, batch: int) -> Callable[[int], None]:
        stream = frames(codec, batch, size)

        def run(n: int) -> None:
            for _ in range(n):
                dec = codec.Decoder()
                view = memoryview(stream)
                pos = 0
                count = 0
                while pos < len(stream):
                    buf = dec.get_buffer(len(stream) - pos)
                    k = min(len(buf), len(stream) - pos)
                    buf[:k] = view[pos:pos + k]
                    pos += k
                    count += len(dec.buffer_updated(k))
                assert count == batch + 1, count
        return run

    def key_parse(n: int) -> None:
        parse = keys.Key.parse
        for _ in range(n):
            parse(text)

    def key_format(n: int) -> None:
        Key = keys.Key
        for i in range(n):
            str(Key(SRC, DST, "emb_0", 0, i, 1))

    def key_hash(n: int) -> None:
        k = keys.Key(SRC, DST, "emb_0", 0, 0, 1)
        for _ in range(n):
            hash(k)

    def parse_device(n: int) -> None:
        parse = keys.parse_device
        for _ in range(n):
            parse(SRC)

    def table_put_take(n: int) -> None:
        t = table_mod.Table()
        put, take = t.put, t.take
        for _ in range(n):
            put(text, 1)
            take(text)

    def table_wait_put(n: int) -> None:
        t = table_mod.Table()
        wait, put = t.take_or_wait, t.put
        for _ in range(n):
            wait(text, Waiter())
            put(text, 1)

    def table_queue_16(n: int) -> None:
        t = table_mod.Table()
        put, take = t.put, t.take
        for _ in range(n):
            for _ in range(16):
                put(text, 1)
            for _ in range(16):
                take(text)

    return {
        "frame encode DATA header (into a buffer)": (encode_data, 1),
        "frame encode REQUEST (into a buffer)": (encode_request, 1),
        "frame decode 64B DATA (per frame)": (decoder(64, 256), 257),
        "frame decode 4K DATA (per frame)": (decoder(4096, 32), 33),
        "key parse": (key_parse, 1),
        "key format (new Key + str)": (key_format, 1),
        "key hash": (key_hash, 1),
        "device parse": (parse_device, 1),
        "table put + take": (table_put_take, 1),
        "table take_or_wait + put": (table_wait_put, 1),
        "table 16 queued put/take (per op)": (table_queue_16, 32),
    }


def timeit(run: Callable[[int], None], per_call: int, budget: float, repeats: int) -> float:
    """Best ns per operation over ``repeats`` timings of about ``budget`` seconds each."""
    n = 1
    while True:  # calibrate
        t = time.perf_counter()
        run(n)
        dt = time.perf_counter() - t
        if dt > budget / 4 or n > 1 << 24:
            break
        n *= 2
    n = max(1, int(n * budget / max(dt, 1e-9)))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter_ns()
        run(n)
        best = min(best, (time.perf_counter_ns() - t) / (n * per_call))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--quick", action="store_true", help="short timings (a smoke test)")
    args = parser.parse_args(argv)
    budget, repeats = (0.02, 2) if args.quick else (0.2, 5)
    variants = {"python": _impl.load("python")}
    try:
        variants["compiled"] = _impl.load("compiled")
    except ImportError as exc:
        print(f"note: {exc}; only pure Python is measured", file=sys.stderr)
    results: dict[str, dict[str, float]] = {}
    per_variant = {name: cases(v) for name, v in variants.items()}
    for name in per_variant["python"]:
        results[name] = {}
        for variant, table in per_variant.items():
            run, per_call = table[name]
            results[name][variant] = timeit(run, per_call, budget, repeats)
    rows = []
    for name, figures in results.items():
        comp = figures.get("compiled")
        py = figures["python"]
        rows.append((name, f"{comp:.0f}" if comp else "-", f"{py:.0f}",
                     f"{py / comp:.2f}x" if comp else "-"))
    widths = [max(len(r[i]) for r in rows + [("operation", "compiled ns", "python ns", "speed-up")])
              for i in range(4)]
    header = ("operation", "compiled ns", "python ns", "speed-up")
    print(f"rvz hot paths, ns per operation (best of {repeats}); python {platform.python_version()}, "
          f"{platform.machine()}")
    print("  ".join(h.ljust(widths[0]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(header)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ns_per_op": results, "python": platform.python_version(),
                       "machine": platform.machine(), "budget_s": budget, "repeats": repeats}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
