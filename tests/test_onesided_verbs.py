"""The verbs provider without an RDMA device.

* set-up logic: argument checks, the errors when pyverbs, a device, a port or a GID is
  missing, the memlock check before registration;
* the provider's data path (queue pairs, work requests, completion channels, recv buffer
  reposting, failed completions) against an in-process fake of the pyverbs API, so that a
  whole node-to-node exchange runs through ``VerbsProvider`` here.  The fake executes a
  work request at once (or, while ``Fabric.held`` is a list, when ``Fabric.release`` runs:
  work requests in flight): an RDMA write copies into the target address after checking
  the rkey and bounds (else the sender gets REM_ACCESS_ERR and its queue pair breaks, as
  on a device) and queues completions on both sides, signalling their channels.

The same engine runs on a real device in test_onesided_contract.py (skipped without one).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import os
import resource
from collections import deque
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import rvz
from rvz.onesided import memlock, verbs
from rvz.onesided.verbs import VerbsProvider, find_channel_fd

from .conftest import FAST, PS, WORKER, eventually, key, pair
from .test_shm_bounds import push_and_watch

# -- a fake pyverbs -------------------------------------------------------------------------

E = SimpleNamespace(IBV_PORT_ACTIVE=4, IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2,
                    IBV_QPT_RC=2, IBV_WR_RDMA_WRITE=0, IBV_WR_RDMA_WRITE_WITH_IMM=1, IBV_WR_SEND=2,
                    IBV_WC_SUCCESS=0,
                    IBV_WC_RECV=128, IBV_WC_RECV_RDMA_WITH_IMM=129, IBV_WC_SEND=0, IBV_WC_RDMA_WRITE=1)


class Fabric:
    def __init__(self) -> None:
        self.ids = itertools.count(100)
        self.qps: dict[int, FakeQP] = {}
        self.mrs: dict[int, tuple[int, int]] = {}
        self.fail_next_write = False
        self.held: list[tuple[FakeQP, Any]] | None = None   # work requests in flight
        # Completions of writes that landed, not seen by the receiver yet (``deliver``).
        self.unseen: list[Any] | None = None
        self.devices = ["fake0"]
        self.port_state = 4
        self.link_layer = 1
        self.gids = ["0000:0000:0000:0000:0000:0000:0000:0000"] * 4

    def covering(self, addr: int, length: int) -> list[int]:
        """The rkeys of the registrations that overlap ``[addr, addr + length)``."""
        return [rkey for rkey, (base, n) in self.mrs.items()
                if base < addr + length and addr < base + n]

    def deliver(self) -> None:
        """Queue the completions held back in ``unseen``; queue them at once from now on."""
        unseen, self.unseen = self.unseen or [], None
        for push in unseen:
            push()

    def release(self) -> None:
        """Execute the work requests held in flight, in order; post at once from now on."""
        held, self.held = self.held or [], None
        for qp, wr in held:
            qp.execute(wr)


class FakeContext:
    def __init__(self, fabric: Fabric, name: str) -> None:
        self.fabric = fabric
        self.name = name

    def query_port(self, port: int) -> Any:
        if port != 1:
            raise RuntimeError(f"no port {port}")
        f = self.fabric
        return SimpleNamespace(state=f.port_state, lid=7, active_mtu=5, link_layer=f.link_layer,
                               gid_tbl_len=len(f.gids))

    def query_gid(self, port: int, index: int) -> Any:
        return SimpleNamespace(gid=self.fabric.gids[index])

    def close(self) -> None:
        pass


class FakeMR:
    def __init__(self, pd: Any, length: int, access: int, address: int | None = None) -> None:
        self.fabric = pd.fabric
        self.rkey = self.lkey = next(self.fabric.ids)
        self.fabric.mrs[self.rkey] = (int(address or 0), length)

    def close(self) -> None:
        self.fabric.mrs.pop(self.rkey, None)


class FakeChannel:
    """A completion channel: one eventfd, readable while an event is pending."""

    def __init__(self, ctx: FakeContext) -> None:
        self._fd = os.eventfd(0, os.EFD_NONBLOCK)
        self.fd = self._fd

    def signal(self) -> None:
        os.eventfd_write(self._fd, 1)

    def get_cq_event(self, cq: Any) -> None:
        os.eventfd_read(self._fd)

    def close(self) -> None:
        os.close(self._fd)


class NoFdChannel(FakeChannel):
    """Like pyverbs: the fd is not exposed; the provider finds it in /proc/self/fd."""

    def __init__(self, ctx: FakeContext) -> None:
        super().__init__(ctx)
        del self.fd


class FakeCQ:
    def __init__(self, ctx: Any, cqe: int, context: Any, channel: Any, vector: int) -> None:
        self.channel = channel
        self.wcs: deque[Any] = deque()
        self.armed = False

    def req_notify(self) -> None:
        self.armed = True

    def ack_events(self, n: int) -> None:
        pass

    def poll(self, n: int = 1) -> tuple[int, list[Any]]:
        out = [self.wcs.popleft() for _ in range(min(n, len(self.wcs)))]
        return len(out), out

    def push(self, **fields: Any) -> None:
        fields.setdefault("status", 0)
        fields.setdefault("imm_data", 0)
        fields.setdefault("byte_len", 0)
        self.wcs.append(SimpleNamespace(vendor_err=0, **fields))
        if self.armed:
            self.armed = False
            self.channel.signal()

    def close(self) -> None:
        pass


class FakeQP:
    def __init__(self, pd: Any, init: Any) -> None:
        self.fabric = pd.fabric
        self.qp_num = next(self.fabric.ids)
        self.fabric.qps[self.qp_num] = self
        self.scq, self.rcq = init.scq, init.rcq
        self.recvs: deque[Any] = deque()
        self.dest = 0
        self.state = "RESET"
        self.broken = False   # a failed work request moved it to the error state

    def to_init(self, attr: Any) -> None:
        self.state = "INIT"

    def to_rtr(self, attr: Any) -> None:
        self.dest = attr.dest_qp_num
        self.state = "RTR"

    def to_rts(self, attr: Any) -> None:
        assert attr.rnr_retry == 7
        self.state = "RTS"

    def post_recv(self, wr: Any) -> None:
        self.recvs.append(wr)

    def post_send(self, wr: Any) -> None:
        assert self.state == "RTS"
        if self.fabric.held is not None:
            self.fabric.held.append((self, wr))
            return
        self.execute(wr)

    def execute(self, wr: Any) -> None:
        remote = self.fabric.qps.get(self.dest)
        if remote is None:
            # The peer's QP closed with its connection: an RC QP would retry for its retry
            # timeout, and the TCP reset that closes this endpoint too comes well before the
            # request's error completion, which nobody then reads.
            return
        if self.broken:   # work requests after an error are flushed
            self.scq.push(wr_id=wr.wr_id, opcode=E.IBV_WC_RDMA_WRITE, qp_num=self.qp_num, status=5)
            return
        data = b"".join(ctypes.string_at(s.addr, s.length) for s in wr.sg if s.length)
        if wr.opcode in (E.IBV_WR_RDMA_WRITE, E.IBV_WR_RDMA_WRITE_WITH_IMM):
            base, length = self.fabric.mrs.get(wr.rkey, (0, -1))
            fail = self.fabric.fail_next_write
            self.fabric.fail_next_write = False
            if fail or not (base <= wr.remote_addr and wr.remote_addr + len(data) <= base + length):
                self.broken = True   # REM_ACCESS_ERR: no registration there (any more)
                self.scq.push(wr_id=wr.wr_id, opcode=E.IBV_WC_RDMA_WRITE, qp_num=self.qp_num, status=10)
                return
            ctypes.memmove(wr.remote_addr, data, len(data))
            if wr.opcode == E.IBV_WR_RDMA_WRITE_WITH_IMM:
                recv = remote.recvs.popleft()  # the provider keeps buffers posted
                fields = dict(wr_id=recv.wr_id, opcode=E.IBV_WC_RECV_RDMA_WITH_IMM,
                              qp_num=remote.qp_num, imm_data=wr.imm_data, byte_len=len(data))
                if self.fabric.unseen is not None:
                    self.fabric.unseen.append(lambda: remote.rcq.push(**fields))
                else:
                    remote.rcq.push(**fields)
            self.scq.push(wr_id=wr.wr_id, opcode=E.IBV_WC_RDMA_WRITE, qp_num=self.qp_num)
        else:
            recv = remote.recvs.popleft()
            sge = recv.sg[0]
            assert len(data) <= sge.length
            ctypes.memmove(sge.addr, data, len(data))
            remote.rcq.push(wr_id=recv.wr_id, opcode=E.IBV_WC_RECV, qp_num=remote.qp_num,
                            byte_len=len(data))
            self.scq.push(wr_id=wr.wr_id, opcode=E.IBV_WC_SEND, qp_num=self.qp_num)

    def close(self) -> None:
        self.fabric.qps.pop(self.qp_num, None)


class Bag:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class FakeSendWR(Bag):
    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr


def fake_pyverbs(fabric: Fabric, channel: type = NoFdChannel) -> SimpleNamespace:
    def devices() -> list[Any]:
        return [SimpleNamespace(name=n.encode()) for n in fabric.devices]

    return SimpleNamespace(
        e=E,
        device=SimpleNamespace(get_device_list=devices, Context=lambda name: FakeContext(fabric, name)),
        pd=SimpleNamespace(PD=lambda ctx: SimpleNamespace(fabric=fabric, close=lambda: None)),
        mr=SimpleNamespace(MR=FakeMR),
        cq=SimpleNamespace(CompChannel=channel, CQ=FakeCQ),
        qp=SimpleNamespace(QPCap=Bag, QPInitAttr=Bag, QPAttr=Bag, QP=FakeQP),
        wr=SimpleNamespace(SGE=lambda addr, length, lkey: Bag(addr=addr, length=length, lkey=lkey),
                           RecvWR=lambda wr_id, num_sge, sg: Bag(wr_id=wr_id, sg=sg),
                           SendWR=lambda wr_id, opcode, num_sge, sg, imm_data=0: FakeSendWR(
                               wr_id=wr_id, opcode=opcode, sg=sg, imm_data=imm_data)),
        addr=SimpleNamespace(GID=lambda g: g, GlobalRoute=Bag, AHAttr=Bag),
    )


@pytest.fixture
def fabric(monkeypatch: pytest.MonkeyPatch) -> Fabric:
    fab = Fabric()
    monkeypatch.setattr(verbs, "load_pyverbs", lambda: fake_pyverbs(fab))
    return fab


OPTS = {"chunk_size": 1 << 20, "recv_depth": 64, "send_depth": 16}


def provider(**kw: Any) -> VerbsProvider:
    return VerbsProvider(asyncio.get_running_loop(), **kw)


# -- set-up without a device ---------------------------------------------------------------


@pytest.mark.loop_timeout(10)
async def test_argument_checks() -> None:
    for kw, what in [({"device": ""}, "device"), ({"device": 3}, "device"), ({"port": 0}, "port"),
                     ({"port": "1"}, "port"), ({"gid_index": -1}, "gid_index"),
                     ({"recv_depth": 0}, "recv_depth"), ({"send_depth": 1 << 20}, "send_depth")]:
        with pytest.raises(ValueError, match=what):
            provider(**kw)


@pytest.mark.loop_timeout(10)
async def test_missing_pyverbs_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_pyverbs(name: str, *args: Any, **kw: Any) -> Any:
        if name.startswith("pyverbs"):
            raise ImportError("No module named 'pyverbs'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pyverbs)
    try:
        with pytest.raises(rvz.TransportError, match="no pyverbs.*docs/rdma.md"):
            provider().open()
    finally:
        monkeypatch.setattr(builtins, "__import__", real_import)


@pytest.mark.loop_timeout(20)
async def test_node_asking_for_verbs_fails_at_start_naming_the_reason(cluster: rvz.ClusterSpec,
                                                                      fabric: Fabric) -> None:
    fabric.devices = []

    node = rvz.Node(cluster, "ps", 0, transport="verbs", **FAST)
    with pytest.raises(rvz.TransportError, match="transport 'verbs' is not available.*no RDMA device"):
        await node.start()
    # auto does not fail: it says why verbs is out and goes on
    async with rvz.Node(cluster, "ps", 0, transport="auto", **FAST) as auto:
        assert "no RDMA device" in auto._onesided.unavailable["verbs"]
        assert "shm" in auto._onesided.engines


@pytest.mark.parametrize("setup, message", [
    (lambda f: setattr(f, "devices", []), "no RDMA device"),
    (lambda f: setattr(f, "port_state", 1), "port 1 of RDMA device fake0 is down .state DOWN"),
    (lambda f: setattr(f, "link_layer", 2), "RoCE port 1 of fake0 has no GID"),
])
@pytest.mark.loop_timeout(10)
async def test_device_errors(fabric: Fabric, setup: Any, message: str) -> None:
    setup(fabric)
    with pytest.raises(rvz.TransportError, match=message):
        provider(pyverbs=fake_pyverbs(fabric)).open()


@pytest.mark.loop_timeout(10)
async def test_device_selection(fabric: Fabric) -> None:
    fabric.devices = ["fake0", "fake1"]
    with pytest.raises(rvz.TransportError, match=r"no RDMA device named 'mlx5_9'; found \['fake0', 'fake1"):
        provider(device="mlx5_9", pyverbs=fake_pyverbs(fabric)).open()
    p = provider(device="fake1", pyverbs=fake_pyverbs(fabric))
    p.open()
    assert p.device_name == "fake1" and p.gid == ""  # InfiniBand: routed by LID
    with pytest.raises(rvz.TransportError, match="no port 2"):
        provider(port=2, pyverbs=fake_pyverbs(fabric)).open()
    fabric.link_layer = 2
    fabric.gids[2] = "fe80:0000:0000:0000:0000:0000:0000:0001"
    roce = provider(pyverbs=fake_pyverbs(fabric))
    roce.open()
    assert roce.gid_index == 2 and roce.gid.startswith("fe80")


@pytest.mark.loop_timeout(10)
async def test_memlock_limit_is_checked_before_registering(fabric: Fabric,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    p = provider(pyverbs=fake_pyverbs(fabric))
    p.open()
    monkeypatch.setattr(memlock, "memlock_limit", lambda: (1 << 20, 2 << 20))
    monkeypatch.setattr(memlock, "has_cap_ipc_lock", lambda: False)
    with pytest.raises(rvz.TransportError) as info:
        p.register(4 << 20)
    text = str(info.value)
    assert "RLIMIT_MEMLOCK" in text and "ulimit -l" in text and "limits.conf" in text
    assert "1048576 bytes" in text
    assert not fabric.mrs  # nothing was registered
    region = p.register(512 << 10)  # within the limit
    assert fabric.mrs[region.rkey] == (region.addr, 512 << 10)
    p.deregister(region)
    assert not fabric.mrs


@pytest.mark.loop_timeout(10)
async def test_memlock_unlimited_and_capability_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    monkeypatch.setattr(memlock, "memlock_limit", lambda: unlimited)
    memlock.check_memlock(1 << 40, 1 << 40)
    monkeypatch.setattr(memlock, "memlock_limit", lambda: (1, 1))
    monkeypatch.setattr(memlock, "has_cap_ipc_lock", lambda: True)
    memlock.check_memlock(1 << 40, 1 << 40)


@pytest.mark.loop_timeout(10)
async def test_channel_fd_is_found_when_pyverbs_hides_it() -> None:
    before = verbs._fds()
    ch = NoFdChannel(None)  # type: ignore[arg-type]
    try:
        assert find_channel_fd(ch, before) == ch._fd
    finally:
        ch.close()


# -- the data path on the fake device ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(30)
async def test_exchange_through_the_verbs_provider(cluster: rvz.ClusterSpec, fabric: Fabric,
                                                   mode: str) -> None:
    async with pair(cluster, mode, transport="verbs", onesided=OPTS) as (w, p):
        assert w.transport_for(PS) == "verbs"
        for i, shape in enumerate([(10,), (70000,), (70000,), (300, 300), (0,), (5,)]):
            v = np.random.default_rng(i).standard_normal(shape)
            await w.send(key("v"), v)
            assert np.array_equal(await p.recv(key("v"), timeout=10), v)
        await w.send(key("b"), bytes(range(200)) * 100)
        assert await p.recv(key("b"), timeout=10) == bytes(range(200)) * 100
        many = [asyncio.ensure_future(p.recv(key(f"k{i}"), timeout=10)) for i in range(30)]
        for i in range(30):
            await w.send(key(f"k{i}"), np.full(5000, i))
        assert [int(v[0]) for v in await asyncio.gather(*many)] == list(range(30))
        ch = next(iter(w._onesided.engines["verbs"].channels.values()))
        assert ch.stats["writes"] > 0 and ch.stats["inline"] > 0
        # every work request completes and releases its staging
        await eventually(lambda: not ch.inflight, "every work request completed")


@pytest.mark.loop_timeout(60)
async def test_verbs_slots_register_within_the_slot_budget(cluster: rvz.ClusterSpec,
                                                           fabric: Fabric) -> None:
    """The slot accounting is the engine's: what verbs registers for a peer's slots stays
    within ``slot_budget`` too, for values a little over 1 MiB with their header."""
    budget = 8 << 20
    async with pair(cluster, "send", transport="verbs",
                    onesided={**OPTS, "slot_budget": budget}) as (w, p):
        peak = await push_and_watch(w, p, WORKER, (1 << 20) + 1, 8, 4)
        assert 0 < peak <= budget, (peak, budget)


@pytest.mark.loop_timeout(30)
async def test_verbs_lends_the_registered_slot_and_deregisters_it_once_released(
        cluster: rvz.ClusterSpec, fabric: Fabric) -> None:
    """A value arrives as an array over the slot the peer wrote (memory registered with the
    device); its region stays registered while the array lives, past the node's close."""
    async with pair(cluster, "send", transport="verbs", onesided=OPTS) as (w, p):
        await w.send(key("zc"), np.full(70000, 3.0))
        got = await p.recv(key("zc"), timeout=10)
        (ch,) = p._onesided.engines["verbs"].channels.values()
        arena = ch.arena
        region = arena.lookup(int(got.__array_interface__["data"][0]), got.nbytes)
        assert region is not None and fabric.mrs[region.rkey][0] == region.addr
    assert arena.closed and arena.registered == region.length
    assert bool((got == 3.0).all())
    del got
    await eventually(lambda: arena.registered == 0, "the released slot's region was dropped")
    assert region.rkey not in fabric.mrs


@pytest.mark.loop_timeout(30)
async def test_a_failed_completion_fails_the_peer_not_the_process(cluster: rvz.ClusterSpec,
                                                                  fabric: Fabric,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "rvz"):
        async with pair(cluster, "send", transport="verbs", onesided=OPTS) as (w, p):
            await w.send(key("f"), np.ones(50000))
            await p.recv(key("f"), timeout=10)
            waiting = asyncio.ensure_future(p.recv(key("f"), timeout=10))
            fabric.fail_next_write = True
            await w.send(key("f"), np.ones(50000))
            # the producer says why (the status of the failed work completion)
            await eventually(lambda: any("REM_ACCESS_ERR" in r.getMessage()
                                         for r in caplog.records), "the failure was logged")
            # The consumer saw its connection reset, not lost: its recv waits on.  The next
            # send reconnects; the value whose write failed goes again first, then the new one.
            await w.send(key("f"), np.ones(50000) * 2, timeout=10)
            assert (await waiting)[0] == 1
            assert (await p.recv(key("f"), timeout=10))[0] == 2


@pytest.mark.loop_timeout(20)
async def test_verbs_with_a_shm_only_peer_fails_with_the_reason(cluster: rvz.ClusterSpec,
                                                                fabric: Fabric) -> None:
    async with rvz.Node(cluster, "worker", 0, "send", transport="verbs", onesided=OPTS, **FAST) as w, \
            rvz.Node(cluster, "ps", 0, "send", transport="shm", onesided=OPTS, **FAST):
        with pytest.raises((rvz.PeerLost, rvz.TransportError)) as info:
            await w.send(key("x"), np.ones(10), timeout=5)
        text = f"{info.value} {info.value.__cause__}"
        assert "asks for transport 'verbs'" in text and "'shm'" in text, text




# -- recv(key, into=buf): the buffer as the destination --------------------------------------

MiB = 1 << 20


def into_stats(node: rvz.Node) -> tuple[int, int]:
    into = node.stats()["into"]
    return into["landed_bytes"], into["copied_bytes"]


def registered(fabric: Fabric, buf: Any) -> bool:
    """Whether any registration covers memory of ``buf`` (an array or a bytearray)."""
    array = np.frombuffer(buf, np.uint8) if isinstance(buf, bytearray) else buf
    return bool(fabric.covering(int(array.__array_interface__["data"][0]), array.nbytes))


def waiting_recvs(node: rvz.Node) -> int:
    return sum(s["waiting_recvs"] for s in node.stats()["steps"].values())


async def learned(w: rvz.Node, p: rvz.Node, k: rvz.Key, value: np.ndarray) -> None:
    """One value of ``k`` received, so that the consumer knows its dtype and shape."""
    await w.send(k, value)
    assert np.array_equal(await p.recv(k, timeout=10), value)


@contextlib.asynccontextmanager
async def learned_pair(cluster: rvz.ClusterSpec,
                       name: str) -> AsyncIterator[tuple[rvz.Node, rvz.Node, rvz.Key, np.ndarray]]:
    """Recv-Driven nodes over the fake device, key ``name`` learned as 50000 float64, and
    a buffer that takes such values."""
    async with pair(cluster, "recv", transport="verbs", onesided=OPTS) as (w, p):
        k = key(name)
        await learned(w, p, k, np.zeros(50000, np.float64))
        yield w, p, k, np.zeros(50000, np.float64)


async def offered(p: rvz.Node, fabric: Fabric, k: rvz.Key, buf: Any,
                  **kw: Any) -> asyncio.Future[Any]:
    """A recv of ``k`` into ``buf`` that waits with its buffer registered."""
    recv = asyncio.ensure_future(p.recv(k, into=buf, **kw))
    await eventually(lambda: recv.done() or registered(fabric, buf), "the buffer is offered")
    assert not recv.done()
    return recv


@pytest.mark.loop_timeout(30)
async def test_a_recv_driven_value_is_written_straight_into_the_buffer(
        cluster: rvz.ClusterSpec, fabric: Fabric) -> None:
    async with pair(cluster, "recv", transport="verbs", onesided=OPTS) as (w, p):
        k = key("into")
        await learned(w, p, k, np.zeros(MiB // 4, np.float32))
        buf = np.zeros(MiB // 4, np.float32)
        for i in range(3):
            landed, copied = into_stats(p)
            recv = await offered(p, fabric, k, buf, timeout=10)
            sent = np.arange(MiB // 4, dtype=np.float32) + i
            await w.send(k, sent)
            assert (await recv) is buf and np.array_equal(buf, sent)
            assert into_stats(p) == (landed + buf.nbytes, copied)   # landed, nothing copied
            assert not registered(fabric, buf)                       # deregistered once answered
        raw = bytearray(MiB)                                         # raw bytes take any value
        recv = await offered(p, fabric, k, raw, timeout=10)
        await w.send(k, sent + 1)
        assert (await recv) is raw and np.array_equal(np.frombuffer(raw, np.float32), sent + 1)
        assert not registered(fabric, raw)
        # A value queued before its recv is copied in, and a strided buffer copies too.
        await w.send(k, sent + 2)
        await eventually(lambda: any(s["queued_values"] for s in p.stats()["steps"].values()),
                         "the value is queued")
        landed, copied = into_stats(p)
        assert (await p.recv(k, into=buf, timeout=10)) is buf and np.array_equal(buf, sent + 2)
        assert into_stats(p) == (landed, copied + buf.nbytes)
        column = np.zeros((MiB // 4, 2), np.float32)
        recv = asyncio.ensure_future(p.recv(k, into=column[:, 1], timeout=10))
        await eventually(lambda: waiting_recvs(p) == 1, "the recv waits")
        assert not registered(fabric, column)
        await w.send(k, sent + 3)
        await recv
        assert np.array_equal(column[:, 1], sent + 3) and not column[:, 0].any()
        assert into_stats(p)[1] == copied + 2 * buf.nbytes


@pytest.mark.loop_timeout(30)
async def test_a_value_that_does_not_fit_the_buffer_stays_queued(cluster: rvz.ClusterSpec,
                                                                 fabric: Fabric) -> None:
    async with learned_pair(cluster, "into-fit") as (w, p, k, buf):
        # The producer's value differs from the shape learned: it says so, the buffer is not
        # offered again, and the value arrives in rvz's memory and goes back to the queue.
        recv = await offered(p, fabric, k, buf, timeout=10)
        await w.send(k, np.ones(60000, np.float64))
        with pytest.raises(rvz.BufferMismatch, match=r"shape \(60000,\)"):
            await recv
        assert not registered(fabric, buf) and not buf.any()
        assert np.array_equal(await p.recv(k, timeout=10), np.ones(60000))
        # A buffer that does not take the value learned is never offered.
        small = np.zeros(10, np.float64)
        recv = asyncio.ensure_future(p.recv(k, into=small, timeout=10))
        await eventually(lambda: waiting_recvs(p) == 1, "the recv waits")
        assert not registered(fabric, small)
        await w.send(k, np.full(60000, 2.0))
        with pytest.raises(rvz.BufferMismatch):
            await recv
        assert (await p.recv(k, timeout=10))[0] == 2.0


@pytest.mark.parametrize("how", ["cancel", "timeout"])
@pytest.mark.loop_timeout(30)
async def test_a_recv_that_stops_waiting_before_the_answer_leaves_no_registration(
        cluster: rvz.ClusterSpec, fabric: Fabric, how: str) -> None:
    async with learned_pair(cluster, "into-parked") as (w, p, k, buf):
        recv = await offered(p, fabric, k, buf, timeout=30 if how == "cancel" else 0.3)
        if how == "cancel":
            recv.cancel()
        with pytest.raises(asyncio.CancelledError if how == "cancel" else TimeoutError):
            await recv
        assert not registered(fabric, buf)
        await w.send(k, np.full(50000, 4.0))
        assert bool((await p.recv(k, timeout=10) == 4.0).all())
        assert not buf.any()


@pytest.mark.parametrize("how", ["cancel", "timeout"])
@pytest.mark.loop_timeout(40)
async def test_a_recv_that_stops_waiting_while_the_write_is_in_flight_loses_nothing(
        cluster: rvz.ClusterSpec, fabric: Fabric, how: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The buffer is deregistered as the recv stops: the producer's write, still in flight,
    fails at the producer (as on a device), the pair connects again, and the value is sent
    again, to the next recv; the buffer never sees it."""
    async with learned_pair(cluster, "into-flight") as (w, p, k, buf):
        # (the timeout leaves the time to start the write, even on a loaded machine)
        recv = await offered(p, fabric, k, buf, timeout=30 if how == "cancel" else 2.0)
        fabric.held = []
        await w.send(k, np.full(50000, 7.0))
        await eventually(lambda: bool(fabric.held), "the answer's write is in flight")
        if how == "cancel":
            recv.cancel()
        with pytest.raises(asyncio.CancelledError if how == "cancel" else TimeoutError):
            await recv
        assert not registered(fabric, buf)
        with caplog.at_level(logging.WARNING, "rvz"):
            fabric.release()
            got = await p.recv(k, timeout=10)
        assert any("REM_ACCESS_ERR" in r.getMessage() for r in caplog.records)
        assert bool((got == 7.0).all()) and got.shape == (50000,)
        assert not buf.any()
        await w.send(k, np.full(50000, 8.0), timeout=10)   # the pair works on
        assert (await p.recv(k, into=buf, timeout=10)) is buf and bool((buf == 8.0).all())


@pytest.mark.loop_timeout(30)
async def test_a_write_done_before_the_recv_stops_goes_to_the_next_recv_once(
        cluster: rvz.ClusterSpec, fabric: Fabric) -> None:
    """The answer lands and its completion waits in the queue as the recv is cancelled:
    the recv gets it, or the fence takes the completion and the next recv gets a copy."""
    async with learned_pair(cluster, "into-done") as (w, p, k, buf):
        recv = await offered(p, fabric, k, buf, timeout=10)
        await w.send(k, np.full(50000, 5.0))   # written at once by the fake device
        recv.cancel()
        try:
            got = await recv
        except asyncio.CancelledError:
            got = await p.recv(k, timeout=10)
            assert not np.shares_memory(got, buf)
        assert bool((got == 5.0).all())
        assert not registered(fabric, buf)
        await w.send(k, np.full(50000, 6.0))
        assert (await p.recv(k, timeout=10))[0] == 6.0   # nothing of the first value is left


@pytest.mark.loop_timeout(40)
async def test_a_completion_seen_only_after_the_fence_makes_the_value_come_again(
        cluster: rvz.ClusterSpec, fabric: Fabric, caplog: pytest.LogCaptureFixture) -> None:
    """The payload landed while the recv waited, but its completion shows only after the
    recv stopped: the buffer is the caller's by then, so the channel resets and the
    producer sends the value again, whole, to the next recv."""
    async with learned_pair(cluster, "into-late") as (w, p, k, buf):
        recv = await offered(p, fabric, k, buf, timeout=10)
        fabric.unseen = []
        await w.send(k, np.full(50000, 3.0))
        await eventually(lambda: bool(fabric.unseen), "the write landed, unseen")
        recv.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recv
        assert not registered(fabric, buf)
        buf[:] = -1                                    # the caller's again
        with caplog.at_level(logging.WARNING, "rvz"):
            fabric.deliver()
            got = await p.recv(k, timeout=10)
        assert any("had stopped waiting" in r.getMessage() for r in caplog.records)
        assert bool((got == 3.0).all()) and not np.shares_memory(got, buf)
        assert bool((buf == -1).all())
        await w.send(k, np.full(50000, 9.0), timeout=10)
        assert (await p.recv(k, timeout=10))[0] == 9.0


@pytest.mark.loop_timeout(30)
async def test_an_aborted_step_fences_its_recvs_buffer(cluster: rvz.ClusterSpec,
                                                       fabric: Fabric) -> None:
    async with learned_pair(cluster, "into-step") as (w, p, k, buf):
        recv = asyncio.ensure_future(p.step(5).recv(k, into=buf, timeout=10))
        await eventually(lambda: recv.done() or registered(fabric, buf), "the buffer is offered")
        await p.cleanup_step(5)
        with pytest.raises(rvz.Aborted):
            await recv
        assert not registered(fabric, buf)
        await w.send(k, np.full(50000, 2.0))
        assert (await p.recv(k, into=buf, timeout=10)) is buf and bool((buf == 2.0).all())


@pytest.mark.loop_timeout(30)
async def test_recv_many_into_copies_over_verbs(cluster: rvz.ClusterSpec, fabric: Fabric) -> None:
    """``recv_many``'s buffers are never offered: its requests get ordinary destinations
    at the end of the iteration, and the values are copied in."""
    async with pair(cluster, "recv", transport="verbs", onesided=OPTS) as (w, p):
        ka, kb = key("many-a"), key("many-b")
        await learned(w, p, ka, np.zeros(50000, np.float64))
        await learned(w, p, kb, np.zeros(50000, np.float64))
        a, b = np.zeros(50000, np.float64), np.zeros(50000, np.float64)
        recv = asyncio.ensure_future(p.recv_many([ka, kb], into=[a, b], timeout=10))
        await eventually(lambda: waiting_recvs(p) == 2, "the batch waits")
        assert not registered(fabric, a) and not registered(fabric, b)
        landed, copied = into_stats(p)
        await w.send_many([(ka, np.full(50000, 1.0)), (kb, np.full(50000, 2.0))])
        out = await recv
        assert out[0] is a and out[1] is b
        assert bool((a == 1.0).all()) and bool((b == 2.0).all())
        assert into_stats(p) == (landed, copied + a.nbytes + b.nbytes)
        plain = asyncio.ensure_future(p.recv(ka, timeout=10))   # a recv after it asks as ever
        await w.send(ka, np.full(50000, 3.0))
        assert (await plain)[0] == 3.0
