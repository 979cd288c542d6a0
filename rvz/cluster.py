"""ClusterSpec: which address each (job, task) listens on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` too) to ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"address {address!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


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
