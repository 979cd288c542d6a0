"""ClusterSpec: which address each (job, task) listens on."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` too) to ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"address {address!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago.

    For tests, examples and benchmarks on one machine: another process may still take a
    port between this call and the node's bind.
    """
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class ClusterSpec:
    """Maps job names to the ordered list of their tasks' ``host:port`` addresses."""

    def __init__(self, jobs: Mapping[str, Sequence[str] | Mapping[int, str]]) -> None:
        self._jobs: dict[str, dict[int, str]] = {}
        for job, tasks in jobs.items():
            if isinstance(tasks, Mapping):
                table = {int(t): str(a) for t, a in tasks.items()}
            else:
                table = dict(enumerate(str(a) for a in tasks))
            for address in table.values():
                split_address(address)
            self._jobs[str(job)] = table

    @classmethod
    def loopback(cls, tasks: Mapping[str, int], host: str = "127.0.0.1") -> ClusterSpec:
        """A cluster on this machine: ``{"worker": 2, "ps": 1}`` gets free ports on ``host``."""
        ports = iter(free_ports(sum(tasks.values()), host))
        return cls({job: [f"{host}:{next(ports)}" for _ in range(n)] for job, n in tasks.items()})

    def address(self, job: str, task: int) -> str:
        try:
            return self._jobs[job][task]
        except KeyError:
            raise KeyError(f"the cluster has no task /job:{job}/task:{task} "
                           f"(jobs: {self.as_dict()})") from None

    def tasks(self) -> list[tuple[str, int]]:
        return [(job, task) for job, tasks in self._jobs.items() for task in tasks]

    def as_dict(self) -> dict[str, dict[int, str]]:
        return {job: dict(tasks) for job, tasks in self._jobs.items()}

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"
