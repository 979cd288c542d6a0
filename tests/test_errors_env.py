"""The error hierarchy, ClusterSpec's checks, and bootstrapping from the environment
(``ClusterSpec.from_tf_config``, ``rvz.cluster.from_env``): every bad input is refused when
it is given, with a ``ConfigError`` that names what is wrong.  No network, no event loop.
"""

from __future__ import annotations

import inspect
import json
import logging
import random
import re
import socket
from typing import Any

import numpy as np
import pytest

import rvz
from rvz import errors
from rvz.cluster import from_env

from .conftest import in_loop

JOBS = {"worker": ["10.0.0.1:7000", "10.0.0.2:7000"], "ps": ["10.0.0.3:7000"]}
TF = {"cluster": JOBS, "task": {"type": "worker", "index": 1}}


def test_every_error_derives_from_rvz_error() -> None:
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, BaseException) and c.__module__ == errors.__name__]
    assert {c.__name__ for c in classes} >= {"ConfigError", "UnknownTask", "AuthError",
                                              "NodeClosed", "Aborted", "TransportError"}
    for cls in classes:
        assert issubclass(cls, rvz.RvzError), cls
        assert cls.__doc__, cls
        assert getattr(rvz, cls.__name__) is cls  # every error is public
    assert issubclass(rvz.ConfigError, ValueError)
    assert issubclass(rvz.UnknownTask, rvz.ConfigError) and issubclass(rvz.UnknownTask, KeyError)
    assert issubclass(rvz.NodeClosed, rvz.Aborted)
    assert issubclass(rvz.KeyFormatError, rvz.ConfigError) and issubclass(rvz.KeyFormatError, ValueError)


def test_unknown_task_reads_like_a_sentence() -> None:
    err = rvz.UnknownTask("the cluster has no job 'x'")
    assert str(err) == "the cluster has no job 'x'"  # not quoted, as a plain KeyError would be


def test_wrong_job_names_the_job_and_the_known_jobs() -> None:
    cluster = rvz.ClusterSpec(JOBS)
    with pytest.raises(rvz.ConfigError) as info:
        cluster.address("wrker", 0)
    assert "'wrker'" in str(info.value)
    assert "'worker'" in str(info.value) and "'ps'" in str(info.value)
    with pytest.raises(KeyError):  # code written for rvz 0.1 still catches it
        cluster.address("wrker", 0)
    with pytest.raises(rvz.ConfigError, match=r"/job:ps/task:3 .*has tasks 0\)"):
        cluster.address("ps", 3)


def test_node_with_a_wrong_job_is_refused_at_construction() -> None:
    cluster = rvz.ClusterSpec.loopback({"worker": 1, "ps": 1})
    with pytest.raises(rvz.ConfigError, match="wrker"):
        rvz.Node(cluster, job="wrker", task=0)
    with pytest.raises(rvz.ConfigError, match="task:5"):
        rvz.Node(cluster, job="ps", task=5)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("onesided, words", [
    ({"slot_budgt": 1}, ["slot_budgt", "unknown"]),
    ({"cqs": 0}, ["cqs"]),
    ({"max_slots": "many"}, ["many"]),
    (["tcp_max"], ["onesided"]),
])
def test_bad_onesided_options_are_refused_at_construction(transport: str, onesided: Any,
                                                           words: list[str]) -> None:
    # They passed Node(): with transport="shm" start() failed with a plain ValueError, and
    # with transport="tcp" a misspelt option was never noticed.
    cluster = rvz.ClusterSpec.loopback({"worker": 1})
    with pytest.raises(rvz.ConfigError) as info:
        rvz.Node(cluster, "worker", 0, transport=transport, onesided=onesided)
    for word in words:
        assert word in str(info.value), str(info.value)
    node = rvz.Node(cluster, "worker", 0, transport=transport, onesided={"slot_budget": 1 << 20})
    assert node.state == "new"


@pytest.mark.parametrize("jobs, words", [
    ({"worker": ["localhost"]}, ["/job:worker/task:0", "'localhost'", "host:port"]),
    ({"worker": ["h:99999"]}, ["port 99999"]),
    ({"worker": ["h:7x"]}, ["'h:7x'"]),
    ({"worker": [7000]}, ["7000", "host:port"]),
    ({"worker": "h:1"}, ["'worker'", "list"]),
    ({"a/b": ["h:1"]}, ["'a/b'", "job name"]),
    ({"": ["h:1"]}, ["job name"]),
    ({"worker": {"-1": "h:1"}}, ["'-1'", "task index"]),
    ({"worker": {"one": "h:1"}}, ["'one'"]),
    ({"worker": ["h:1"], "ps": ["h:1"]}, ["/job:worker/task:0", "/job:ps/task:0", "h:1"]),
    ({}, ["no jobs"]),
])
def test_bad_cluster_is_refused(jobs: Any, words: list[str]) -> None:
    with pytest.raises(rvz.ConfigError) as info:
        rvz.ClusterSpec(jobs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_cluster_forms() -> None:
    assert rvz.ClusterSpec({"w": {"1": "h:2", 0: "h:1"}}).as_dict() == {"w": {0: "h:1", 1: "h:2"}}
    assert rvz.ClusterSpec({"w": ["[::1]:7000"]}).address("w", 0) == "[::1]:7000"
    assert rvz.ClusterSpec(JOBS).jobs() == ["worker", "ps"]
    assert rvz.cluster.split_address("[::1]:7000") == ("::1", 7000)
    with pytest.raises(ValueError):  # ConfigError is a ValueError, as before
        rvz.cluster.split_address("nope")


# Synchronous, so run through in_loop: the checks hold on either loop and implementation.
@pytest.mark.parametrize("jobs, words", [
    ({"w": ["127.0.0.1:1", "127.0.0.1:01"]}, ["/job:w/task:1", "/job:w/task:0", "127.0.0.1:01",
                                              "'127.0.0.1:1'"]),
    ({"w": ["h:7000"], "ps": {"3": "H:07000"}}, ["/job:ps/task:3", "/job:w/task:0", "H:07000"]),
    ({"w": ["[::1]:7000", "[0:0::1]:7000"]}, ["/job:w/task:1", "/job:w/task:0", "[0:0::1]:7000"]),
    ({"w": ["h:1", "exa mple:1"]}, ["/job:w/task:1", "'exa mple:1'", "host name"]),
    ({"w": {"2": "exa\tmple:1"}}, ["/job:w/task:2", "'exa\\tmple:1'"]),
    ({"w": ["h/x:1"]}, ["/job:w/task:0", "'h/x:1'"]),
    ({"w": ["h:1", "::1:7000"]}, ["/job:w/task:1", "'::1:7000'", "'[::1]:7000'"]),
    ({"w": ["fe80::1:7000"]}, ["/job:w/task:0", "'fe80::1:7000'", "brackets"]),
    ({"w": ["[::1:7000"]}, ["/job:w/task:0", "'[::1:7000'"]),
    ({"w": ["[example]:7000"]}, ["/job:w/task:0", "'[example]:7000'", "IPv6"]),
    ({"w": ["[10.0.0.1]:7000"]}, ["/job:w/task:0", "'[10.0.0.1]:7000'", "IPv6"]),
])
@in_loop
def test_a_cluster_refuses_ambiguous_and_repeated_addresses(jobs: Any, words: list[str]) -> None:
    with pytest.raises(rvz.ConfigError) as info:
        rvz.ClusterSpec(jobs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@in_loop
def test_a_cluster_takes_host_names_ipv4_and_bracketed_ipv6() -> None:
    addresses = ["[::1]:7000", "host-1.example_x:7000", "10.0.0.1:7000", "[fe80::1%eth0]:7000",
                 "10.0.0.2:7000", "10.0.0.1:7001", "[::2]:7000", "LOCALHOST:7002"]
    assert rvz.ClusterSpec({"w": addresses}).as_dict() == {"w": dict(enumerate(addresses))}
    assert [rvz.cluster.split_address(a) for a in addresses[:4]] == [
        ("::1", 7000), ("host-1.example_x", 7000), ("10.0.0.1", 7000), ("fe80::1%eth0", 7000)]
    with pytest.raises(rvz.ConfigError, match="brackets"):
        rvz.cluster.split_address("::1:7000")


@pytest.mark.parametrize("task", [True, False, 1.0, "1", None])
@in_loop
def test_a_task_index_is_an_int(task: Any) -> None:
    # True and 1.0 hash like 1: a dict look-up alone would find task 1 for them.
    cluster = rvz.ClusterSpec({"w": ["h:1", "h:2"]})
    with pytest.raises(rvz.UnknownTask, match=re.escape(f"task:{task!r}")):
        cluster.address("w", task)
    assert cluster.address("w", np.int64(1)) == cluster.address("w", 1) == "h:2"


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    # The local end of every outgoing connection comes from the ephemeral range: a port
    # from there, free a moment ago, could be taken by a dial before the node binds it.
    spans = rvz.cluster._outside_ephemeral()
    ports = rvz.cluster.free_ports(40)
    assert len(set(ports)) == 40
    if spans:
        assert all(any(lo <= p <= hi for lo, hi in spans) for p in ports)
    else:
        print("no ephemeral port range to read here: free_ports falls back to bind(0)")
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_free_ports_draws_from_every_span_by_its_size() -> None:
    rng = random.Random(7)
    spans = [(10000, 10999), (20000, 20099)]
    drawn = [rvz.cluster._draw(spans, rng) for _ in range(5500)]
    assert all(10000 <= p <= 10999 or 20000 <= p <= 20099 for p in drawn)
    small = sum(p >= 20000 for p in drawn)
    assert 300 < small < 700  # 100 of 1100 ports: about 500 of 5500 draws
    assert min(drawn) == 10000 and max(drawn) == 20099


# -- TF_CONFIG ------------------------------------------------------------------------------


def test_from_tf_config_takes_a_dict_a_string_or_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    expected = rvz.ClusterSpec(JOBS).as_dict()
    assert rvz.ClusterSpec.from_tf_config(TF).as_dict() == expected
    assert rvz.ClusterSpec.from_tf_config(json.dumps(TF)).as_dict() == expected
    assert rvz.ClusterSpec.from_tf_config({"cluster": JOBS}).as_dict() == expected  # no task
    monkeypatch.setenv("TF_CONFIG", json.dumps(TF))
    assert rvz.ClusterSpec.from_tf_config().as_dict() == expected
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(rvz.ConfigError, match="TF_CONFIG is not set"):
        rvz.ClusterSpec.from_tf_config()


@pytest.mark.parametrize("value, words", [
    ("{not json", ["TF_CONFIG", "not valid JSON"]),
    ("[1, 2]", ["TF_CONFIG", "JSON object"]),
    ({"task": {"type": "worker", "index": 0}}, ["no \"cluster\""]),
    ({"cluster": {"worker": ["nohost"]}}, ["TF_CONFIG", "'nohost'"]),
    ({"cluster": JOBS, "task": {"type": "chief", "index": 0}}, ["'chief'", "'worker'", "'ps'"]),
    ({"cluster": JOBS, "task": {"type": "ps", "index": 2}}, ["/job:ps/task:2"]),
    ({"cluster": JOBS, "task": {"type": "ps", "index": "x"}}, ["'x'"]),
    ({"cluster": JOBS, "task": "worker"}, ["\"task\""]),
])
def test_bad_tf_config_is_refused(value: Any, words: list[str]) -> None:
    with pytest.raises(rvz.ConfigError) as info:
        rvz.ClusterSpec.from_tf_config(value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# -- from_env ---------------------------------------------------------------------------------


def test_from_env_reads_tf_config() -> None:
    cluster, job, task = from_env({"TF_CONFIG": json.dumps(TF)})
    assert (job, task) == ("worker", 1)
    assert cluster.as_dict() == rvz.ClusterSpec(JOBS).as_dict()


def test_from_env_reads_rvz_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RVZ_CLUSTER": json.dumps(JOBS), "RVZ_JOB": "ps", "RVZ_TASK": "0"}
    cluster, job, task = from_env(env)
    assert (job, task) == ("ps", 0) and cluster.address(job, task) == "10.0.0.3:7000"
    for name in ("TF_CONFIG", "RVZ_CLUSTER", "RVZ_JOB", "RVZ_TASK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert from_env()[1:] == ("ps", 0)  # os.environ by default


@pytest.mark.parametrize("env, words", [
    ({}, ["TF_CONFIG", "RVZ_CLUSTER"]),
    ({"TF_CONFIG": json.dumps({"cluster": JOBS})}, ["no \"task\""]),
    ({"TF_CONFIG": json.dumps(TF), "RVZ_JOB": "ps"}, ["TF_CONFIG", "RVZ_JOB", "only one"]),
    ({"RVZ_CLUSTER": json.dumps(JOBS), "RVZ_JOB": "ps"}, ["RVZ_TASK", "all three"]),
    ({"RVZ_CLUSTER": "{", "RVZ_JOB": "ps", "RVZ_TASK": "0"}, ["RVZ_CLUSTER", "not valid JSON"]),
    ({"RVZ_CLUSTER": json.dumps({"ps": ["x"]}), "RVZ_JOB": "ps", "RVZ_TASK": "0"},
     ["RVZ_CLUSTER", "'x'"]),
    ({"RVZ_CLUSTER": json.dumps(JOBS), "RVZ_JOB": "wrker", "RVZ_TASK": "0"},
     ["RVZ_JOB='wrker'", "'worker'"]),
    ({"RVZ_CLUSTER": json.dumps(JOBS), "RVZ_JOB": "ps", "RVZ_TASK": "first"},
     ["RVZ_TASK", "'first'"]),
    ({"RVZ_CLUSTER": json.dumps(JOBS), "RVZ_JOB": "ps", "RVZ_TASK": "1"}, ["/job:ps/task:1"]),
])
def test_bad_environment_is_refused(env: dict[str, str], words: list[str]) -> None:
    with pytest.raises(rvz.ConfigError) as info:
        from_env(env)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_node_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(rvz.Node, "from_env"):
        pytest.skip("rvz.Node.from_env is not there yet")
    cluster = rvz.ClusterSpec.loopback({"worker": 1, "ps": 1})
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("RVZ_CLUSTER", json.dumps({j: [cluster.address(j, 0)] for j in cluster.jobs()}))
    monkeypatch.setenv("RVZ_JOB", "ps")
    monkeypatch.setenv("RVZ_TASK", "0")
    node = rvz.Node.from_env(mode="send", linger=0.5)
    assert (node.job, node.task, node.mode, node.linger) == ("ps", 0, "send", 0.5)
    assert node.address == cluster.address("ps", 0)
    monkeypatch.setenv("RVZ_JOB", "wrker")
    with pytest.raises(rvz.ConfigError, match="wrker"):
        rvz.Node.from_env()


def test_the_rvz_logger_has_a_null_handler() -> None:
    handlers = logging.getLogger("rvz").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def test_free_ports_draws_from_the_spans_rvz_port_spans_gives(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("RVZ_PORT_SPANS", "41000-41099,42000-42009")
    ports = rvz.cluster.free_ports(20)
    assert len(set(ports)) == 20
    assert all(41000 <= p <= 41099 or 42000 <= p <= 42009 for p in ports), ports
    monkeypatch.setenv("RVZ_PORT_SPANS", "41000:41099")
    with pytest.raises(rvz.ConfigError, match="RVZ_PORT_SPANS"):
        rvz.cluster.free_ports(1)
