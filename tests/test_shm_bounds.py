"""The shm transport against a hostile or buggy peer of the same user.

Each test replays one finding: a producer that scribbles over every byte of the consumer's
memory it has mapped, a producer that uses a new key per iteration, and a producer that
floods the consumer with ``want`` messages.  The victim (``ps:0``) uses only the public
API; the attacker is a node whose one-sided channel is driven by hand, as a peer that does
not follow the protocol would.  Each test checks that the victim survives, that its memory
stays within ``slot_budget``, and that legitimate traffic from another producer still flows.

Run as a script (``python -m tests.test_shm_bounds``) it prints each attack's figures,
including the process's peak RSS, for the report.
"""

from __future__ import annotations

import asyncio
import gc
import resource
import sys
from typing import Any

import numpy as np
import pytest

import rvz
import rvz.onesided

try:
    from .conftest import FAST
except ImportError:  # run as a script
    FAST = dict(heartbeat=0.05, peer_timeout=2.0, linger=1.0, connect_timeout=5.0,
                claim_timeout=0.3)

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
PS = "/job:ps/replica:0/task:0/device:CPU:0"


def worker(task: int) -> str:
    return f"/job:worker/replica:0/task:{task}/device:CPU:0"


def key(name: str, task: int = 0) -> rvz.Key:
    return rvz.Key(src=worker(task), dst=PS, name=name)


def channel_to(node: rvz.Node, peer: str) -> Any:
    """The attacker's own shm channel to ``peer`` (the attacker is free to misuse it)."""
    for engine in node._onesided.engines.values():
        for ch in engine.channels.values():
            if ch.peer_name.startswith(peer):
                return ch
    raise AssertionError(f"no one-sided channel to {peer}")


def registered(node: rvz.Node) -> int:
    """Bytes of one-sided memory the node holds (its pool and every per-peer region)."""
    total = 0
    for engine in node._onesided.engines.values():
        total += engine.pool.registered
        for ch in engine.channels.values():
            arena = getattr(ch, "arena", None)
            total += arena.registered if arena is not None else 0
    return total


def slot_registered(node: rvz.Node) -> int:
    """Bytes registered for the slots of the node's busiest peer (``Channel.arena``)."""
    return max((ch.arena.registered for engine in node._onesided.engines.values()
                for ch in engine.channels.values()), default=0)


async def push_and_watch(producer: rvz.Node, consumer: rvz.Node, src: str, nbytes: int,
                         keys: int, rounds: int) -> int:
    """Push ``rounds`` values of ``nbytes`` on each of ``keys`` keys from ``src`` and receive
    them all (checked), watching what the consumer registers for that producer's slots at
    every turn of the loop; the most it ever was."""
    names = [rvz.Key(src=src, dst=PS, name=f"v{i}") for i in range(keys)]
    done = False
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while not done:
            peak = max(peak, slot_registered(consumer))
            await asyncio.sleep(0)

    async def send() -> None:
        for r in range(rounds):
            for i, k in enumerate(names):
                await producer.send(k, np.full(nbytes, (r + i) % 251, np.uint8), timeout=20)

    watcher = asyncio.ensure_future(watch())
    try:
        sender = asyncio.ensure_future(send())
        for r in range(rounds):
            for i, k in enumerate(names):
                got = await consumer.recv(k, timeout=20)
                assert got.nbytes == nbytes and got[0] == got[-1] == (r + i) % 251
                del got
        await sender
    finally:
        done = True
        await watcher
    return max(peak, slot_registered(consumer))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cluster() -> rvz.ClusterSpec:
    return rvz.ClusterSpec.loopback({"worker": 2, "ps": 1})


def nodes(spec: rvz.ClusterSpec, ps_opts: dict[str, Any],
          shm_copy: bool = False) -> tuple[rvz.Node, rvz.Node, rvz.Node]:
    # tcp_max -1: every push goes through the shm channel, whose bounds these attacks test
    # (by default a push of at most 256 KiB would stay on the TCP connection).
    opts = {"chunk_size": 4 * MiB, "tcp_max": -1}
    return (rvz.Node(spec, "worker", 0, "send", transport="shm", onesided=opts, **FAST),
            rvz.Node(spec, "worker", 1, "send", transport="shm", onesided=opts, **FAST),
            rvz.Node(spec, "ps", 0, "send", transport="shm", onesided={**opts, **ps_opts},
                     shm_copy=shm_copy, **FAST))


async def legit_traffic_flows(good: rvz.Node, victim: rvz.Node, rounds: int = 5) -> None:
    """Values from the well-behaved producer (worker:1) still arrive intact."""
    for i in range(rounds):
        v = np.full(300_000, i, np.float32)
        await good.send(key("legit", 1), v)
        got = await victim.recv(key("legit", 1), timeout=10)
        assert np.array_equal(got, v), i


# -- the attacks ----------------------------------------------------------------------------


async def attack_scribble(shm_copy: bool = True) -> dict[str, Any]:
    """A producer given a ~1 MiB slot writes 0xFF over every byte of ours it has mapped."""
    spec = cluster()
    bad, good, victim = nodes(spec, {"chunk_size": 64 * MiB, "max_slots": 1}, shm_copy)
    async with victim, bad, good:
        first = np.arange(MiB // 4, dtype=np.float32) - 1         # 1 MiB, Send-Driven
        await bad.send(key("a"), first)
        kept = await victim.recv(key("a"), timeout=10)            # handed to the application
        snapshot = kept.copy()
        ch = channel_to(bad, "/job:ps")
        mapped = 0
        for _, view, _, length in ch.ep._maps.values():
            view[:] = b"\xff" * length                            # the attack
            mapped += length
        intact = bool(np.array_equal(kept, snapshot))
        await legit_traffic_flows(good, victim)
        return {"mapped_by_peer": mapped, "array_intact": intact,
                "registered": registered(victim), "peak_rss_mib": peak_rss_mib()}


async def attack_new_key_per_iteration(iterations: int = 200) -> dict[str, Any]:
    """A producer that sends every iteration's value under a new key."""
    spec = cluster()
    budget = 8 * MiB
    bad, good, victim = nodes(spec, {"slot_budget": budget, "pool_limit": 512 * MiB})
    peak = 0
    delivered = 0
    async with victim, bad, good:
        v = np.ones(64 * 1024, np.float32)                        # 256 KiB per value
        for i in range(iterations):
            await bad.send(key(f"iter{i}"), v)
            got = await victim.recv(key(f"iter{i}"), timeout=10)
            delivered += int(got.size == v.size)
            del got
            peak = max(peak, registered(victim))
        await legit_traffic_flows(good, victim)
        return {"iterations": iterations, "delivered": delivered, "budget": budget,
                "peak_registered": peak, "peak_rss_mib": peak_rss_mib()}


async def attack_want_flood(n: int = 6, size: int = 128 * MiB, budget: int = 64 * MiB) -> dict[str, Any]:
    """Tiny ``want`` messages asking for big slots under distinct keys, never filled."""
    spec = cluster()
    bad, good, victim = nodes(spec, {"slot_budget": budget})
    async with victim, bad, good:
        await bad.send(key("hello"), np.ones(100_000, np.float32))   # opens the channel
        await victim.recv(key("hello"), timeout=10)
        ch = channel_to(bad, "/job:ps")
        for i in range(n):
            ch._control({"op": "want", "k": str(key(f"flood{i}")), "n": size, "rel": []})
        await asyncio.sleep(0.5)
        peak = registered(victim)
        await legit_traffic_flows(good, victim)
        return {"wants": n, "asked_each": size, "budget": budget, "peak_registered": peak,
                "peak_rss_mib": peak_rss_mib()}


def run_all(which: list[str]) -> None:
    attacks = {"scribble": attack_scribble, "newkey": attack_new_key_per_iteration,
               "flood": attack_want_flood, "flood-small": lambda: attack_want_flood(2000, MiB)}
    for name in which or list(attacks):
        attack = attacks[name]
        try:
            print(name, rvz.run(asyncio.wait_for(attack(), 120)), flush=True)
        except BaseException as exc:  # the report wants the outcome, whatever it is
            print(name, f"failed: {exc!r} (peak RSS {peak_rss_mib():.0f} MiB)", flush=True)
        gc.collect()


# -- the regression tests ---------------------------------------------------------------------


def shm_or_skip() -> None:
    why = rvz.onesided.available().get("shm")
    if why:
        pytest.skip(f"shm not available here: {why}")


def test_a_peer_maps_only_its_region_and_cannot_touch_delivered_arrays(run: Any) -> None:
    shm_or_skip()
    out = run(attack_scribble(shm_copy=True), timeout=40)
    assert out["array_intact"], out
    # one slot of ~1 MiB: the peer's region is that slot rounded to 1 MiB, not a 64 MiB chunk
    assert 0 < out["mapped_by_peer"] <= 2 * MiB, out


def test_without_shm_copy_a_delivered_array_is_the_peers_slot(run: Any) -> None:
    """The default lends the slot itself (no copy): a peer that writes over all it mapped
    reaches the array it delivered, which is what ``shm_copy=True`` is for; the victim
    still survives and legitimate traffic flows."""
    shm_or_skip()
    out = run(attack_scribble(shm_copy=False), timeout=40)
    assert not out["array_intact"], out
    assert 0 < out["mapped_by_peer"] <= 2 * MiB, out


def test_a_new_key_per_iteration_stays_within_the_slot_budget(run: Any) -> None:
    shm_or_skip()
    out = run(attack_new_key_per_iteration(), timeout=50)
    assert out["delivered"] == out["iterations"], out
    # the slots (the budget) plus the consumer's own pool chunk for delivered arrays
    assert out["peak_registered"] <= out["budget"] + 8 * MiB, out


@pytest.mark.parametrize("size", [128 * MiB, MiB], ids=["oversize", "within-budget"])
def test_a_flood_of_wants_never_allocates_past_the_slot_budget(run: Any, size: int) -> None:
    shm_or_skip()
    budget = 16 * MiB
    out = run(attack_want_flood(200, size, budget), timeout=40)
    assert out["peak_registered"] <= budget + 8 * MiB, out


@pytest.mark.parametrize("nbytes", [MiB, MiB + 1, 4096, 3 * MiB + 5, 64 * MiB],
                         ids=["1MiB", "1MiB+1", "4KiB", "3MiB+5", "64MiB"])
def test_registered_slot_memory_never_exceeds_the_slot_budget(run: Any, nbytes: int) -> None:
    """Every slot's region counts as registered (its rounding included), not as granted: a
    1 MiB value and its header must not take two 1 MiB chunks, nor the budget's worth twice."""
    shm_or_skip()
    budget = 64 * MiB

    async def main() -> None:
        spec = cluster()
        _, good, victim = nodes(spec, {"slot_budget": budget})
        async with victim, good:
            keys = max(1, min(8, budget // nbytes // 8 + 1))   # enough to ask for the budget
            rounds = 3 if nbytes > 8 * MiB else 10
            peak = await push_and_watch(good, victim, worker(1), nbytes, keys, rounds)
            assert 0 < peak <= budget, (peak, budget)

    run(main(), timeout=50)


def test_idle_keys_give_their_slots_and_regions_back(run: Any) -> None:
    shm_or_skip()

    async def main() -> None:
        spec = cluster()
        bad, good, victim = nodes(spec, {"slot_idle": 0.3})
        async with victim, bad, good:
            for i in range(4):
                await good.send(key(f"idle{i}", 1), np.ones(200_000, np.float32))
                assert (await victim.recv(key(f"idle{i}", 1), timeout=10)).sum() == 200_000
            ch = channel_to(good, "/job:ps")
            assert ch.ep._maps, "the producer mapped a region for its slots"
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while ch.ep._maps or any(c.arena.registered for e in victim._onesided.engines.values()
                                     for c in e.channels.values()):
                assert loop.time() < deadline, "idle slots and regions were never reclaimed"
                await asyncio.sleep(0.05)
            await legit_traffic_flows(good, victim)   # slots come back on demand

    run(main(), timeout=30)


def test_keys_used_once_leave_no_slot_bookkeeping_behind(run: Any) -> None:
    """A key whose last slot was written and not granted again (the budget went to the next
    key) is forgotten: the consumer kept its last use, one entry per key ever pushed."""
    shm_or_skip()

    async def main() -> None:
        spec = cluster()
        # Room for one slot of one 8 KiB value: every new key takes it from the last one.
        bad, good, victim = nodes(spec, {"max_slots": 1, "slot_budget": 12_000})
        async with victim, bad, good:
            v = np.arange(8192, dtype=np.uint8)
            for i in range(40):
                keys = [key(f"a{i}", 1), key(f"b{i}", 1)]
                await asyncio.gather(*(good.send(k, v, timeout=10) for k in keys))
                for k in keys:
                    assert (await victim.recv(k, timeout=10)).nbytes == v.nbytes
            ch = channel_to(victim, "/job:worker/replica:0/task:1")
            for _ in range(100):   # the last refill and revoke settle within a few passes
                if not ch.refill and not ch.revoking:
                    break
                await asyncio.sleep(0.01)
            assert set(ch.last_use) <= set(ch.slot_imms), (len(ch.last_use), len(ch.slot_imms))
            assert len(ch.slot_imms) <= 1

    run(main(), timeout=30)


@pytest.mark.parametrize("mode", ["send", "recv"])
def test_values_larger_than_the_slot_budget_arrive_in_order(run: Any, mode: str) -> None:
    shm_or_skip()

    async def main() -> None:
        spec = cluster()
        bad, good, victim = nodes(spec, {"slot_budget": MiB})
        async with victim, bad, good:
            k = key("big", 1)
            sent = [np.arange(i * 1000, i * 1000 + 700_000, dtype=np.int64) for i in range(3)]
            sent.append(np.full(10, 7, np.int64))     # a small one right behind, same key
            for v in sent:
                await good.send(k, v, mode=mode)
            for v in sent:
                assert np.array_equal(await victim.recv(k, timeout=10), v)

    run(main(), timeout=30)


def test_metadata_for_a_request_never_made_allocates_nothing(run: Any) -> None:
    shm_or_skip()

    async def main() -> None:
        spec = cluster()
        bad, good, victim = nodes(spec, {})
        async with victim, bad, good:
            await bad.send(key("m"), np.ones(100_000, np.float32))
            await victim.recv(key("m"), timeout=10)
            before = registered(victim)
            ch = channel_to(bad, "/job:ps")
            for r in range(1, 200):
                ch._control({"op": "meta", "r": r, "st": 0, "k": str(key("m")), "c": 11,
                             "s": [1 << 24], "n": 1 << 26})
            await asyncio.sleep(0.3)
            assert registered(victim) <= before
            await legit_traffic_flows(good, victim)

    run(main(), timeout=30)


if __name__ == "__main__":
    run_all(sys.argv[1:])
