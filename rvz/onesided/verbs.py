"""The RDMA verbs provider, on pyverbs (the optional extra ``rdma``, imported lazily).

* Memory: pool chunks are anonymous mappings registered as memory regions with local and
  remote write access (``ibv_reg_mr``), after checking ``RLIMIT_MEMLOCK``.
* Endpoints: one RC queue pair per TCP connection.  ``info()`` carries its QP number, PSN,
  LID, GID and MTU in the HELLO; ``connect()`` moves it through INIT -> RTR -> RTS.
  Each endpoint keeps ``recv_depth`` receive buffers posted (the message buffers of the
  channel: inline values arrive in them, and every RDMA WRITE WITH IMMEDIATE consumes one)
  and reposts each as soon as its completion is handled; ``rnr_retry=7`` makes a sender
  wait instead of failing if the receiver is momentarily out of buffers.
* Writes: ``IBV_WR_RDMA_WRITE_WITH_IMM`` with one SGE per source (the engine stages
  sources that are not in registered memory); sends: ``IBV_WR_SEND`` from a registered
  send buffer.  At most ``send_depth`` work requests are outstanding; more wait in order.
* Completion queues: one ``CompChannel`` per CQ; its file descriptor (non-blocking) is
  watched by the event loop.  On readiness: ``get_cq_event``, ``ack_events``,
  ``req_notify`` (re-arm), then ``poll`` until empty, so no completion is missed.
  A completion with an error status fails its endpoint (``TransportError``), never the
  process.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import select
from collections import deque
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..errors import TransportError
from .memlock import check_memlock
from .provider import FAILED, RECV_MSG, RECV_WRITE, SEND_DONE, Region, Source

MSG_SIZE = 4096
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)

# Numeric values from <infiniband/verbs.h>, used when a pyverbs build lacks a name.
_WC_STATUS = {0: "SUCCESS", 1: "LOC_LEN_ERR", 2: "LOC_QP_OP_ERR", 3: "LOC_EEC_OP_ERR",
              4: "LOC_PROT_ERR", 5: "WR_FLUSH_ERR", 6: "MW_BIND_ERR", 7: "BAD_RESP_ERR",
              8: "LOC_ACCESS_ERR", 9: "REM_INV_REQ_ERR", 10: "REM_ACCESS_ERR", 11: "REM_OP_ERR",
              12: "RETRY_EXC_ERR", 13: "RNR_RETRY_EXC_ERR", 14: "LOC_RDD_VIOL_ERR",
              15: "REM_INV_RD_REQ_ERR", 16: "REM_ABORT_ERR", 17: "INV_EECN_ERR",
              18: "INV_EEC_STATE_ERR", 19: "FATAL_ERR", 20: "RESP_TIMEOUT_ERR", 21: "GENERAL_ERR"}
_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
LINK_LAYER_ETHERNET = 2

INSTALL_HINT = ("install pyverbs built for this host's rdma-core (see docs/rdma.md): the "
                "distribution's python3-pyverbs for its system Python, or `pip install "
                "'rvz[rdma]'` when the PyPI pyverbs matches the installed rdma-core")


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs modules rvz uses, or ``TransportError`` saying why they cannot load."""
    try:
        import pyverbs.addr as addr
        import pyverbs.cq as cq
        import pyverbs.device as device
        import pyverbs.mr as mr
        import pyverbs.pd as pd
        import pyverbs.qp as qp
        import pyverbs.wr as wr
        try:
            import pyverbs.enums as enums
        except ImportError:
            import pyverbs.libibverbs_enums as enums  # older pyverbs
    except ImportError as exc:
        raise TransportError(f"no pyverbs: {exc}; {INSTALL_HINT}") from exc
    except Exception as exc:  # a pyverbs built for another rdma-core fails oddly at import
        raise TransportError(f"pyverbs does not load: {exc!r}; {INSTALL_HINT}") from exc
    return SimpleNamespace(addr=addr, cq=cq, device=device, mr=mr, pd=pd, qp=qp, wr=wr, e=enums)


def _name(dev: Any) -> str:
    name = getattr(dev, "name", dev)
    return name.decode() if isinstance(name, bytes) else str(name)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8, 1).__array_interface__["data"][0])


def _fds() -> set[int]:
    """The open file descriptors (less the one listing /proc/self/fd used and closed)."""
    fds = set()
    for n in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(n))
        except OSError:
            continue
        fds.add(int(n))
    return fds


def _gid_is_zero(gid: Any) -> bool:
    text = str(getattr(gid, "gid", gid))
    return all(c in "0:" for c in text)


class VerbsProvider:
    name = "verbs"
    needs_registered_source = True
    max_message = MSG_SIZE
    tcp_max = -1  # every value one-sided: not measured on a NIC yet (Options.tcp_max sets it)
    answer_tcp_max = MSG_SIZE  # (with tcp_max set: answers up to one message stay on TCP)
    registers_private = True   # a recv's into= buffer can be registered as a destination

    def __init__(self, loop: asyncio.AbstractEventLoop, device: str | None = None, port: int = 1,
                 gid_index: int | None = None, recv_depth: int = 256, send_depth: int = 256,
                 cq_depth: int | None = None, pyverbs: Any = None) -> None:
        if device is not None and (not isinstance(device, str) or not device):
            raise ValueError(f"device must be an RDMA device name like 'mlx5_0', not {device!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 255:
            raise ValueError(f"port must be an int in 1..255, not {port!r}")
        if gid_index is not None and (not isinstance(gid_index, int) or gid_index < 0):
            raise ValueError(f"gid_index must be None or an int >= 0, not {gid_index!r}")
        for what, depth in (("recv_depth", recv_depth), ("send_depth", send_depth)):
            if not isinstance(depth, int) or not 1 <= depth <= 65536:
                raise ValueError(f"{what} must be an int in 1..65536, not {depth!r}")
        self.loop = loop
        self.device = device
        self.port = port
        self.gid_index = gid_index
        self.recv_depth = recv_depth
        self.send_depth = send_depth
        self.cq_depth = cq_depth or 4 * (recv_depth + send_depth)
        self._pyverbs = pyverbs
        self.pv: Any = None
        self.ctx: Any = None
        self.pd: Any = None
        self.registered = 0
        self.lid = 0
        self.gid = ""
        self.mtu = 0
        self.device_name = ""
        self.opened = False

    # -- set-up ------------------------------------------------------------------------------

    def open(self) -> None:
        """Find the device and port; ``TransportError`` names what is missing."""
        pv = self.pv = self._pyverbs if self._pyverbs is not None else load_pyverbs()
        e = pv.e
        try:
            devices = list(pv.device.get_device_list())
        except Exception as exc:
            raise TransportError(f"no RDMA device: listing devices failed ({exc!r})") from exc
        if not devices:
            raise TransportError(
                "no RDMA device: ibv_get_device_list() found none (no RDMA NIC, or its kernel "
                "driver / InfiniBand support is not loaded; for soft-RoCE: `rdma link add rxe0 "
                "type rxe netdev <interface>`)")
        names = [_name(d) for d in devices]
        if self.device is not None and self.device not in names:
            raise TransportError(f"no RDMA device named {self.device!r}; found {names}")
        name = self.device or names[0]
        try:
            self.ctx = pv.device.Context(name=name)
        except Exception as exc:
            raise TransportError(f"cannot open RDMA device {name}: {exc!r}") from exc
        try:
            port = self.ctx.query_port(self.port)
        except Exception as exc:
            raise TransportError(f"RDMA device {name} has no port {self.port}: {exc!r}") from exc
        active = getattr(e, "IBV_PORT_ACTIVE", 4)
        if port.state != active:
            state = _PORT_STATES.get(int(port.state), str(port.state))
            raise TransportError(f"port {self.port} of RDMA device {name} is down (state {state}); "
                                 "check the cable/link with `ibv_devinfo` or `rdma link`")
        self.lid = int(getattr(port, "lid", 0))
        self.mtu = int(port.active_mtu)
        ethernet = int(getattr(port, "link_layer", 1)) == LINK_LAYER_ETHERNET
        self.gid = self._pick_gid(name, ethernet, int(getattr(port, "gid_tbl_len", 16) or 16))
        self.pd = pv.pd.PD(self.ctx)
        self.device_name = name
        self.opened = True

    def _pick_gid(self, name: str, ethernet: bool, table: int) -> str:
        if self.gid_index is not None:
            try:
                gid = self.ctx.query_gid(self.port, self.gid_index)
            except Exception as exc:
                raise TransportError(f"GID index {self.gid_index} of {name} port {self.port} "
                                     f"cannot be read: {exc!r}") from exc
            return str(getattr(gid, "gid", gid))
        if not ethernet:
            return ""  # InfiniBand: route by LID
        for index in range(table):
            try:
                gid = self.ctx.query_gid(self.port, index)
            except Exception:
                continue
            if not _gid_is_zero(gid):
                self.gid_index = index
                return str(getattr(gid, "gid", gid))
        raise TransportError(f"RoCE port {self.port} of {name} has no GID (is an IP address "
                             "configured on its interface?)")

    def host_info(self) -> dict[str, Any]:
        return {}

    def access(self) -> int:
        e = self.pv.e
        return int(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)

    def register(self, length: int) -> Region:
        if not self.opened:
            raise TransportError("the verbs provider is not open")
        check_memlock(self.registered, length, "rvz's registered pool")
        try:
            mm = mmap.mmap(-1, length, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise TransportError(f"cannot allocate {length} bytes for RDMA registration: {exc}") from exc
        view = memoryview(mm)
        addr = _address(view)
        try:
            mr = self.pv.mr.MR(self.pd, length, self.access(), address=addr)
        except Exception as exc:
            view.release()
            mm.close()
            raise TransportError(f"ibv_reg_mr of {length} bytes on {self.device_name} failed: {exc!r} "
                                 "(pinned memory counts against RLIMIT_MEMLOCK, `ulimit -l`)") from exc
        self.registered += length
        return Region(int(mr.rkey), int(mr.lkey), addr, length, view, handle=(mm, mr))

    def register_memory(self, addr: int, length: int) -> Region:
        """A recv's buffer (memory of the process's own), registered for the peer to write."""
        if not self.opened:
            raise TransportError("the verbs provider is not open")
        check_memlock(self.registered, length, "a recv's into= buffer")
        try:
            mr = self.pv.mr.MR(self.pd, length, self.access(), address=addr)
        except Exception as exc:
            raise TransportError(f"ibv_reg_mr of a buffer of {length} bytes failed: {exc!r}") from exc
        self.registered += length
        return Region(int(mr.rkey), int(mr.lkey), addr, length, memoryview(b""), handle=(None, mr))

    def deregister(self, region: Region) -> None:
        mm, mr = region.handle
        mr.close()
        region.view.release()
        if mm is not None:
            mm.close()
        self.registered -= region.length

    def create_cq(self) -> VerbsCQ:
        return VerbsCQ(self)

    def create_endpoint(self, cq: VerbsCQ, ep_id: int) -> VerbsEndpoint:
        return VerbsEndpoint(self, cq, ep_id)

    def close(self) -> None:
        for obj in (self.pd, self.ctx):
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    pass
        self.pd = self.ctx = None
        self.opened = False


def find_channel_fd(channel: Any, before: set[int]) -> int:
    """The file descriptor of a pyverbs ``CompChannel`` (pyverbs does not expose it)."""
    fd = getattr(channel, "fd", None)
    if isinstance(fd, int) and fd >= 0:
        return fd
    new = sorted(_fds() - before)
    events = []
    for n in new:
        try:
            if "infinibandevent" in os.readlink(f"/proc/self/fd/{n}"):
                events.append(n)
        except OSError:
            pass
    if len(events) == 1:
        return events[0]
    if len(new) == 1:
        return new[0]
    raise TransportError(f"cannot tell the completion channel's file descriptor among {new}")


class VerbsCQ:
    """A CQ with its own completion channel, whose fd the event loop watches."""

    def __init__(self, provider: VerbsProvider) -> None:
        pv = provider.pv
        self.provider = provider
        self.eps: dict[int, VerbsEndpoint] = {}   # qp_num -> endpoint
        before = _fds()
        try:
            self.channel = pv.cq.CompChannel(provider.ctx)
            self.fd = find_channel_fd(self.channel, before)
            os.set_blocking(self.fd, False)
            self.cq = pv.cq.CQ(provider.ctx, provider.cq_depth, None, self.channel, 0)
            self.cq.req_notify()
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"cannot create a completion queue on {provider.device_name}: "
                                 f"{exc!r}") from exc
        self._poller = select.poll()
        self._poller.register(self.fd, select.POLLIN)
        self.closed = False

    def poll(self) -> list[tuple[Any, ...]]:
        if self.closed:
            return []
        e = self.provider.pv.e
        if self._poller.poll(0):
            self.channel.get_cq_event(self.cq)
            self.cq.ack_events(1)
        self.cq.req_notify()  # re-arm before polling: a completion after this raises an event
        out: list[tuple[Any, ...]] = []
        success = getattr(e, "IBV_WC_SUCCESS", 0)
        recv = getattr(e, "IBV_WC_RECV", 128)
        recv_imm = getattr(e, "IBV_WC_RECV_RDMA_WITH_IMM", 129)
        while True:
            n, wcs = self.cq.poll(64)
            for wc in wcs:
                ep = self.eps.get(int(wc.qp_num))
                if ep is None:
                    continue
                out.extend(ep.completion(wc, success, recv, recv_imm))
            if n < 64:
                break
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for obj in (self.cq, self.channel):
            try:
                obj.close()
            except Exception:
                pass


class VerbsEndpoint:
    """One RC queue pair and its message buffers."""

    def __init__(self, provider: VerbsProvider, cq: VerbsCQ, ep_id: int) -> None:
        pv = provider.pv
        e = pv.e
        self.provider = provider
        self.pv = pv
        self.cq = cq
        self.ep_id = ep_id
        self.on_error: Any = None
        self.closed = False
        self.failed = False
        self.psn = random.getrandbits(24)
        self.recv_depth = provider.recv_depth
        self.send_depth = provider.send_depth
        self._outstanding = 0
        self._queue: deque[Any] = deque()
        self._send_free = list(range(self.send_depth))
        self._send_by_wr: dict[int, int] = {}
        self._send_waiting: deque[tuple[list[Any], int]] = deque()
        self.bufs = provider.register((self.recv_depth + self.send_depth) * MSG_SIZE)
        try:
            cap = pv.qp.QPCap(max_send_wr=self.send_depth, max_recv_wr=self.recv_depth,
                              max_send_sge=2, max_recv_sge=1)
            init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq.cq, rcq=cq.cq, cap=cap, sq_sig_all=1)
            self.qp = pv.qp.QP(provider.pd, init)
            attr = pv.qp.QPAttr()
            attr.port_num = provider.port
            attr.pkey_index = 0
            attr.qp_access_flags = provider.access()
            self.qp.to_init(attr)
            self.qpn = int(self.qp.qp_num)
            cq.eps[self.qpn] = self
            for i in range(self.recv_depth):
                self._post_recv(i)
        except TransportError:
            provider.deregister(self.bufs)
            raise
        except Exception as exc:
            provider.deregister(self.bufs)
            raise TransportError(f"cannot create an RC queue pair on {provider.device_name}: "
                                 f"{exc!r}") from exc

    def info(self) -> dict[str, Any]:
        p = self.provider
        return {"qpn": self.qpn, "psn": self.psn, "lid": p.lid, "gid": p.gid, "mtu": p.mtu,
                "gidx": p.gid_index if p.gid_index is not None else 0}

    def connect(self, remote: dict[str, Any]) -> None:
        pv = self.pv
        p = self.provider
        try:
            qpn, psn = int(remote["qpn"]), int(remote["psn"])
            lid, gid, mtu = int(remote["lid"]), str(remote["gid"]), int(remote["mtu"])
        except (KeyError, TypeError, ValueError):
            raise TransportError(f"verbs: malformed endpoint info from the peer: {remote!r}") from None
        if bool(gid) != bool(p.gid):
            raise TransportError("verbs: one side routes by GID (RoCE) and the other by LID "
                                 "(InfiniBand): the two ports are not on one fabric")
        try:
            attr = pv.qp.QPAttr()
            attr.path_mtu = min(mtu, p.mtu)
            attr.dest_qp_num = qpn
            attr.rq_psn = psn
            attr.max_dest_rd_atomic = 1
            attr.min_rnr_timer = 12
            if gid:
                route = pv.addr.GlobalRoute(dgid=pv.addr.GID(gid), sgid_index=p.gid_index or 0,
                                            hop_limit=64)
                attr.ah_attr = pv.addr.AHAttr(port_num=p.port, is_global=1, gr=route, dlid=lid)
            else:
                attr.ah_attr = pv.addr.AHAttr(port_num=p.port, dlid=lid)
            self.qp.to_rtr(attr)
            attr.timeout = 14
            attr.retry_cnt = 7
            attr.rnr_retry = 7      # receiver out of buffers: retry forever, never fail
            attr.sq_psn = self.psn
            attr.max_rd_atomic = 1
            self.qp.to_rts(attr)
        except Exception as exc:
            raise TransportError(f"verbs: cannot connect QP {self.qpn} to the peer's QP {qpn}: "
                                 f"{exc!r}") from exc

    def add_region(self, desc: dict[str, Any]) -> None:
        int(desc["rk"])  # nothing to map: the address and rkey travel with each slot

    def remove_region(self, rkey: int) -> None:
        """The peer deregistered a region: nothing to unmap here (its rkey is dead)."""

    # -- posting -----------------------------------------------------------------------------

    def _post_recv(self, i: int) -> None:
        pv = self.pv
        sge = pv.wr.SGE(self.bufs.addr + i * MSG_SIZE, MSG_SIZE, self.bufs.lkey)
        self.qp.post_recv(pv.wr.RecvWR(wr_id=i, num_sge=1, sg=[sge]))

    def _post(self, wr: Any) -> None:
        if self._outstanding >= self.send_depth:
            self._queue.append(wr)
            return
        try:
            self.qp.post_send(wr)
        except Exception as exc:
            raise TransportError(f"verbs: post_send on QP {self.qpn} failed: {exc!r}") from exc
        self._outstanding += 1

    def write(self, sources: list[Source], remote_addr: int, rkey: int, imm: int, wr_id: int) -> bool:
        return self._rdma(sources, remote_addr, rkey, wr_id, imm)

    def write_plain(self, sources: list[Source], remote_addr: int, rkey: int, wr_id: int) -> bool:
        """An RDMA WRITE without an immediate (the payload of an answer into a recv's buffer,
        followed by its trailer's write with the immediate)."""
        return self._rdma(sources, remote_addr, rkey, wr_id, None)

    def _rdma(self, sources: list[Source], remote_addr: int, rkey: int, wr_id: int,
              imm: int | None) -> bool:
        if self.closed or self.failed:
            raise TransportError(f"verbs QP {self.qpn} is closed")
        pv = self.pv
        sges = [pv.wr.SGE(addr, src.nbytes, lkey) for src, addr, lkey in sources if src.nbytes]
        if not sges:
            sges = [pv.wr.SGE(self.bufs.addr, 0, self.bufs.lkey)]
        if imm is None:
            wr = pv.wr.SendWR(wr_id=wr_id, opcode=getattr(pv.e, "IBV_WR_RDMA_WRITE", 0),
                              num_sge=len(sges), sg=sges)
        else:
            wr = pv.wr.SendWR(wr_id=wr_id, opcode=pv.e.IBV_WR_RDMA_WRITE_WITH_IMM,
                              num_sge=len(sges), sg=sges, imm_data=imm)
        wr.set_wr_rdma(rkey, remote_addr)
        self._post(wr)
        return False

    def send(self, parts: list[Any], wr_id: int) -> bool:
        if self.closed or self.failed:
            raise TransportError(f"verbs QP {self.qpn} is closed")
        if not self._send_free:
            self._send_waiting.append((list(parts), wr_id))
            return False
        self._send_now(parts, wr_id)
        return False

    def _send_now(self, parts: list[Any], wr_id: int) -> None:
        i = self._send_free.pop()
        base = (self.recv_depth + i) * MSG_SIZE
        off = base
        view = self.bufs.view
        for part in parts:
            n = len(part)
            if off + n > base + MSG_SIZE:
                self._send_free.append(i)
                raise ValueError(f"message exceeds {MSG_SIZE} bytes")
            view[off:off + n] = part
            off += n
        pv = self.pv
        sge = pv.wr.SGE(self.bufs.addr + base, off - base, self.bufs.lkey)
        self._send_by_wr[wr_id] = i
        self._post(pv.wr.SendWR(wr_id=wr_id, opcode=pv.e.IBV_WR_SEND, num_sge=1, sg=[sge]))

    def pending(self) -> bool:
        return bool(self._outstanding or self._queue or self._send_waiting)

    # -- completions -------------------------------------------------------------------------

    def completion(self, wc: Any, success: int, recv: int, recv_imm: int) -> list[tuple[Any, ...]]:
        status = int(wc.status)
        opcode = int(wc.opcode)
        if status != success:
            if self.failed:
                return []
            self.failed = True
            name = _WC_STATUS.get(status, str(status))
            return [(FAILED, self.ep_id, f"work completion failed on QP {self.qpn}: {name} "
                                         f"(opcode {opcode}, vendor error {getattr(wc, 'vendor_err', 0)})")]
        if opcode == recv_imm or opcode == recv:
            i = int(wc.wr_id)
            n = int(wc.byte_len)
            if opcode == recv:
                start = i * MSG_SIZE
                out: tuple[Any, ...] = (RECV_MSG, self.ep_id, bytes(self.bufs.view[start:start + n]))
            else:
                out = (RECV_WRITE, self.ep_id, int(wc.imm_data), n)
            if not self.closed:
                self._post_recv(i)
            return [out]
        # a send or write of ours finished
        wr_id = int(wc.wr_id)
        self._outstanding -= 1
        i = self._send_by_wr.pop(wr_id, -1)
        if i >= 0:
            self._send_free.append(i)
        while self._queue and self._outstanding < self.send_depth:
            wr = self._queue.popleft()
            self.qp.post_send(wr)
            self._outstanding += 1
        while self._send_waiting and self._send_free:
            parts, waiting_id = self._send_waiting.popleft()
            self._send_now(parts, waiting_id)
        return [(SEND_DONE, self.ep_id, wr_id)]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.cq.eps.pop(getattr(self, "qpn", -1), None)
        try:
            self.qp.close()
        except Exception:
            pass
        self.provider.deregister(self.bufs)
