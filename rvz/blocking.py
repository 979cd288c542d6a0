"""``BlockingNode``: an ``rvz.Node`` for synchronous code (training loops, data-loader
workers, framework callbacks).

A BlockingNode owns one event-loop thread (a daemon named ``rvz-blocking <task name>``)
and the ``rvz.Node`` that runs on it.  Each call hands a coroutine of that node to the loop
and blocks the calling thread until it ends, so the semantics, timeouts and errors are the
node's own.  What this module owns is the hand-off between threads, the fail-safes that
keep a caller from waiting on a loop that is gone (closed, stopped, or left behind by a
fork), and the life cycle of the thread: started with the node, stopped by ``close()``,
by the ``atexit`` hook, or when the BlockingNode is collected unclosed.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Awaitable, Coroutine, Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, overload

from . import _impl
from .cluster import ClusterSpec
from .cluster import from_env as _cluster_from_env
from .errors import NodeClosed
from .node import Node
from .runner import new_event_loop
from .types import KeyLike, LoopName, Mode, NodeOptions, NodeStats, SendValue, Value

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger(__name__)
_Buffer = TypeVar("_Buffer")  # an into= buffer: recv returns the caller's own object

THREAD_PREFIX = "rvz-blocking "
"""Every BlockingNode's loop thread is named this, then the node's name."""

# How often a caller blocked on a call looks whether the loop thread is still alive: the
# thread fails its callers when it stops, this only backs that up.
_ALIVE_CHECK = 1.0
# How long a caller interrupted while it waited (KeyboardInterrupt) waits for the loop to
# finish cancelling its call, and ``close()`` for the loop thread to end.
_CANCEL_BOUND = 5.0
_JOIN_BOUND = 5.0
# At interpreter exit a node gets its linger plus this to close gracefully, then is aborted.
_EXIT_GRACE = 1.0

_allocate_lock = threading.Lock
_current_thread = threading.current_thread
_get_ident = threading.get_ident  # (only a hint: a dead thread's ident is reused)
_getpid = os.getpid
_CancelledError = asyncio.CancelledError
_Future = asyncio.Future

# This process's id, which every call compares with its node's: read here, not with
# ``os.getpid()`` (a system call on every call), and refreshed in a child forked from here.
_pid = _getpid()


def _forked() -> None:
    global _pid
    _pid = _getpid()


if hasattr(os, "register_at_fork"):  # (no fork, no child to tell)
    os.register_at_fork(after_in_child=_forked)


class _Call:
    """One call handed to the loop: the coroutine (or function) to run, and how it ended.
    ``done`` is held until then; only the loop thread sets the outcome and releases it."""

    __slots__ = ("done", "work", "eager", "task", "waiting", "cancelling", "result", "error",
                 "started", "finished", "interrupted")

    def __init__(self, work: Any, eager: bool) -> None:
        self.done = done = _allocate_lock()
        done.acquire()
        self.work = work  # a coroutine, or a function of no arguments
        self.eager = eager  # a coroutine driven without a task (``_LoopThread.advance``)
        self.task: asyncio.Task[None] | None = None
        self.waiting: asyncio.Future[Any] | None = None  # what a driven coroutine awaits
        self.cancelling = False  # a driven coroutine gets CancelledError at its next step
        self.result: Any = None
        self.error: BaseException | None = None
        self.started = False
        self.finished = False
        self.interrupted = False  # the caller gave up on it (``_LoopThread.interrupt``)


class _LoopThread:
    """The loop thread and every call in flight on it.  It holds the node, not the
    BlockingNode, so that an unclosed BlockingNode can be collected (and warn)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, node: Node) -> None:
        self.loop = loop
        self.node = node
        self.lock = _allocate_lock()  # orders each hand-off against the thread's stop
        self.calls: set[_Call] = set()
        # Calls handed over and not yet begun, and whether a ``drain`` of them is on its way:
        # callers that come while it is wake the loop no more (one write to its wake-up
        # pipe, one callback, for a burst of calls from many threads).
        self.queue: list[_Call] = []
        self.draining = False
        self.stopped = False  # no call handed over from now on runs
        self.cause: BaseException | None = None  # why the loop stopped, if it failed
        self.thread = threading.Thread(target=self.run, name=THREAD_PREFIX + node.name,
                                       daemon=True)
        self.ident: int | None = None  # the thread's, once started
        self.pid = _pid  # the process the thread runs in

    # -- the loop thread ---------------------------------------------------------------------

    def run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        except BaseException as exc:  # a callback raised SystemExit, say: the loop is gone
            self.cause = exc
            log.error("the event loop of %s stopped on an error", self.node.name, exc_info=exc)
        finally:
            try:
                self.shut_down()
            finally:
                with self.lock:
                    self.stopped = True
                    left, self.calls = self.calls, set()
                for call in left:
                    if not call.started and asyncio.iscoroutine(call.work):
                        call.work.close()  # never ran: nothing to undo, no "never awaited"
                    self.finish(call, None, self.closed_error())
                asyncio.set_event_loop(None)
                loop.close()

    def shut_down(self) -> None:
        """What ``run_forever`` left: a node still open (the loop failed) is aborted, then
        the tasks still pending are cancelled and run to their end."""
        loop = self.loop
        node = self.node
        try:
            if node.state in ("running", "closing"):
                loop.run_until_complete(_abort(node, self.closed_error()))
            for call in list(self.calls):
                if call.waiting is not None:  # a driven call: cancelled here and now
                    call.cancelling = True
                    self.advance(call, call.waiting)
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks, timeout=_CANCEL_BOUND))
            loop.run_until_complete(loop.shutdown_asyncgens())
        except BaseException as exc:
            log.error("%s: its event loop did not shut down cleanly", node.name, exc_info=exc)

    def drain(self) -> None:
        """On the loop: begin the calls handed over since the last drain, in their order."""
        with self.lock:
            calls, self.queue = self.queue, []
            self.draining = False
        for call in calls:
            self.begin(call)

    def begin(self, call: _Call) -> None:
        """On the loop: run a function call at once, or start a coroutine."""
        work = call.work
        if call.eager:
            call.started = True
            # ``send`` and ``recv``: their first step runs here, and a call that completes
            # without suspending (a value already queued, a send that fits) costs no task
            # and no second pass of the loop.  One that suspends is driven on from the
            # callbacks of what it awaits (``advance``), still without a task.
            try:
                awaited = work.send(None)
            except StopIteration as stop:
                self.finish(call, stop.value, None)
            except BaseException as exc:
                self.finish(call, None, exc)
            else:
                self.wait(call, awaited)
        elif callable(work):  # (a coroutine is not)
            call.started = True
            try:
                result = work()
            except BaseException as exc:
                self.finish(call, None, exc)
            else:
                self.finish(call, result, None)
        else:
            self.in_task(call, work)

    def in_task(self, call: _Call, coro: Awaitable[Any]) -> None:
        """On the loop: drive ``call`` on in a task of its own (``drive``)."""
        call.task = task = self.loop.create_task(self.drive(call, coro))
        task.add_done_callback(functools.partial(self.task_ended, call))

    def task_ended(self, call: _Call, task: asyncio.Task[None]) -> None:
        """A task cancelled before its first step never ran ``drive``: its caller learns
        it here, and is not left waiting for a call that will never end."""
        if not call.finished:
            if not call.started and asyncio.iscoroutine(call.work):
                call.work.close()
            self.finish(call, None, self.cancelled(call, _CancelledError()))

    def wait(self, call: _Call, awaited: Any) -> None:
        """A driven coroutine awaits ``awaited``: a future of this loop wakes it by its
        done-callback, as it would wake a task; anything else goes on in a task."""
        if isinstance(awaited, _Future) and awaited._asyncio_future_blocking and (
                awaited.get_loop() is self.loop):
            awaited._asyncio_future_blocking = False
            call.waiting = awaited
            awaited.add_done_callback(functools.partial(self.advance, call))
        else:
            self.in_task(call, _Resumed(call.work, awaited))

    def advance(self, call: _Call, awaited: Any) -> None:
        """On the loop: what a driven coroutine awaited is done: its next step (with
        ``CancelledError`` thrown in if it was cancelled meanwhile, as a task does)."""
        if call.waiting is not awaited:
            return  # it went on without this (``shut_down``)
        call.waiting = None
        try:
            if call.cancelling:
                call.cancelling = False
                awaited = call.work.throw(_CancelledError())
            else:
                awaited = call.work.send(None)
        except StopIteration as stop:
            self.finish(call, stop.value, None)
        except _CancelledError as exc:
            self.finish(call, None, self.cancelled(call, exc))
        except BaseException as exc:
            self.finish(call, None, exc)
        else:
            self.wait(call, awaited)

    async def drive(self, call: _Call, coro: Awaitable[Any]) -> None:
        # The caller is released from here, not from a done-callback of the task: that
        # would cost one more pass of the loop on every call.
        call.started = True
        try:
            result = await coro
        except asyncio.CancelledError as exc:
            self.finish(call, None, self.cancelled(call, exc))
        except BaseException as exc:  # the node's error, as it raised it, to the caller
            self.finish(call, None, exc)
        else:
            self.finish(call, result, None)

    def cancelled(self, call: _Call, exc: BaseException) -> BaseException:
        """What a cancelled call raises in its caller: the cancellation when the caller
        interrupted it (only an interrupted caller cancels its call), else the loop is
        shutting down and the node is closed."""
        return exc if call.interrupted else self.closed_error()

    def finish(self, call: _Call, result: Any, error: BaseException | None) -> None:
        if call.finished:
            return
        call.finished = True
        call.result = result
        call.error = error
        self.calls.discard(call)
        call.done.release()

    def cancel(self, call: _Call) -> None:
        """On the loop: the caller gave up.  The call is cancelled as an awaiting task
        would be, so a recv gives back a value it had taken."""
        call.interrupted = True
        if call.waiting is not None:
            # As ``Task.cancel``: cancel what it awaits, or, if that is done already (its
            # callback is on its way), throw the cancellation in at the next step.
            if not call.waiting.cancel():
                call.cancelling = True
        elif call.task is not None:
            call.task.cancel()  # (``task_ended`` tells the caller if it never ran)
        elif not call.started and not call.finished:
            # Interrupted while it was handed over, before it was queued: it never runs.
            # (A queued call has begun by now: its drain was scheduled before this.)
            if asyncio.iscoroutine(call.work):
                call.work.close()
            self.finish(call, None, _CancelledError())

    def closed_error(self) -> NodeClosed:
        if self.cause is not None:
            err = NodeClosed(f"node {self.node.name} is closed: its event loop stopped on "
                             f"{self.cause!r}")
        else:
            err = NodeClosed(f"node {self.node.name} is closed")
        err.__cause__ = self.cause
        return err

    # -- the calling threads -----------------------------------------------------------------

    def call(self, work: Any, timeout: float | None = None, eager: bool = False) -> Any:
        """Run ``work`` (a coroutine of the node, or a function) on the loop and return its
        result or raise its error.  ``timeout`` (for ``close``) bounds the wait: past it the
        call is cancelled and ``TimeoutError`` raised."""
        if _pid != self.pid or (_get_ident() == self.ident and _current_thread() is self.thread):
            self.refuse(work)
        call = _Call(work, eager)
        done = call.done
        try:
            # The hand-over is inside ``try``: an interrupt at any point of it leaves no
            # call running without its caller (``interrupt``, ``cancel``).
            with self.lock:
                if self.stopped:
                    if asyncio.iscoroutine(work):
                        work.close()
                    raise self.closed_error()
                self.calls.add(call)
                if not self.draining:
                    self.loop.call_soon_threadsafe(self.drain)
                    self.draining = True
                self.queue.append(call)
            if timeout is not None:
                if not done.acquire(True, timeout):
                    raise TimeoutError(f"{self.node.name}: the call took over {timeout}s")
            else:
                while not done.acquire(True, _ALIVE_CHECK):
                    if not self.thread.is_alive() and not call.finished:
                        raise self.closed_error()
        except BaseException:
            # KeyboardInterrupt (or the bound above): the call must not go on without us.
            self.interrupt(call)
            raise
        error = call.error
        if error is not None:
            call.error = None
            try:
                raise error
            finally:
                error = None
        return call.result

    def refuse(self, work: Any) -> NoReturn:
        """A call from where it would never end: a forked child, or the loop's own thread."""
        if asyncio.iscoroutine(work):
            work.close()
        name = self.node.name
        if _pid != self.pid:
            raise RuntimeError(
                f"BlockingNode {name} was made in process {self.pid}, and this process "
                f"({_pid}) is a child forked from it: its event-loop thread is not here; "
                "make a BlockingNode of its own in the child")
        raise RuntimeError(
            f"BlockingNode {name} was called from its own event loop's thread, where a "
            "blocking call would wait for itself: on the loop, await the async node "
            "(`await blocking.node.recv(...)`) instead")

    def interrupt(self, call: _Call) -> None:
        """Cancel ``call`` on the loop and wait (bounded) until the cancellation is over:
        a recv cancelled gives its value back before this returns."""
        if call.finished:
            return
        with self.lock:
            if self.stopped or call not in self.calls:  # (never handed over)
                return
            self.loop.call_soon_threadsafe(self.cancel, call)
        if call.done.acquire(timeout=_CANCEL_BOUND):
            return
        log.warning("%s: a cancelled call did not end within %ss", self.node.name, _CANCEL_BOUND)

    def stop(self) -> None:
        """Stop the loop and join the thread (bounded); the thread closes the loop."""
        with self.lock:
            if not self.stopped:  # (the thread closes the loop only once this is set)
                self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread.ident is not None:
            self.thread.join(_JOIN_BOUND)
        if self.thread.is_alive():
            log.warning("%s: its event-loop thread did not end within %ss (a callback "
                        "blocks the loop?)", self.node.name, _JOIN_BOUND)
        elif not self.loop.is_closed():
            self.loop.close()  # the thread never ran

    def stop_soon(self) -> None:
        """Stop the loop without waiting (``__del__``); the loop's shut-down aborts the
        node.  No lock: a collection may run this in the middle of any code, ours too."""
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:
            pass  # the loop is closed already


class _Resumed:
    """A coroutine whose first steps ran outside a task (``_LoopThread.wait``: it awaited
    something other than a future of its loop), awaited from where it stopped: the task
    awaits what the coroutine awaited, then passes each result, exception and cancellation
    on to it, as ``await`` does."""

    __slots__ = ("coro", "awaited")

    def __init__(self, coro: Coroutine[Any, Any, Any], awaited: Any) -> None:
        self.coro = coro
        self.awaited = awaited

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, awaited = self.coro, self.awaited
        self.awaited = None
        while True:
            try:
                sent = yield awaited
            except BaseException as exc:  # thrown in by the task: its cancellation
                try:
                    awaited = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    awaited = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _abort(node: Node, cause: BaseException) -> None:
    node.abort(cause)


async def _start(node: Node) -> None:
    await node.start()


# The BlockingNodes not yet closed, closed at interpreter exit (weakly: one dropped unclosed
# warns and stops its thread itself, ``BlockingNode.__del__``).
_live: weakref.WeakSet[BlockingNode] = weakref.WeakSet()


def _close_at_exit() -> None:
    for node in list(_live):
        try:
            node.close(timeout=node.node.linger + _EXIT_GRACE)
        except BaseException as exc:  # every node gets its close
            log.error("%s: close at exit failed", node.name, exc_info=exc)


atexit.register(_close_at_exit)


class BlockingNode:
    """An ``rvz.Node`` on an event-loop thread of its own, with calls that block:
    ``with BlockingNode(cluster, job, task, mode) as node: node.send(key, value)``.

    Takes ``rvz.Node``'s arguments (it documents each) and ``loop`` (``"auto"``,
    ``"uvloop"`` or ``"asyncio"``, see ``rvz.new_event_loop``); the node is started when
    the constructor returns.  Every call waits as the node's would, with the same
    ``timeout=`` and the same errors (the very exception the node raised).  Any number of
    threads may call at once.  A caller interrupted while it waits (KeyboardInterrupt)
    cancels its call on the loop and waits for the cancellation, so a recv gives its value
    back.  Calls fail with ``NodeClosed`` once the node is closed or its loop stopped, and
    with ``RuntimeError`` from the loop's own thread (they would wait for themselves) or
    from a forked child (the thread stayed in the parent).  ``close()`` closes gracefully
    and ends the thread; nodes left open are closed at interpreter exit.
    """

    @overload
    def __init__(self, cluster: ClusterSpec | dict[str, Any], job: str, task: int, mode: Mode, /,
                 *, loop: LoopName = "auto", **options: Unpack[NodeOptions]) -> None: ...

    @overload
    def __init__(self, cluster: ClusterSpec | dict[str, Any], job: str, task: int, *,
                 loop: LoopName = "auto", **options: Unpack[NodeOptions]) -> None: ...

    # (The overloads type ``mode`` given either way; this one takes both at run time.)
    def __init__(self, cluster: ClusterSpec | dict[str, Any], job: str,  # type: ignore[misc]
                 task: int, mode: Mode | None = None, *, loop: LoopName = "auto",
                 **options: Any) -> None:
        self._closed = True  # (until started: nothing to close, nothing to warn about)
        if mode is not None:
            options["mode"] = mode
        # Made here, so that a bad option fails before any thread starts; from now on only
        # the loop thread touches it.
        node = Node(cluster, job, task, **options)
        self.name = node.name
        self.address = node.address
        self._closing = _allocate_lock()
        self._runner = runner = _LoopThread(new_event_loop(loop), node)
        runner.thread.start()
        runner.ident = runner.thread.ident
        try:
            runner.call(_start(node))
        except BaseException:
            runner.stop()
            raise
        self._closed = False
        _live.add(self)

    @classmethod
    def from_env(cls, *, loop: LoopName = "auto", **options: Unpack[NodeOptions]) -> BlockingNode:
        """A BlockingNode for this process's task, from the environment as
        ``rvz.Node.from_env`` reads it; ``options`` are the other ``Node`` arguments."""
        cluster, job, task = _cluster_from_env()
        return cls(cluster, job, task, loop=loop, **options)

    # -- the calls ---------------------------------------------------------------------------

    def send(self, key: KeyLike, value: SendValue, *, mode: Mode | None = None, step: int = 0,
             timeout: float | None = None) -> None:
        """``rvz.Node.send``, blocking: returns once the value is queued."""
        runner = self._runner
        runner.call(runner.node.send(key, value, mode=mode, step=step, timeout=timeout), None, True)

    @overload
    def recv(self, key: KeyLike, *, mode: Mode | None = None, step: int = 0,
             timeout: float | None = None, into: None = None) -> Value: ...
    @overload
    def recv(self, key: KeyLike, *, mode: Mode | None = None, step: int = 0,
             timeout: float | None = None, into: _Buffer) -> _Buffer: ...
    def recv(self, key: KeyLike, *, mode: Mode | None = None, step: int = 0,
             timeout: float | None = None, into: Any = None) -> Any:
        """``rvz.Node.recv``, blocking: the next value of ``key`` (written into ``into``
        and that returned, when given; the loop thread writes it while the caller waits)."""
        runner = self._runner
        return runner.call(runner.node.recv(key, mode=mode, step=step, timeout=timeout,
                                            into=into), None, True)

    def send_many(self, items: Iterable[tuple[KeyLike, SendValue]], *, mode: Mode | None = None,
                  step: int = 0, timeout: float | None = None) -> None:
        """``rvz.Node.send_many``, blocking."""
        batch = list(items)  # here: the caller's iterator runs in the caller's thread
        self._runner.call(self._runner.node.send_many(batch, mode=mode, step=step, timeout=timeout))

    @overload
    def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None, step: int = 0,
                  timeout: float | None = None, into: None = None) -> list[Value]: ...
    @overload
    def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None, step: int = 0,
                  timeout: float | None = None, into: Sequence[Any | None]) -> list[Any]: ...
    def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None, step: int = 0,
                  timeout: float | None = None,
                  into: Sequence[Any | None] | None = None) -> list[Any]:
        """``rvz.Node.recv_many``, blocking: all or nothing, as there."""
        wanted = list(keys)
        values: list[Any] = self._runner.call(self._runner.node.recv_many(
            wanted, mode=mode, step=step, timeout=timeout, into=into))
        return values

    def step(self, step_id: int) -> BlockingStep:
        """A view of this node bound to one step id."""
        return BlockingStep(self, step_id)

    def new_step(self) -> BlockingStep:
        """``rvz.Node.new_step``: a step with a fresh random id."""
        step_id: int = self._runner.call(lambda: self._runner.node.new_step().id)
        return BlockingStep(self, step_id)

    def cleanup_step(self, step_id: int, message: str | None = None) -> None:
        """``rvz.Node.cleanup_step``: abort ``step_id`` here and on every node in it."""
        self._runner.call(self._runner.node.cleanup_step(step_id, message))

    def stats(self) -> NodeStats:
        """``rvz.Node.stats``, taken on the loop."""
        stats: NodeStats = self._runner.call(self._runner.node.stats)
        return stats

    def transport_for(self, peer: str | tuple[str, int]) -> str:
        """``rvz.Node.transport_for``."""
        name: str = self._runner.call(lambda: self._runner.node.transport_for(peer))
        return name

    # -- life cycle --------------------------------------------------------------------------

    @property
    def node(self) -> Node:
        """The ``rvz.Node`` itself, for code that runs on its loop (``loop``)."""
        return self._runner.node

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the node runs on, in this BlockingNode's thread."""
        return self._runner.loop

    @property
    def state(self) -> str:
        """The node's state: ``"running"``, ``"closing"`` or ``"closed"``."""
        if self._closed or self._runner.stopped:
            return "closed"
        return self._runner.node.state  # a str attribute: one atomic read

    def abort(self, exc: BaseException | None = None) -> None:
        """``rvz.Node.abort``: close the node at once; every pending and later call fails
        with ``NodeClosed`` whose ``__cause__`` is ``exc``.  ``close()`` still ends the
        thread."""
        if self._closed or self._runner.stopped or _pid != self._runner.pid:
            return
        node = self._runner.node
        try:
            self._runner.call(lambda: node.abort(exc))
        except NodeClosed:
            pass  # the loop stopped meanwhile: closed already

    def close(self, timeout: float | None = None) -> None:
        """Close the node gracefully on its loop (``rvz.Node.close``: deliver for at most
        ``linger`` seconds), then stop the loop and end its thread.

        ``timeout`` bounds the graceful part (default: the node's ``linger`` plus
        ``peer_timeout`` and a second, which a graceful close never exceeds); past it the
        node is aborted.  Idempotent, and it returns when the loop thread is gone already.
        In a forked child it does nothing: the node is the parent's.
        """
        if _pid != self._runner.pid:
            return
        runner = self._runner
        if _current_thread() is runner.thread:
            raise RuntimeError(f"BlockingNode {self.name}: close() from its own event loop's "
                               "thread would wait for itself; call node.abort() there")
        with self._closing:  # a second close() waits for the first
            if self._closed:
                return
            try:
                node = runner.node
                bound = timeout if timeout is not None else (
                    node.linger + node.peer_timeout + 1.0)
                try:
                    runner.call(node.close(), bound)
                except TimeoutError:
                    # The close was cancelled, and a cancelled close aborts the rest.
                    log.warning("%s: close() took over %ss: aborted", self.name, bound)
                except NodeClosed:
                    pass  # the loop stopped under it: the thread closed the node
            finally:
                self._closed = True
                _live.discard(self)
                runner.stop()

    def __enter__(self) -> BlockingNode:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # As ``async with rvz.Node``: an error aborts the node with it as the cause; an
        # interrupt (this world's cancellation) or a normal exit closes gracefully.
        if isinstance(exc, Exception):
            self.abort(exc)
        self.close()

    def __del__(self, _warn: Any = warnings.warn) -> None:
        if getattr(self, "_closed", True) or self._runner.pid != _pid:
            return
        _warn(f"unclosed BlockingNode {self.name} ({self.address}): use `with "
              "rvz.blocking.BlockingNode(...)` or call close()", ResourceWarning, source=self)
        # Its thread would otherwise run on with nobody to stop it; the loop's shut-down
        # aborts the node.
        self._runner.stop_soon()

    def __repr__(self) -> str:
        return f"<rvz.blocking.BlockingNode {self.name} at {self.address} {self.state}>"


class BlockingStep:
    """``node.step(42)`` of a BlockingNode: its calls scoped to one step, and its clean-up."""

    def __init__(self, node: BlockingNode, step_id: int) -> None:
        self.node = node
        self.id = _impl.steps.step_id(step_id)  # a bad id fails here, as ``rvz.Step``'s

    def send(self, key: KeyLike, value: SendValue, *, mode: Mode | None = None,
             timeout: float | None = None) -> None:
        """``BlockingNode.send`` on this step."""
        self.node.send(key, value, mode=mode, step=self.id, timeout=timeout)

    @overload
    def recv(self, key: KeyLike, *, mode: Mode | None = None,
             timeout: float | None = None, into: None = None) -> Value: ...
    @overload
    def recv(self, key: KeyLike, *, mode: Mode | None = None,
             timeout: float | None = None, into: _Buffer) -> _Buffer: ...
    def recv(self, key: KeyLike, *, mode: Mode | None = None,
             timeout: float | None = None, into: Any = None) -> Any:
        """``BlockingNode.recv`` on this step."""
        return self.node.recv(key, mode=mode, step=self.id, timeout=timeout, into=into)

    def send_many(self, items: Iterable[tuple[KeyLike, SendValue]], *,
                  mode: Mode | None = None, timeout: float | None = None) -> None:
        """``BlockingNode.send_many`` on this step."""
        self.node.send_many(items, mode=mode, step=self.id, timeout=timeout)

    @overload
    def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None,
                  timeout: float | None = None, into: None = None) -> list[Value]: ...
    @overload
    def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None,
                  timeout: float | None = None, into: Sequence[Any | None]) -> list[Any]: ...
    def recv_many(self, keys: Iterable[KeyLike], *, mode: Mode | None = None,
                  timeout: float | None = None,
                  into: Sequence[Any | None] | None = None) -> list[Any]:
        """``BlockingNode.recv_many`` on this step."""
        return self.node.recv_many(keys, mode=mode, step=self.id, timeout=timeout, into=into)

    def cleanup(self, message: str | None = None) -> None:
        """Abort this step here and on every node that took part in it."""
        self.node.cleanup_step(self.id, message)

    def __repr__(self) -> str:
        return f"<BlockingStep {self.id} of {self.node.name}>"


__all__ = ["BlockingNode", "BlockingStep", "THREAD_PREFIX"]

