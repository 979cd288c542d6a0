"""Small helpers shared by the examples: running coroutines together, picking free ports,
logging, and the launchers' signal handling."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import ssl
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import rvz


class ChildCancelled(RuntimeError):
    """A coroutine of ``run_together`` ended cancelled although nobody cancelled the call."""


async def run_together(*coros: Coroutine[Any, Any, Any]) -> list[Any]:
    """Run ``coros`` concurrently; the first failure cancels the others and is raised.

    ``asyncio.gather`` would let the siblings of a failed task run on (and hang on keys the
    failed one will never send); ``TaskGroup`` would do this but needs Python 3.11.  A child
    that ends cancelled while this call runs is a failure too (``ChildCancelled``): nothing
    here cancels one, so something it awaited was cancelled under it, and its siblings could
    wait for it for ever.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.cancelled():
                    raise ChildCancelled(f"{task.get_coro().__qualname__} ended cancelled "
                                         "while its siblings ran")
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        # Wait for the cancelled ones so none outlives us (and none logs "never retrieved").
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_set(work: asyncio.Future[Any], event: asyncio.Event) -> None:
    """Wait until ``work`` is done or ``event`` is set, whichever comes first; ``work`` is
    cancelled if the event came first.  The caller reads the outcome from ``work`` (a
    result, an exception, or cancelled); nothing this started is left running."""
    watch = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


free_ports = rvz.cluster.free_ports

# Where the processes of a one-machine run listen, unless told otherwise (``--host``).
LOCAL_HOST = "127.0.0.1"

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# The level the launcher chose, for its child processes (they inherit the environment).
LOG_LEVEL_ENV = "EXAMPLES_LOG_LEVEL"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_log_option(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="INFO", type=str.upper,
                        help="log messages of this level and above to stderr: progress (INFO), "
                        "rvz's own warnings (a lost peer, a refused handshake) (WARNING)")


def add_tls_options(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="mutual TLS: the CA that signed every node's certificate")
    parser.add_argument("--tls-cert", default=None, metavar="PEM", help="this node's certificate")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="this node's private key")


def tls_files(args: argparse.Namespace) -> tuple[str, str, str] | None:
    """(ca, cert, key) from the command line, or None; ValueError if only some are given."""
    files = (args.tls_ca, args.tls_cert, args.tls_key)
    if not any(files):
        return None
    if not all(files):
        raise ValueError("TLS needs --tls-ca, --tls-cert and --tls-key together")
    return files  # type: ignore[return-value]


def tls_contexts(files: tuple[str, str, str]) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """rvz's ``ssl=`` pair for mutual TLS: each node shows ``cert`` and requires a peer
    certificate signed by ``ca``; a client checks the server's certificate against the host
    of the address it dials. Built where the node starts (contexts do not pickle)."""
    ca, cert, key = files
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    server.load_verify_locations(ca)
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_cert_chain(cert, key)
    client.load_verify_locations(ca)
    return server, client


def configure_logging(level: str | None = None) -> None:
    """Log to stderr at ``level`` (in a child process: the launcher's level). Called by every
    entry point: without it rvz's warnings (a peer lost, a node listening without a secret)
    are never shown."""
    if level is None:
        level = os.environ.get(LOG_LEVEL_ENV, "INFO")
    os.environ[LOG_LEVEL_ENV] = level
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)
    # rvz's INFO lines (every peer that closes) would drown the progress lines: its
    # warnings and errors show at INFO, everything at DEBUG.
    logging.getLogger("rvz").setLevel(level if level == "DEBUG" else max(logging.WARNING,
                                                                          logging.getLevelName(level)))


class Stopped(BaseException):
    """The launcher got SIGTERM or SIGINT. Raised in its main thread (a ``BaseException``,
    so no ``except Exception`` swallows it) so that every ``finally`` and ``with`` block runs
    and stops the child processes before the launcher exits with ``exit_code``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 143 for SIGTERM, 130 for SIGINT


# Signals that arrived while a child process was being started (``starting_child``); None
# when no start is under way.
_held: list[int] | None = None


def _stop(signum: int) -> None:
    # The clean-up that follows is bounded; a second signal must not cut it short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Stopped(signum)


def stop_on_signals() -> None:
    """In a launcher's main thread: SIGTERM and SIGINT raise ``Stopped``. Without this,
    SIGTERM (what ``timeout`` and service managers send) ends the launcher at once and leaves
    its children running, re-parented to init; SIGINT prints a traceback. A no-op outside the
    main thread (only it can have signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_signal(signum: int, frame: Any) -> None:
        if _held is not None:
            _held.append(signum)  # raised once the child has started (starting_child)
            return
        _stop(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


@contextlib.contextmanager
def starting_child() -> Iterator[None]:
    """Around ``Process.start()`` and the bookkeeping that records the process: a SIGTERM or
    SIGINT that arrives inside is raised (as ``Stopped``) when the block ends. Raised inside,
    it would cut ``spawn``'s write of the child's start-up data short, so the child died of
    ``EOFError`` with a traceback on the launcher's terminal, or it would leave a started child
    that the launcher does not know about and so never stops."""
    global _held
    if _held is not None:  # nested: the outer block raises
        yield
        return
    _held = []
    try:
        yield
    finally:
        held, _held = _held, None
        if held:
            _stop(held[0])


def child_signals() -> None:
    """In a launcher's child process: ignore SIGINT, and log at the launcher's level. A
    Ctrl-C reaches the whole process group; the launcher then stops its children itself
    (SIGTERM), without a traceback from each of them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging()
