"""ClusterSpec: which address each (job, task) listens on, and where a process learns its
own place in the cluster (``TF_CONFIG``, or ``RVZ_CLUSTER``/``RVZ_JOB``/``RVZ_TASK``).

Everything here checks its input when it is built and raises ``rvz.ConfigError`` naming
what is wrong, so a typo in a job name fails at start-up, not at the first send.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import socket
import string
from collections.abc import Mapping, Sequence
from typing import Any

from . import _impl
from .errors import ConfigError, UnknownTask

_keys = _impl.keys

__all__ = ["ClusterSpec", "free_ports", "from_env", "split_address"]

TF_CONFIG = "TF_CONFIG"
RVZ_CLUSTER = "RVZ_CLUSTER"
RVZ_JOB = "RVZ_JOB"
RVZ_TASK = "RVZ_TASK"

# A job name becomes part of device names ("/job:NAME/replica:0/task:0") and of key
# strings (';'-separated), so these characters would make it unparsable.
_JOB_FORBIDDEN = frozenset("/:; \t\r\n")

# A host name or IPv4 address: RFC 1123's letters, digits, '-' and '.', and '_' (which DNS
# carries and container names use).  An IPv6 address is written in brackets.
_HOST_CHARS = frozenset(string.ascii_letters + string.digits + "-._")


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` too) to ``(host, port)``; ``ConfigError`` if not."""
    if not isinstance(address, str):
        raise ConfigError(f"address {address!r} is not a 'host:port' string")
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not port.isascii() or not host:
        raise ConfigError(f"address {address!r} is not host:port")
    if int(port) > 65535:
        raise ConfigError(f"address {address!r}: port {port} is not in 0..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"address {address!r}: {host!r} in brackets is not an IPv6 "
                              "address") from None
    elif ":" in host:
        # "::1:7000" could be port 7000 of ::1 or the address ::1:7000 with no port.
        raise ConfigError(f"address {address!r}: an IPv6 address takes brackets, as in "
                          f"'[{host}]:{port}'")
    elif not _HOST_CHARS.issuperset(host):
        raise ConfigError(f"address {address!r}: {host!r} is not a host name or IPv4 address")
    return host, int(port)


def _endpoint(host: str, port: int) -> tuple[str, int]:
    """What two spellings of one address share: "H:01" is "h:1", "[::0:1]:1" is "[::1]:1"."""
    try:
        return ipaddress.ip_address(host).compressed, port
    except ValueError:  # a host name: DNS names are case-insensitive
        return host.lower(), port


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago.

    For tests, examples and benchmarks on one machine: another process may still take a
    port between this call and the node's bind.  So the ports are drawn at random from
    outside the kernel's ephemeral range where it can be read: the local end of every
    outgoing connection (each dial, each test's client) comes from that range, and so did
    a port the OS handed out for ``bind((host, 0))``, to the next such connection to take.
    """
    rng = random.SystemRandom()
    spans = _outside_ephemeral()
    socks: list[socket.socket] = []
    try:
        draws = 64 * n if spans else 0
        while len(socks) < n:
            s = socket.socket()
            socks.append(s)
            if draws:
                draws -= 1
                try:
                    s.bind((host, _draw(spans, rng)))
                except OSError:  # in use, or held by TIME_WAIT: draw again
                    socks.pop().close()
                continue
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _outside_ephemeral() -> list[tuple[int, int]]:
    """The port spans from 10000 up that lie outside the ephemeral range (Linux); [] where
    that range cannot be read.  ``RVZ_PORT_SPANS`` (``"LO-HI,LO-HI"``) gives them instead:
    the ports a firewall opens, or a share of them that no other process draws from."""
    given = os.environ.get("RVZ_PORT_SPANS")
    if given:
        try:
            return [(int(lo), int(hi)) for lo, hi in (span.split("-") for span in given.split(","))]
        except ValueError:
            raise ConfigError(f"RVZ_PORT_SPANS={given!r}: want LO-HI[,LO-HI...]") from None
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first, last = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return []
    return [(lo, hi) for lo, hi in ((10000, first - 1), (last + 1, 65535)) if hi - lo >= 1000]


def _draw(spans: list[tuple[int, int]], rng: random.Random) -> int:
    """A port drawn uniformly from ``spans`` (inclusive ranges)."""
    r = rng.randrange(sum(hi - lo + 1 for lo, hi in spans))
    for lo, hi in spans:
        if r <= hi - lo:
            return lo + r
        r -= hi - lo + 1
    raise AssertionError("unreachable")


def _task_index(value: object, where: str) -> int:
    """A task index: a non-negative int, or its decimal string (JSON object keys)."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: task index {value!r} is not a number")
    if isinstance(value, int):
        index = value
    elif isinstance(value, str) and value.isascii() and value.isdigit():
        index = int(value)
    else:
        raise ConfigError(f"{where}: task index {value!r} is not a non-negative integer")
    if index < 0:
        raise ConfigError(f"{where}: task index {index} is negative")
    return index


def _check_job(job: object, where: str) -> str:
    if not isinstance(job, str) or not job or _JOB_FORBIDDEN.intersection(job):
        raise ConfigError(f"{where}: job name {job!r} must be a non-empty string without "
                          "'/', ':', ';' or whitespace")
    return job


class ClusterSpec:
    """Maps job names to their tasks' ``host:port`` addresses.

    ``ClusterSpec({"worker": ["10.0.0.1:7000", "10.0.0.2:7000"], "ps": ["10.0.0.3:7000"]})``
    lists each job's tasks in order (task 0 first); a mapping ``{task: address}`` per job
    gives sparse task indices.  A malformed job name, task index or address, or two tasks
    on one address, raise ``rvz.ConfigError``.
    """

    def __init__(self, jobs: Mapping[str, Sequence[str] | Mapping[int, str]]) -> None:
        if not isinstance(jobs, Mapping):
            raise ConfigError(f"a cluster is a mapping of job name to addresses, not "
                              f"{type(jobs).__name__}")
        if not jobs:
            raise ConfigError("the cluster has no jobs")
        self._jobs: dict[str, dict[int, str]] = {}
        seen: dict[tuple[str, int], tuple[str, str]] = {}  # endpoint -> (task, address)
        for job, tasks in jobs.items():
            _check_job(job, "cluster")
            table: dict[int, str] = {}
            if isinstance(tasks, Mapping):
                for t, address in tasks.items():
                    table[_task_index(t, f"cluster job {job!r}")] = address
            elif isinstance(tasks, Sequence) and not isinstance(tasks, (str, bytes)):
                table = dict(enumerate(tasks))
            else:
                raise ConfigError(f"cluster job {job!r}: tasks must be a list of 'host:port' "
                                  f"addresses or a mapping of task index to address, not {tasks!r}")
            for index, address in table.items():
                where = f"/job:{job}/task:{index}"
                try:
                    endpoint = _endpoint(*split_address(address))
                except ConfigError as exc:
                    raise ConfigError(f"cluster {where}: {exc}") from None
                if endpoint in seen:
                    other, spelled = seen[endpoint]
                    also = "" if spelled == address else f" (written {spelled!r} there)"
                    raise ConfigError(f"cluster {where} and {other} share the address "
                                      f"{address}{also}")
                seen[endpoint] = (where, address)
            self._jobs[job] = dict(sorted(table.items()))

    @classmethod
    def loopback(cls, tasks: Mapping[str, int], host: str = "127.0.0.1") -> ClusterSpec:
        """A cluster on this machine: ``{"worker": 2, "ps": 1}`` gets free ports on ``host``.

        For tests, examples and benchmarks: the ports were free when this was called.
        """
        ports = iter(free_ports(sum(tasks.values()), host))
        return cls({job: [f"{host}:{next(ports)}" for _ in range(n)] for job, n in tasks.items()})

    @classmethod
    def from_tf_config(cls, value: str | Mapping[str, Any] | None = None) -> ClusterSpec:
        """The cluster of a TensorFlow ``TF_CONFIG``: a JSON string or the parsed dict.

        With ``value=None`` the ``TF_CONFIG`` environment variable is read.  Its
        ``"cluster"`` maps job names to address lists; its ``"task"`` (``{"type": job,
        "index": n}``), when present, must name a task of that cluster.  Anything else
        raises ``rvz.ConfigError`` saying what is wrong.  ``rvz.cluster.from_env()`` also
        returns this process's job and task.
        """
        cluster, _ = _parse_tf_config(value)
        return cluster

    def address(self, job: str, task: int) -> str:
        """The ``host:port`` of ``/job:{job}/task:{task}``.

        Raises ``rvz.UnknownTask`` (a ``ConfigError`` and a ``KeyError``) naming the known
        jobs or tasks when there is no such task.
        """
        tasks = self._jobs.get(job)
        if tasks is None:
            raise UnknownTask(f"the cluster has no job {job!r} (jobs: "
                              f"{', '.join(map(repr, self._jobs))})")
        try:
            # numpy's ints too; True and False would find tasks 1 and 0, 1.0 or "1" task 1
            index = _keys.as_index(task)
            if index is None:
                raise KeyError(task)
            return tasks[index]
        except KeyError:
            known = ", ".join(map(str, tasks)) or "none"
            raise UnknownTask(f"the cluster has no task /job:{job}/task:{task!r} (job {job!r} "
                              f"has tasks {known})") from None

    def jobs(self) -> list[str]:
        """The job names, in the order they were given."""
        return list(self._jobs)

    def tasks(self) -> list[tuple[str, int]]:
        """Every ``(job, task)`` of the cluster."""
        return [(job, task) for job, tasks in self._jobs.items() for task in tasks]

    def as_dict(self) -> dict[str, dict[int, str]]:
        """A copy of the cluster as ``{job: {task: address}}``."""
        return {job: dict(tasks) for job, tasks in self._jobs.items()}

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def _load_json(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{name} is not valid JSON ({exc}): {text[:200]!r}") from None


def _parse_tf_config(value: str | Mapping[str, Any] | None
                     ) -> tuple[ClusterSpec, tuple[str, int] | None]:
    """The cluster of a TF_CONFIG and, when it names one, its (job, task)."""
    name = "TF_CONFIG"
    if value is None:
        value = os.environ.get(TF_CONFIG)
        if not value:
            raise ConfigError("TF_CONFIG is not set (or empty): nothing to read the cluster from")
    if isinstance(value, str):
        value = _load_json(value, name)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a JSON object with a \"cluster\", not {value!r}")
    jobs = value.get("cluster")
    if not isinstance(jobs, Mapping) or not jobs:
        raise ConfigError(f"{name} has no \"cluster\" mapping job names to address lists: "
                          f"{dict(value)!r}")
    try:
        cluster = ClusterSpec(jobs)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    task = value.get("task")
    if task is None or task == {}:
        return cluster, None
    if not isinstance(task, Mapping) or "type" not in task:
        raise ConfigError(f"{name} \"task\" must be {{\"type\": job, \"index\": n}}, not {task!r}")
    job = task["type"]
    index = _task_index(task.get("index", 0), f"{name} task")
    if not isinstance(job, str) or job not in cluster.jobs():
        raise ConfigError(f"{name} task type {job!r} is not a job of its cluster (jobs: "
                          f"{', '.join(map(repr, cluster.jobs()))})")
    try:
        cluster.address(job, index)
    except UnknownTask as exc:
        raise ConfigError(f"{name} task: {exc}") from None
    return cluster, (job, index)


def from_env(environ: Mapping[str, str] | None = None) -> tuple[ClusterSpec, str, int]:
    """``(cluster, job, task)`` of this process, from its environment.

    Either ``TF_CONFIG`` (TensorFlow's JSON: ``{"cluster": {...}, "task": {"type": job,
    "index": n}}``), or all three of ``RVZ_CLUSTER`` (JSON, as given to ``ClusterSpec``),
    ``RVZ_JOB`` and ``RVZ_TASK``.  Setting both kinds is refused, as is a job or task the
    cluster does not have: ``rvz.ConfigError`` says which variable is wrong.
    ``environ`` defaults to ``os.environ``.
    """
    env = os.environ if environ is None else environ
    tf_config = env.get(TF_CONFIG)
    ours = [name for name in (RVZ_CLUSTER, RVZ_JOB, RVZ_TASK) if env.get(name)]
    if tf_config:
        if ours:
            raise ConfigError(f"both TF_CONFIG and {', '.join(ours)} are set: set only one kind")
        cluster, me = _parse_tf_config(tf_config)
        if me is None:
            raise ConfigError("TF_CONFIG has no \"task\": {\"type\": job, \"index\": n} saying "
                              "which task this process is")
        return cluster, me[0], me[1]
    if not ours:
        raise ConfigError("neither TF_CONFIG nor RVZ_CLUSTER, RVZ_JOB and RVZ_TASK are set")
    missing = [name for name in (RVZ_CLUSTER, RVZ_JOB, RVZ_TASK) if not env.get(name)]
    if missing:
        raise ConfigError(f"{', '.join(ours)} set but {', '.join(missing)} not: set all three")
    jobs = _load_json(env[RVZ_CLUSTER], RVZ_CLUSTER)
    try:
        cluster = ClusterSpec(jobs)
    except ConfigError as exc:
        raise ConfigError(f"RVZ_CLUSTER: {exc}") from None
    job = env[RVZ_JOB]
    task = _task_index(env[RVZ_TASK].strip(), "RVZ_TASK")
    try:
        cluster.address(job, task)
    except UnknownTask as exc:
        raise ConfigError(f"RVZ_JOB={job!r} RVZ_TASK={task}: {exc}") from None
    return cluster, job, task
