"""Mistakes mypy --strict must catch in a program on ``rvz.blocking`` (each line marked
``# E: code`` is an error of that code; no other line is)."""

from __future__ import annotations

import rvz
from rvz.blocking import BlockingNode


def mistakes(cluster: rvz.ClusterSpec) -> None:
    BlockingNode(cluster, "ps", 0, "sned")  # E: call-overload
    BlockingNode(cluster, "ps", 0, loop="tokio")  # E: call-overload
    BlockingNode(cluster, "ps", 0, "recv", hartbeat=1.0)  # E: call-overload
    node = BlockingNode(cluster, "ps", 0, mode="recv", heartbeat=1.0)
    count: int = node.recv("k")  # E: assignment
    node.send("k", 3)  # E: arg-type
    node.step(1).recv("k", mode="rcv")  # E: call-overload
    node.close()
    print(count)
