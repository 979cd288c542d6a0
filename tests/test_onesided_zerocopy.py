"""Values written one-sided are handed to the application in place, and lent until released.

An array delivered from a slot or a destination is a view of the memory the peer wrote; the
slot counts against the producer's budget until the array dies, then returns (and a producer
waiting for it is served).  Arrays the application keeps may hold at most half the budget:
past it values are copied, so a producer never stalls on them.  ``Node(shm_copy=True)``
copies every value, so a peer that writes over its region cannot change a delivered array.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import numpy as np
import pytest

import rvz
from rvz.onesided.pool import Pool
from rvz.onesided.shm import ShmProvider

from .conftest import eventually, key, pair, provider_or_skip

MiB = 1 << 20
OPTS: dict[str, Any] = {"chunk_size": 4 << 20, "tcp_max": -1}


@pytest.fixture(params=["shm", "verbs"])
def transport(request: pytest.FixtureRequest) -> str:
    return provider_or_skip(str(request.param))


def channel(node: rvz.Node) -> Any:
    (ch,) = [ch for e in node._onesided.engines.values() for ch in e.channels.values()]
    return ch


def address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def in_slots(node: rvz.Node, array: np.ndarray) -> bool:
    """Whether ``array`` is memory of the region its peer writes slots into."""
    return channel(node).arena.lookup(address(array), array.nbytes) is not None


def k_text(k: rvz.Key) -> str:
    return str(k)


@pytest.mark.loop_timeout(10)
async def test_a_watched_pool_frees_on_its_loop_whatever_thread_drops_the_array() -> None:
    loop = asyncio.get_running_loop()
    pool = Pool(ShmProvider(loop), chunk_size=1 << 20, limit=4 << 20)
    returns: list[int] = []
    pool.watch(loop, lambda: returns.append(pool.lent))
    arrays = [pool.array(pool.alloc(800), np.dtype(np.float64), (100,)) for _ in range(3)]
    assert pool.lent == 3 * 832 and pool.in_use == pool.lent   # (800 aligned to 64)
    del arrays[:2]                                 # two die on the loop's thread
    assert pool.lent == 3 * 832                    # freed on the loop, not in the finaliser
    await eventually(lambda: returns == [832], "one drain for both, then the callback")
    thread = threading.Thread(target=arrays.clear)
    thread.start()
    thread.join(10)
    await eventually(lambda: returns == [832, 0], "the other thread's block came back")
    assert pool.in_use == 0
    other = rvz.new_event_loop("asyncio")          # a loop that is gone by the release
    pool.watch(other)
    kept = pool.array(pool.alloc(80), np.dtype(np.int64), (10,))
    other.close()
    pool.close()
    del kept                                       # no loop to free it on: freed at once
    assert pool.lent == 0 and pool.stats()["chunks"] == 0


@pytest.mark.loop_timeout(30)
async def test_a_delivered_array_is_its_slot_and_stays_unchanged_while_the_producer_sends(
        cluster: rvz.ClusterSpec, transport: str) -> None:
    opts = {**OPTS, "slot_budget": 8 * MiB, "max_slots": 2}
    async with pair(cluster, "send", transport=transport, onesided=opts) as (w, p):
        k = key("zc-held")
        await w.send(k, np.full(MiB // 4, -1, np.float32))
        held = await p.recv(k, timeout=10)
        assert in_slots(p, held)                      # no copy: the slot itself
        assert channel(p).arena.lent >= held.nbytes
        for i in range(30):                           # the slots go round meanwhile
            await w.send(k, np.full(MiB // 4, i, np.float32))
            got = await p.recv(k, timeout=10)
            assert int(got[0]) == int(got[-1]) == i
            del got
        assert bool((held == -1).all())


@pytest.mark.loop_timeout(30)
async def test_a_released_array_gives_its_slot_back_to_a_waiting_producer(
        cluster: rvz.ClusterSpec, transport: str) -> None:
    """The held slot leaves no room for a larger key's slot: that value waits on the
    producer until the array is released, then arrives."""
    opts = {**OPTS, "slot_budget": 4 * MiB, "max_slots": 1}
    async with pair(cluster, "send", transport=transport, onesided=opts) as (w, p):
        ka, kb = key("zc-a"), key("zc-b")
        await w.send(ka, np.full(3 * MiB // 8, 7, np.float32))          # 1.5 MiB
        held = await p.recv(ka, timeout=10)
        arena = channel(p).arena
        assert in_slots(p, held) and arena.lent == held.nbytes + 64   # its header too
        big = np.full(5 * MiB // 8, 9, np.float32)                      # 2.5 MiB
        await w.send(kb, big)
        out = channel(w)
        await eventually(lambda: bool(out.out_pending.get(k_text(kb))),
                         "the larger value waits for a slot")
        waiting = asyncio.ensure_future(p.recv(kb, timeout=10))
        await eventually(lambda: k_text(kb) in channel(p).wanted,
                         "its want waits for the budget the held array takes")
        assert not waiting.done()
        del held
        got = await waiting
        assert np.array_equal(got, big)
        await eventually(lambda: arena.lent == (got.nbytes + 64 if in_slots(p, got) else 0),
                         "only the array still held is lent")


@pytest.mark.loop_timeout(40)
async def test_an_application_keeping_more_than_the_budget_gets_copies_not_a_stall(
        cluster: rvz.ClusterSpec, transport: str) -> None:
    budget = 4 * MiB
    opts = {**OPTS, "slot_budget": budget, "max_slots": 2}
    async with pair(cluster, "send", transport=transport, onesided=opts) as (w, p):
        k = key("zc-keep")
        kept = []
        for i in range(24):                           # 12 MiB kept: three budgets' worth
            await w.send(k, np.full(MiB // 8, i, np.float32))
            kept.append(await p.recv(k, timeout=10))
        assert [int(v[0]) for v in kept] == list(range(24))
        lent = [v for v in kept if in_slots(p, v)]
        assert lent and len(lent) < len(kept)         # some in place, the rest copied
        assert channel(p).arena.lent <= budget // 2
        assert all(int(v[-1]) == i for i, v in enumerate(kept))


@pytest.mark.loop_timeout(30)
async def test_recv_driven_hands_out_the_destination_and_frees_it_when_released(
        cluster: rvz.ClusterSpec, transport: str) -> None:
    async with pair(cluster, "recv", transport=transport, onesided=OPTS) as (w, p):
        k = key("zc-dest")
        first = np.arange(100000, dtype=np.float32)
        await w.send(k, first)
        await p.recv(k, timeout=10)                   # learns the shape: destinations next
        await w.send(k, first + 1)
        got = await p.recv(k, timeout=10)
        dest = channel(p)._regions.dest_arena
        assert np.array_equal(got, first + 1)
        assert dest.lookup(address(got), got.nbytes) is not None and dest.lent > 0
        del got
        await eventually(lambda: dest.lent == 0, "the destination was freed")


@pytest.mark.loop_timeout(30)
async def test_arrays_released_on_another_thread_or_after_close_return_safely(
        cluster: rvz.ClusterSpec, transport: str) -> None:
    opts = {**OPTS, "slot_budget": 8 * MiB}
    held: list[np.ndarray] = []
    async with pair(cluster, "send", transport=transport, onesided=opts) as (w, p):
        k = key("zc-thread")
        for i in range(4):
            await w.send(k, np.full(MiB // 8, i, np.float32))
            held.append(await p.recv(k, timeout=10))
        arena = channel(p).arena
        assert all(in_slots(p, v) for v in held)
        views = [v[::2] for v in held[2:]]            # views keep their base alive
        del held[2:]
        thread = threading.Thread(target=held.pop)   # one dies on another thread
        thread.start()
        thread.join(10)
        await eventually(lambda: arena.lent == 3 * (MiB // 2 + 64), "the other thread's slot came back")
        assert [int(v[0]) for v in views] == [2, 3]
    assert arena.closed and arena.registered > 0     # the arrays still hold their regions
    thread = threading.Thread(target=views.clear)   # released after close, on another thread
    thread.start()
    thread.join(10)
    del held[:]
    gc.collect()
    await eventually(lambda: arena.lent == 0 and arena.registered == 0,
                     "the closed arena freed the last blocks and unregistered its regions")


@pytest.mark.loop_timeout(30)
async def test_shm_copy_copies_every_value_out_of_the_peers_region(
        cluster: rvz.ClusterSpec) -> None:
    provider_or_skip("shm")
    async with pair(cluster, "send", transport="shm", onesided=OPTS,
                    ps={"shm_copy": True}) as (w, p):
        k = key("zc-copy")
        await w.send(k, np.full(MiB // 4, 5, np.float32))
        got = await p.recv(k, timeout=10)
        assert not in_slots(p, got) and channel(p).arena.lent == 0
        for _, view, _, length in channel(w).ep._maps.values():
            view[:] = b"\xff" * length               # the producer writes over all it mapped
        assert bool((got == 5).all())


@pytest.mark.loop_timeout(30)
async def test_a_waiting_recvs_buffer_takes_the_value_with_no_copy_over_verbs_only(
        cluster: rvz.ClusterSpec, transport: str) -> None:
    """Over verbs the producer writes the answer into the ``into=`` buffer itself; a shm
    producer writes only into memory it mapped, never into the consumer's private buffer,
    so there the value arrives in a destination and is copied in once."""
    async with pair(cluster, "recv", transport=transport, onesided=OPTS) as (w, p):
        k = key("zc-into")
        await w.send(k, np.zeros(MiB // 4, np.float32))
        await p.recv(k, timeout=10)                    # learns the shape: destinations next
        buf = np.zeros(MiB // 4, np.float32)
        for i in range(3):
            recv = asyncio.ensure_future(p.recv(k, into=buf, timeout=10))
            await eventually(lambda: bool(channel(p).asks), "the request is out")
            before = p.stats()["into"]
            await w.send(k, np.full(MiB // 4, i, np.float32))
            assert (await recv) is buf and bool((buf == i).all())
            after = p.stats()["into"]
            zero_copy = buf.nbytes if transport == "verbs" else 0
            assert after["landed_bytes"] == before["landed_bytes"] + zero_copy
            assert after["copied_bytes"] == before["copied_bytes"] + buf.nbytes - zero_copy
        assert not channel(p)._destinations.offers    # nothing of the caller's stays registered
