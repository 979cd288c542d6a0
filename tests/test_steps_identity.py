"""Steps and identities: random step ids that survive restarts, dead steps that die with the
process that made them, a per-peer share of ``max_steps``, what a replaced incarnation
leaves behind, a real process taken back after an impostor left, certificates that name
their task, and log lines that sum up events which repeat."""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rvz
import rvz.handshake
import rvz.heartbeat
from rvz import _impl

from .conftest import FAST, eventually, key, pair
from .hostile import Hostile, data_frame, key_text
from .test_auth_tls import _make_ca, _make_cert, client_ctx, server_ctx

codec = _impl.codec
SECRET = "identity-test-secret-0123"
W0 = ("worker", 0)
W1 = ("worker", 1)
PS0 = ("ps", 0)


def three_tasks() -> rvz.ClusterSpec:
    """worker:0 and ps:0 (the real pair) and worker:1 (a raw client or a third node)."""
    return rvz.ClusterSpec.loopback({"worker": 2, "ps": 1})


async def gave_up_on(node: rvz.Node, task: tuple[str, int]) -> None:
    """Wait until ``node`` has found ``task``'s process gone: its reconnect was refused
    (a restart takes longer than that, and a recv issued before it could fail with it)."""
    peer = node._core.peers[task]
    await eventually(lambda: not peer.live_connections() and not node._dialling(peer),
                     f"{node.name} gave up on {task}")


# -- step ids ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["recv", "send"])
def test_new_step_ids_are_random_64_bit_and_usable(run, cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        async with pair(cluster, mode) as (w, p):
            ids = {w.new_step().id for _ in range(1000)}
            assert len(ids) == 1000 and all(0 < i < 1 << 64 for i in ids)
            assert max(ids) > 1 << 48  # not a counter
            step = w.new_step()
            await step.send(key("s"), np.arange(3))
            got = await p.step(step.id).recv(key("s"), timeout=5)
            assert got.tolist() == [0, 1, 2]

    run(body(), timeout=20)


@pytest.mark.parametrize("mode", ["recv", "send"])
def test_a_restarted_process_counting_steps_from_1_is_not_aborted_by_its_old_self(
        run, cluster, mode) -> None:  # type: ignore[no-untyped-def]
    """The old process cleaned up step 1 and died; its next incarnation counts from 1 again.
    The other node forgets the dead steps only that process took part in, once it meets the
    new one; the error on the dead step named the incarnation that cleaned it up."""
    async def body() -> None:
        async with rvz.Node(cluster, "ps", 0, mode, **FAST) as p:
            old = rvz.Node(cluster, "worker", 0, mode, **FAST)
            await old.start()
            await old.step(1).send(key("req"), np.arange(2))
            assert (await p.step(1).recv(key("req"), timeout=5)).tolist() == [0, 1]
            await old.step(1).cleanup("HTTP request 1 timed out")
            await eventually(lambda: 1 in p._core.steps.dead_steps, "the clean-up reached ps")
            with pytest.raises(rvz.Aborted) as info:
                await p.step(1).recv(key("req"), timeout=5)
            assert f"(incarnation {old.incarnation:#x})" in str(info.value), str(info.value)
            old.abort()  # kill -9
            await gave_up_on(p, ("worker", 0))
            async with rvz.Node(cluster, "worker", 0, mode, **FAST) as new:
                assert new.incarnation != old.incarnation
                await new.send(key("hello"), np.arange(1))  # it connects: ps meets it
                assert (await p.recv(key("hello"), timeout=5)).tolist() == [0]
                await eventually(lambda: 1 not in p._core.steps.dead_steps,
                                 "the old incarnation's dead step was forgotten")
                await new.step(1).send(key("req"), np.arange(4))
                assert (await p.step(1).recv(key("req"), timeout=5)).tolist() == [0, 1, 2, 3]

    run(body(), timeout=30)


def test_a_dead_step_another_live_peer_took_part_in_stays_dead(run) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        async with rvz.Node(cluster, "ps", 0, "send", **FAST) as p, \
                rvz.Node(cluster, "worker", 1, "send", **FAST) as third:
            old = rvz.Node(cluster, "worker", 0, "send", **FAST)
            await old.start()
            other = key("b", src=third.name + "/device:CPU:0")
            await old.step(1).send(key("a"), np.arange(2))
            await third.step(1).send(other, np.arange(2))
            assert (await p.step(1).recv(key("a"), timeout=5)).tolist() == [0, 1]
            assert (await p.step(1).recv(other, timeout=5)).tolist() == [0, 1]
            await old.step(1).cleanup()
            await eventually(lambda: 1 in p._core.steps.dead_steps, "the clean-up reached ps")
            old.abort()
            await gave_up_on(p, ("worker", 0))
            async with rvz.Node(cluster, "worker", 0, "send", **FAST) as new:
                await new.send(key("hello"), np.arange(1))
                assert (await p.recv(key("hello"), timeout=5)).tolist() == [0]
                assert p._core.peers[("worker", 0)].incarnation == new.incarnation
                assert 1 in p._core.steps.dead_steps  # worker:1 took part: a late frame of it stays out

    run(body(), timeout=30)


# -- max_steps per peer --------------------------------------------------------------------------


async def open_steps(address: str, count: int) -> list[Any]:
    """A raw worker:1 pushes a value on each of ``count`` new steps until it is closed; the
    frames the node sent it."""
    k = key_text("stepper", W1, PS0)
    h = await Hostile.connect(address)
    try:
        await h.hello("worker", 1)
        await h.flood(data_frame(s, 0, k, b"x") for s in range(1, count))
        return list(await h.events_until_closed(10))
    finally:
        h.close()


def test_a_peer_past_its_share_of_max_steps_is_closed_and_no_other_peer_is(run) -> None:  # type: ignore[no-untyped-def]
    """max_steps=200 over two other tasks: a share of 100 each.  The hostile worker:1 opens
    steps until it is closed; worker:0 then pushes on a new step and its value arrives."""
    async def body() -> None:
        cluster = three_tasks()
        async with pair(cluster, "send", ps={"max_steps": 200, "step_idle": None}) as (w, p):
            await open_steps(p.address, 400)
            assert 90 <= len(p.stats()["steps"]) <= 101, len(p.stats()["steps"])
            await w.step(5000).send(key("legit"), np.arange(3))
            assert (await p.step(5000).recv(key("legit"), timeout=5)).tolist() == [0, 1, 2]
            await w.step(5001).send(key("legit"), np.arange(2))
            assert (await p.step(5001).recv(key("legit"), timeout=5)).tolist() == [0, 1]
            assert p._core.steps.step_share == 100

    run(body(), timeout=30)


def test_the_step_share_error_names_the_bound(run, caplog) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        cluster = three_tasks()
        async with pair(cluster, "send", ps={"max_steps": 20, "step_idle": None}) as (w, p):
            with caplog.at_level(logging.DEBUG, logger="rvz"):
                events = await open_steps(p.address, 40)
            errors = [e for e in events if e[0] == codec.ERROR]
            said = " ".join(str(e[1]) for e in errors) + " ".join(r.getMessage() for r in caplog.records)
            assert "share of 10 steps" in said and "max_steps 20" in said, said

    run(body(), timeout=30)


# -- what an old incarnation leaves behind --------------------------------------------------------


def _count(kind: str) -> int:
    return sum(1 for o in gc.get_objects() if type(o).__name__ == kind)


def test_new_incarnations_leave_nothing_of_the_old_ones_behind(run) -> None:  # type: ignore[no-untyped-def]
    """60 reconnects, each a new incarnation that pushes a value on a step of its own and
    leaves: the node's connections, decoders, tables and per-peer entries stay bounded."""
    async def body() -> None:
        cluster = three_tasks()
        async with rvz.Node(cluster, "ps", 0, "send", **FAST) as p:
            k = key_text("v", W1, PS0)

            async def one(incarnation: int) -> None:
                h = await Hostile.connect(p.address)
                try:
                    await h.hello("worker", 1, incarnation)
                    await h.send(data_frame(incarnation, 0, k, np.zeros(4096)))
                    await h.send(data_frame(0, 0, k, np.zeros(4096)))
                    await eventually(lambda: p._core.peers[W1].incarnation == incarnation,
                                     "the new incarnation was taken")
                finally:
                    h.close()

            for inc in range(1, 11):
                await one(inc)
            gc.collect()
            before = {kind: _count(kind) for kind in ("Connection", "Decoder", "Table")}
            for inc in range(11, 71):
                await one(inc)
            await eventually(lambda: not any(c.peer is p._core.peers[W1] and not c.closed
                                             for c in p._conns), "the last one closed")
            # The replaced incarnations' values went; their steps' empty tables follow.
            await eventually(lambda: len(p._core.steps.tables) <= 2, "the old steps' tables dropped",
                             within=10)
            gc.collect()
            after = {kind: _count(kind) for kind in ("Connection", "Decoder", "Table")}
            for kind in before:
                assert after[kind] <= before[kind] + 3, (kind, before, after)
            assert len(p._handshake.replaced_of(W1)) <= rvz.handshake.REPLACED_KEPT
            assert p.stats()["steps"].get(0, {}).get("queued_values", 0) == 1  # the last one's

    run(body(), timeout=60)


# -- a claimed identity ---------------------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_the_real_process_is_taken_back_once_an_impostor_left(run, secret) -> None:  # type: ignore[no-untyped-def]
    """An impostor claims worker:0 with a new incarnation and leaves; the real worker:0,
    alive all along, is refused while the impostor is connected and taken back after."""
    async def body() -> None:
        cluster = three_tasks()
        async with pair(cluster, "send", secret=secret, claim_timeout=None) as (w, p):
            await w.send(key("before"), np.arange(2))
            assert (await p.recv(key("before"), timeout=5)).tolist() == [0, 1]
            h = await Hostile.connect(p.address)
            try:
                await h.hello("worker", 0, 0xBAD, secret=secret)
                await eventually(lambda: p._core.peers[W0].incarnation == 0xBAD,
                                 "the impostor replaced worker:0")
            finally:
                h.close()
            # (The real worker:0, whose connection the impostor's replaced, dials again
            # by itself: it may already be back.)
            await eventually(lambda: not any(
                getattr(getattr(c, "hello", None), "incarnation", None) == 0xBAD
                for c in p._core.peers[W0].live_connections()), "impostor gone")
            got = None
            loop = asyncio.get_running_loop()
            end = loop.time() + 15
            while got is None:
                try:
                    await w.send(key("after"), np.arange(3), timeout=5)
                    got = await p.recv(key("after"), timeout=5)
                except (rvz.PeerLost, rvz.AuthError, TimeoutError):
                    assert loop.time() < end, "the real worker:0 stays locked out"
                    await asyncio.sleep(0.1)
            assert got.tolist() == [0, 1, 2]
            assert p._core.peers[W0].incarnation == w.incarnation

    run(body(), timeout=40)


def test_a_process_refused_again_and_again_logs_it_in_sum(run, caplog) -> None:  # type: ignore[no-untyped-def]
    """While an impostor holds worker:0's identity, each try of the real worker:0 is
    refused; both sides say so in one line and a count, not a line per try."""
    async def body() -> None:
        cluster = three_tasks()
        async with pair(cluster, "send", claim_timeout=None) as (w, p):
            await w.send(key("before"), np.arange(2))
            assert (await p.recv(key("before"), timeout=5)).tolist() == [0, 1]
            h = await Hostile.connect(p.address)
            try:
                await h.hello("worker", 0, 0xBAD)
                await eventually(lambda: p._core.peers[W0].incarnation == 0xBAD,
                                 "the impostor replaced worker:0")
                with caplog.at_level(logging.WARNING, logger="rvz"):
                    for _ in range(20):  # each dials again and is refused
                        try:
                            await w.send(key("refused"), np.arange(1), timeout=5)
                            await asyncio.sleep(0.05)  # the refusal comes after the push
                        except (rvz.PeerLost, rvz.AuthError):
                            pass
                    await eventually(lambda: sum("two processes run as" in r.getMessage()
                                                 for r in caplog.records) >= 1, "a refusal")
            finally:
                h.close()
            said = [r.getMessage() for r in caplog.records if "two processes run as" in r.getMessage()]
            on_w = [line for line in said if line.startswith(w.name)]
            on_p = [line for line in said if line.startswith(p.name)]
            assert 1 <= len(on_w) <= 2 and 1 <= len(on_p) <= 2, said
            # ... while many more were counted, to be said in the next summary line
            counted = w._repeats.counted.get(f"refused by {p.name}", [0])[0]
            assert counted + len(on_w) >= 5, (counted, said)

    run(body(), timeout=60)


# -- certificates that name their task -------------------------------------------------------


@pytest.fixture(scope="module")
def task_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import shutil
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: cannot make test certificates")
    d = tmp_path_factory.mktemp("task-certs")
    _make_ca(d, "ca")
    for name in ("worker-0", "worker-1", "ps-0"):
        _make_cert(d, name, "ca")
    return d


def _tls(d: Path, cert: str) -> Any:
    return server_ctx(d, cert=cert), client_ctx(d, cert=cert)


def test_tls_identity_binds_the_task_to_the_certificate(run, task_certs) -> None:  # type: ignore[no-untyped-def]
    """With tls_identity, a member whose certificate names worker-1 cannot claim worker:0;
    the real worker:0, whose certificate names it, talks."""
    async def body() -> None:
        cluster = three_tasks()
        options = {**FAST, "tls_identity": True, "connect_timeout": 2.0}
        async with rvz.Node(cluster, "ps", 0, "send", ssl=_tls(task_certs, "ps-0"), **options) as p:
            async with rvz.Node(cluster, "worker", 0, "send", ssl=_tls(task_certs, "worker-1"),
                                **options) as liar:
                try:  # without a secret the dialler takes the listener's HELLO at once:
                    await liar.send(key("x"), np.arange(2), timeout=10)  # the push may leave
                except (rvz.AuthError, rvz.PeerLost):
                    pass
                # ps never takes it (its recv dials worker:0, and refuses that certificate too)
                with pytest.raises((TimeoutError, rvz.AuthError, rvz.PeerLost)):
                    await p.recv(key("x"), timeout=1.0)
            assert p._core.peers[W0].incarnation is None  # never taken
            async with rvz.Node(cluster, "worker", 0, "send", ssl=_tls(task_certs, "worker-0"),
                                **options) as w:
                await w.send(key("y"), np.arange(2))
                assert (await p.recv(key("y"), timeout=5)).tolist() == [0, 1]

    run(body(), timeout=40)


def test_tls_identity_needs_mutual_tls(task_certs) -> None:  # type: ignore[no-untyped-def]
    cluster = three_tasks()
    with pytest.raises(rvz.ConfigError, match="tls_identity needs mutual TLS"):
        rvz.Node(cluster, "ps", 0, tls_identity=True)
    with pytest.raises(rvz.ConfigError, match="tls_identity needs mutual TLS"):
        rvz.Node(cluster, "ps", 0, tls_identity=True,
                 ssl=(server_ctx(task_certs, cert="ps-0", require=False),
                      client_ctx(task_certs, cert="ps-0")))
    assert rvz.handshake.certificate_names("worker", 2) == {"/job:worker/task:2", "worker-2"}


# -- logs that sum up -----------------------------------------------------------------------------


def test_steps_expiring_together_are_logged_in_two_lines(run, caplog) -> None:  # type: ignore[no-untyped-def]
    """300 idle steps that held a value each: one line per heartbeat that expires some (the
    first step with its detail, the others counted), not one per step."""
    async def body() -> None:
        cluster = three_tasks()
        async with pair(cluster, "send", ps={"step_idle": 1.0}) as (w, p):
            with caplog.at_level(logging.INFO, logger="rvz"):
                for step in range(1, 301):
                    await w.step(step).send(key("idle"), np.arange(1))
                await eventually(lambda: len(p._core.steps.tables) >= 300, "300 steps hold a value")
                await eventually(lambda: len(p._core.steps.tables) <= 1, "the idle steps expired",
                                 within=15)
            lines = [r.getMessage() for r in caplog.records if "expired" in r.getMessage()]
            assert len(lines) <= 20, lines[:30]
            assert "dropped 1 value(s) of 1 key(s)" in lines[0], lines
            firsts = [line for line in lines if "more step(s) expired" not in line]
            more = [int(line.split(": ", 1)[1].split()[0]) for line in lines if line not in firsts]
            assert more and len(firsts) + sum(more) == 300, lines

    run(body(), timeout=30)


def test_refused_connections_are_logged_once_per_interval_with_a_count(run, caplog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        monkeypatch.setattr(rvz.heartbeat, "REPEAT_INTERVAL", 0.5)
        cluster = three_tasks()
        loop = asyncio.get_running_loop()
        began = loop.time()
        async with rvz.Node(cluster, "ps", 0, "send", secret=SECRET, **FAST) as p:
            with caplog.at_level(logging.WARNING, logger="rvz"):
                for _ in range(30):
                    h = await Hostile.connect(p.address)
                    try:
                        await h.hello("worker", 1, secret="wrong-secret-0123456789")
                        await h.events_until_closed(5)
                    finally:
                        h.close()
                await eventually(lambda: any("more like this" in r.getMessage()
                                             for r in caplog.records), "the summary line", within=10)
            refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
            # the first, then at most one line per interval
            assert 2 <= len(refused) <= 2 + (loop.time() - began) / 0.5, refused
            summaries = [line for line in refused if "more like this" in line]
            assert sum(int(line.split()[0]) for line in summaries) + len(refused) - len(summaries) == 30

    run(body(), timeout=40)


# -- small things --------------------------------------------------------------------------------


def test_a_timeout_message_says_a_rounded_duration(run, cluster) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        async with pair(cluster, "send") as (w, p):
            with pytest.raises(TimeoutError) as info:
                await p.recv(key("never"), timeout=0.1 + 0.2)
            assert "timed out after 0.3s" in str(info.value), str(info.value)
            with pytest.raises(TimeoutError) as info:
                await p.recv_many([key("never")], timeout=0.1 + 0.2)
            assert "timed out after 0.3s" in str(info.value), str(info.value)
    run(body(), timeout=20)


def test_stats_lists_no_step_that_holds_nothing(run, cluster) -> None:  # type: ignore[no-untyped-def]
    async def body() -> None:
        async with pair(cluster, "send", heartbeat=1.0, peer_timeout=10.0) as (w, p):
            await w.step(3).send(key("s"), np.arange(2))
            await eventually(lambda: 3 in p.stats()["steps"], "step 3 holds the value")
            assert (await p.step(3).recv(key("s"), timeout=5)).tolist() == [0, 1]
            assert 3 not in p.stats()["steps"], p.stats()["steps"]
    run(body(), timeout=20)


def test_the_readme_server_loop_outlives_a_client_restart(run, cluster) -> None:  # type: ignore[no-untyped-def]
    from .test_scripts import readme_block
    namespace: dict[str, Any] = {"rvz": rvz}
    exec(readme_block("async def serve("), namespace)
    serve = namespace["serve"]

    async def body() -> None:
        request, reply = key("request"), key("reply", src=key().dst, dst=key().src)
        async with rvz.Node(cluster, "ps", 0, "send", **FAST) as p:
            server = asyncio.ensure_future(serve(p, request, reply))
            try:
                for _ in range(2):  # a client, then its next process
                    async with rvz.Node(cluster, "worker", 0, "send", **FAST) as client:
                        await client.send(request, np.arange(3))
                        assert (await client.recv(reply, timeout=5)).tolist() == [0, 2, 4]
                        waiting = asyncio.ensure_future(client.recv(reply, timeout=5))
                        await asyncio.sleep(0.05)
                        waiting.cancel()
                    assert not server.done()
            finally:
                server.cancel()
                await asyncio.gather(server, return_exceptions=True)

    run(body(), timeout=30)
