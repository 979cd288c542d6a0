"""A model-based randomized test of one rendezvous table: ``rvz.Rendezvous`` and a node's
local keys (the table a consumer's recv and recv_many wait in).

A small reference model keeps, per key, the values nobody received (in send order) and the
receivers waiting (in the order they came).  Random sends, recvs, recv_many (keys repeated
too), cancellations (of waiting receivers, and of receivers the same pass of the loop
already gave a value to), cancellations followed by a send before the cancelled task ran,
and timeouts run against the table, and every outcome (value, order, exception) must be the
model's.  Everything is local and driven by the loop alone, so each seed is deterministic.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import rvz

from .conftest import FAST, PS, key, settle

NAMES = ["a", "b", "c"]


class Op:
    """One recv or recv_many: its task and, as the model sees it, the values it got."""

    def __init__(self, task: asyncio.Future[Any], keys: list[Any], many: bool) -> None:
        self.task = task
        self.keys = keys
        self.many = many
        self.got: list[int | None] = [None] * len(keys)
        self.outcome = "pending"  # pending, done, cancelled, timeout


class Model:
    def __init__(self) -> None:
        self.queued: dict[Any, list[int]] = {}   # key -> values nobody received, oldest first
        self.waiting: dict[Any, list[tuple[Op, int]]] = {}  # key -> (op, position), oldest first

    def put(self, k: Any, value: int) -> None:
        queue = self.queued.setdefault(k, [])
        queue.append(value)
        queue.sort()  # values come back ahead of later ones: the queue stays in send order
        self.deliver(k)

    def deliver(self, k: Any) -> None:
        queue = self.queued.setdefault(k, [])
        waiters = self.waiting.setdefault(k, [])
        while queue and waiters:
            op, i = waiters.pop(0)
            op.got[i] = queue.pop(0)
            if all(g is not None for g in op.got):
                op.outcome = "done"

    def start(self, op: Op) -> None:
        for i, k in enumerate(op.keys):
            if self.queued.get(k) and not self.waiting.get(k):
                op.got[i] = self.queued[k].pop(0)
            else:
                self.waiting.setdefault(k, []).append((op, i))
        if all(g is not None for g in op.got):
            op.outcome = "done"

    def fail(self, op: Op, outcome: str) -> None:
        """``op`` was cancelled or timed out: what it got goes back, its waiters go."""
        op.outcome = outcome
        for k in self.waiting:
            self.waiting[k] = [w for w in self.waiting[k] if w[0] is not op]
        for i, k in enumerate(op.keys):
            value = op.got[i]
            if value is not None:
                op.got[i] = None
                self.put(k, value)


@contextlib.asynccontextmanager
async def endpoint(target: str) -> AsyncIterator[Any]:
    if target == "rendezvous":
        yield rvz.Rendezvous()
    else:
        cluster = rvz.ClusterSpec.loopback({"ps": 1})
        async with rvz.Node(cluster, "ps", 0, "recv", **FAST) as node:
            yield node


def value(i: int) -> np.ndarray:
    return np.array([i], np.int64)


async def run_model(seed: int, target: str, steps: int = 150) -> None:
    rnd = random.Random(seed)
    keys = [key(name, src=PS, dst=PS) for name in NAMES]
    model = Model()
    ops: list[Op] = []
    counter = 0
    trace: list[str] = []

    async with endpoint(target) as end:
        def send(k: Any) -> None:
            nonlocal counter
            counter += 1
            coro = end.send(k, value(counter))
            if asyncio.iscoroutine(coro):  # a node's local send completes without suspending
                try:
                    coro.send(None)
                except StopIteration:
                    pass
                else:  # pragma: no cover - it must not suspend
                    raise AssertionError("a local send suspended")
            trace.append(f"send {k.name} {counter}")
            model.put(k, counter)

        def start(chosen: list[Any], many: bool, timeout: float | None = None) -> Op:
            aw = end.recv_many(chosen, timeout=timeout) if many else end.recv(chosen[0], timeout=timeout)
            op = Op(asyncio.ensure_future(aw), chosen, many)
            model.start(op)
            ops.append(op)
            trace.append(f"start {len(ops) - 1} {'many' if many else 'recv'} "
                         f"{[k.name for k in chosen]} -> {op.outcome} {op.got}")
            return op

        def pending() -> list[Op]:
            return [op for op in ops if op.outcome == "pending"]

        async def check() -> None:
            await settle(10)
            for n, op in enumerate(ops):
                task = op.task
                where = f"seed {seed}, op {n} ({op.outcome}):\n" + "\n".join(trace)
                if op.outcome == "pending":
                    assert not task.done(), where
                    continue
                assert task.done(), where
                if op.outcome == "cancelled":
                    assert task.cancelled(), where
                elif op.outcome == "timeout":
                    assert isinstance(task.exception(), TimeoutError), where
                else:
                    result = task.result()
                    got = [int(x[0]) for x in (result if op.many else [result])]
                    assert got == op.got, f"got {got}, model {op.got}; " + where

        for _ in range(steps):
            r = rnd.random()
            if r < 0.3:
                for _ in range(rnd.choice([1, 1, 2, 3])):
                    send(rnd.choice(keys))
            elif r < 0.6:
                many = rnd.random() < 0.6
                chosen = [rnd.choice(keys) for _ in range(rnd.randint(1, 4) if many else 1)]
                start(chosen, many)
            elif r < 0.7 and pending():
                op = rnd.choice(pending())
                trace.append(f"cancel {ops.index(op)}")
                op.task.cancel()
                model.fail(op, "cancelled")
            elif r < 0.8 and pending():
                # a value reaches a receiver, which is cancelled before it resumes: the value
                # goes back (to the next receiver, else ahead of later values)
                op = rnd.choice(pending())
                send(rnd.choice(op.keys))
                trace.append(f"cancel {ops.index(op)} at once")
                assert op.task.cancel()
                model.fail(op, "cancelled")
            elif r < 0.9 and pending():
                # a receiver is cancelled and a value sent before its task ran
                op = rnd.choice(pending())
                trace.append(f"cancel {ops.index(op)}, then send")
                op.task.cancel()
                model.fail(op, "cancelled")
                send(rnd.choice(keys))
            else:
                chosen = [rnd.choice(keys) for _ in range(rnd.randint(1, 3))]
                op = start(chosen, True, timeout=0.001)
                if op.outcome == "pending":
                    # nothing is sent until it expired: it gives back what it took
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(op.task), 5)
                    model.fail(op, "timeout")
            await check()

        for op in pending():
            op.task.cancel()
            model.fail(op, "cancelled")
        await check()
        for k in keys:
            left = model.queued.get(k, [])
            if left:
                got = await end.recv_many([k] * len(left), timeout=5)
                assert [int(x[0]) for x in got] == left, f"seed {seed}: drain {k.name}\n" + "\n".join(trace)
            with pytest.raises(TimeoutError):
                await end.recv(k, timeout=0.01)


@pytest.mark.parametrize("target", ["rendezvous", "node"])
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.timeout(60)
@pytest.mark.loop_timeout(30)
async def test_the_table_behaves_as_the_model(seed: int, target: str) -> None:
    await run_model(seed, target)
