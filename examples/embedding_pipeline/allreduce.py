"""Ring all-reduce (sum) of one float32 vector across the worker tasks, over rvz keys.

The vector is cut into N chunks. Reduce-scatter: in round r worker w sends chunk (w - r) to
its right neighbour and adds the chunk (w - r - 1) it gets from its left one; after N - 1
rounds worker w holds the complete sum of chunk (w + 1). All-gather: N - 1 more rounds pass
the complete chunks around the ring. Each worker sends and receives 2 (N - 1) / N of the
vector, and there is no coordinator and no lock.

Every complete chunk is summed by one worker and then copied, so all workers end with the
very same bits, and the order of the additions is fixed by the ring: two runs give
identical results. (With 2 workers each chunk is one addition, a + b = b + a exactly, so the
result is also bit-identical to ``g0 + g1``.)

All keys of one all-reduce run in the training step's rvz step: if any worker cleans the
step up, everyone waiting in it gets ``rvz.Aborted`` naming the step; a lost worker shows up
as ``rvz.PeerLost`` (its ``peer`` attribute: the task) and a silent one as ``TimeoutError``
(every wait is bounded). ``epoch`` (the keys' frame) keeps the rings with different processes
of a task apart (rejoin.py).
"""

from __future__ import annotations

import numpy as np

import rvz


def worker_device(job: str, task: int) -> str:
    return f"/job:{job}/replica:0/task:{task}/device:CPU:0"


async def ring_allreduce(node: rvz.Node, vector: np.ndarray, num_workers: int, *, step: int,
                         tag: int, timeout: float | None, epoch: int = 0) -> np.ndarray:
    """The element-wise sum of ``vector`` over the ``num_workers`` tasks of ``node.job``
    (``node.task`` is this one). ``step`` is the rvz step; ``tag`` (the training step)
    makes the keys unique."""
    n = num_workers
    if n == 1:
        return vector
    w = node.task
    job = node.job
    right, left = (w + 1) % n, (w - 1) % n
    me, to_right, from_left = worker_device(job, w), worker_device(job, right), worker_device(job, left)
    chunks = list(np.array_split(np.array(vector, dtype=np.float32), n))
    view = node.step(step)

    def out_key(phase: str, r: int) -> rvz.Key:
        return rvz.Key(src=me, dst=to_right, name=f"allreduce_{phase}{r}", frame=epoch, iter=tag)

    def in_key(phase: str, r: int) -> rvz.Key:
        return rvz.Key(src=from_left, dst=me, name=f"allreduce_{phase}{r}", frame=epoch, iter=tag)

    # A chunk is never written in place after it was sent (rvz does not copy sent arrays):
    # a received partial sum makes a new array.
    async def send(key: rvz.Key, value: np.ndarray) -> None:
        try:
            await view.send(key, value, timeout=timeout)
        except rvz.PeerLost as exc:
            exc.peer = right  # type: ignore[attr-defined]
            raise

    async def recv(key: rvz.Key) -> np.ndarray:
        try:
            got: np.ndarray = await view.recv(key, timeout=timeout)
        except rvz.PeerLost as exc:
            exc.peer = left  # type: ignore[attr-defined]
            raise
        return got

    for r in range(n - 1):
        await send(out_key("rs", r), chunks[(w - r) % n])
        got = await recv(in_key("rs", r))
        c = (w - r - 1) % n
        chunks[c] = got + chunks[c]
    for r in range(n - 1):
        await send(out_key("ag", r), chunks[(w + 1 - r) % n])
        chunks[(w - r) % n] = await recv(in_key("ag", r))
    return np.concatenate(chunks)
