"""A synchronous user program on ``rvz.blocking``, checked with mypy --strict."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

import rvz
from rvz.blocking import BlockingNode, BlockingStep

if TYPE_CHECKING:
    from typing_extensions import assert_type

log = logging.getLogger(__name__)

SRC = "/job:worker/replica:0/task:0/device:CPU:0"
DST = "/job:ps/replica:0/task:0/device:CPU:0"


def producer(cluster: rvz.ClusterSpec, mode: rvz.Mode) -> None:
    key = rvz.Key(SRC, DST, "grad")
    with BlockingNode(cluster, "worker", 0, mode, loop="uvloop", heartbeat=0.5,
                      transport="tcp") as node:
        value: rvz.SendValue = np.arange(8, dtype=np.float32)
        node.send(key, value, timeout=5.0)
        node.send(str(key), b"raw", mode="send", step=0)
        node.send_many([(key, bytearray(b"x")), (key, np.float32(1.5))])
        step: BlockingStep = node.step(7)
        step.send(key, memoryview(b"y"))
        step.send_many([(key, b"z")], timeout=1.0)
        step.cleanup("done")
        name: str = node.transport_for(("ps", 0))
        log.info("%r %s %s %s %s", node, name, node.state, node.name, node.address)


def consumer(cluster: rvz.ClusterSpec) -> float:
    key = rvz.Key(SRC, DST, "grad")
    node = BlockingNode(cluster, job="ps", task=0, mode="recv", loop="asyncio",
                        claim_timeout=None)
    try:
        got = node.recv(key, timeout=5.0)
        if TYPE_CHECKING:
            assert_type(got, rvz.Value)
        more: list[rvz.Value] = node.recv_many([key, key], mode="recv")
        step = node.new_step()
        in_step: rvz.Value = step.recv(key)
        both: list[rvz.Value] = step.recv_many([key])
        node.cleanup_step(step.id, "finished")
        stats = node.stats()
        waiting = sum(s["waiting_recvs"] for s in stats["steps"].values())
        async_node: rvz.Node = node.node
        log.info("%s %s %s", async_node, node.loop, waiting)
        return float(len(more) + len(both)) + (len(in_step) if isinstance(in_step, bytes) else 0)
    except rvz.Aborted as exc:
        node.abort(exc)
        raise
    finally:
        node.close(timeout=2.0)


def main() -> None:
    cluster = rvz.ClusterSpec.loopback({"worker": 1, "ps": 1})
    try:
        env_node: BlockingNode = BlockingNode.from_env(mode="send", loop="auto", max_steps=64)
        env_node.close()
    except rvz.ConfigError:
        pass
    producer(cluster, "recv")
    log.info("%s", consumer(cluster))


if __name__ == "__main__":
    main()
