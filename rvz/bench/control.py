"""How the parent talks to its workers: local child processes, or a remote ``--server``.

A ``WorkerLink`` carries JSON lines both ways; a reader thread puts every reply in a queue
so the parent can wait on two workers at once, with a deadline, and notice at once when
either of them failed.

Every child process started here is ended by ``close()`` (quit, then terminate, then kill);
the parent calls it from ``finally`` blocks, so Ctrl-C or an error never leaves one behind.
Workers run in their own session (the terminal's Ctrl-C reaches only the parent, which then
shuts them down in order) and exit by themselves if the parent disappears.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any

from .. import cluster


class WorkerError(RuntimeError):
    """A worker failed, died, or did not answer in time."""


def worker_env(impl: str) -> dict[str, str]:
    """The environment of a worker running ``impl`` (``"compiled"`` or ``"python"``)."""
    env = dict(os.environ)
    if impl == "python":
        env["RVZ_NO_EXTENSIONS"] = "1"
    else:
        env.pop("RVZ_NO_EXTENSIONS", None)
    return env


def spawn_worker(impl: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "rvz.bench", "_worker"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=worker_env(impl), start_new_session=True)


def stop_process(proc: subprocess.Popen[bytes], grace: float = 3.0) -> None:
    """End a child process we started: wait ``grace`` seconds, then terminate, then kill."""
    if proc.poll() is None:
        try:
            if grace <= 0:
                raise subprocess.TimeoutExpired(proc.args, grace)
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


class WorkerLink:
    """One worker: send commands, wait for replies (with a deadline)."""

    def __init__(self, name: str, rfile: IO[bytes], wfile: IO[bytes]) -> None:
        self.name = name
        self._wfile = wfile
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(rfile,), daemon=True)
        self._reader.start()
        self.hello: dict[str, Any] = {}
        self.offset_ns = 0  # worker clock minus parent clock (0 on the parent's host)
        self.host = "127.0.0.1"  # where this worker's sockets listen
        self.closed = False

    def _read(self, rfile: IO[bytes]) -> None:
        try:
            for line in rfile:
                self._replies.put(json.loads(line))
        except (OSError, ValueError):
            pass
        self._replies.put(None)

    def send(self, message: dict[str, Any]) -> None:
        try:
            self._wfile.write(json.dumps(message).encode() + b"\n")
            self._wfile.flush()
        except (OSError, ValueError) as exc:
            raise WorkerError(f"worker {self.name} is gone ({exc})") from None

    def poll(self, timeout: float) -> dict[str, Any] | None:
        """The next reply, or None if none came within ``timeout``; raises if it died."""
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            return None
        if reply is None:
            self._replies.put(None)  # stays dead for later polls
            raise WorkerError(f"worker {self.name} exited unexpectedly")
        return reply

    def wait(self, timeout: float) -> dict[str, Any]:
        reply = self.poll(timeout)
        if reply is None:
            raise WorkerError(f"worker {self.name} did not answer within {timeout:.0f}s")
        return reply

    def request(self, message: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        self.send(message)
        return checked(self, self.wait(timeout))

    def start(self, timeout: float = 60.0) -> dict[str, Any]:
        self.hello = self.wait(timeout)
        if self.hello.get("event") != "hello":
            raise WorkerError(f"worker {self.name} said {self.hello!r} instead of hello")
        return self.hello

    def close(self, grace: float = 3.0) -> None:
        self.closed = True


def checked(link: WorkerLink, reply: dict[str, Any]) -> dict[str, Any]:
    if not reply.get("ok"):
        detail = reply.get("traceback") or ""
        raise WorkerError(f"worker {link.name} failed: {reply.get('error')}\n{detail}".rstrip())
    return reply


def wait_all(links: list[WorkerLink], timeout: float) -> list[dict[str, Any]]:
    """Replies of every link; the first failure raises at once (the peer may hang on it)."""
    deadline = time.monotonic() + timeout
    replies: list[dict[str, Any] | None] = [None] * len(links)
    while any(r is None for r in replies):
        if time.monotonic() > deadline:
            late = [link.name for link, r in zip(links, replies, strict=True) if r is None]
            raise WorkerError(f"worker(s) {', '.join(late)} did not finish within {timeout:.0f}s")
        for i, link in enumerate(links):
            if replies[i] is None:
                reply = link.poll(0.05)
                if reply is not None:
                    try:
                        replies[i] = checked(link, reply)
                    except WorkerError as exc:
                        raise WorkerError("\n".join([str(exc), *_late_errors(links, replies, i)])) from None
    return [r for r in replies if r is not None]


def _late_errors(links: list[WorkerLink], replies: list[Any], failed: int) -> list[str]:
    """What the other workers say within a moment of one failing (often the root cause)."""
    notes = []
    for j, link in enumerate(links):
        if j == failed or replies[j] is not None:
            continue
        try:
            reply = link.poll(1.0)
        except WorkerError as exc:
            notes.append(str(exc))
            continue
        if reply is not None and not reply.get("ok"):
            notes.append(f"worker {link.name} failed too: {reply.get('error')}\n"
                         f"{reply.get('traceback', '')}".rstrip())
    return notes


class LocalWorker(WorkerLink):
    """A worker child process on this host."""

    def __init__(self, name: str, impl: str) -> None:
        self.proc = spawn_worker(impl)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        super().__init__(name, self.proc.stdout, self.proc.stdin)

    def close(self, grace: float = 3.0) -> None:
        """Quit (a worker between cases exits at once), else terminate after ``grace``."""
        if self.closed:
            return
        self.closed = True
        if self.proc.poll() is None and grace > 0:
            try:
                self.send({"op": "quit"})
            except WorkerError:
                pass
        stop_process(self.proc, grace)


class RemoteWorker(WorkerLink):
    """A worker started by ``rvz-bench --server`` on another host (or this one)."""

    def __init__(self, name: str, address: str, impl: str, timeout: float = 30.0) -> None:
        host, port = cluster.split_address(address)
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise WorkerError(f"cannot reach the rvz-bench --server at {address}: "
                              f"{exc.strerror or exc}") from None
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rfile = self.sock.makefile("rb")
        wfile = self.sock.makefile("wb")
        super().__init__(name, rfile, wfile)
        self.host = self.sock.getpeername()[0]      # the server's side listens here
        self.local_host = self.sock.getsockname()[0]  # and our own worker here
        self.send({"op": "spawn", "impl": impl, "version": 1})

    def close(self, grace: float = 3.0) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.send({"op": "quit"})
        except WorkerError:
            pass
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def clock_offset(link: WorkerLink, samples: int = 20) -> int:
    """Estimate ``worker clock - parent clock`` in ns (for a worker on another host).

    The sample with the shortest round trip wins; its error is at most half that round trip
    (plus any asymmetry of the path), so two-host rendezvous latencies carry that error.
    """
    best: tuple[int, int] | None = None
    for _ in range(samples):
        before = time.monotonic_ns()
        t = int(link.request({"op": "clock"})["t"])
        after = time.monotonic_ns()
        rtt = after - before
        if best is None or rtt < best[0]:
            best = (rtt, t - (before + after) // 2)
    assert best is not None
    return best[1]


# -- the --server side ---------------------------------------------------------------------------

def _pump(src: IO[bytes], dst: IO[bytes]) -> None:
    try:
        while True:
            line = src.readline()
            if not line:
                break
            dst.write(line)
            dst.flush()
    except (OSError, ValueError):
        pass
    try:
        dst.close()
    except (OSError, ValueError):
        pass


def serve_one(conn: socket.socket, log: Any) -> bool:
    """Serve one client: start a worker of the implementation it asks for, relay lines.
    False if the connection was not an rvz-bench client (it got an error line)."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rfile = conn.makefile("rb")
    wfile = conn.makefile("wb")
    first = rfile.readline()
    if not first:
        return False
    try:
        request = json.loads(first)
    except ValueError:  # not a client of ours: it must not stop the server
        request = None
    if not isinstance(request, dict) or request.get("op") != "spawn":
        wfile.write(json.dumps({"ok": False, "error": "expected a spawn request"}).encode() + b"\n")
        wfile.flush()
        return False
    impl = str(request.get("impl", "compiled"))
    log(f"rvz-bench server: client {conn.getpeername()} asks for a {impl} worker")
    proc = spawn_worker(impl)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        up = threading.Thread(target=_pump, args=(rfile, proc.stdin), daemon=True)
        down = threading.Thread(target=_pump, args=(proc.stdout, wfile), daemon=True)
        up.start()
        down.start()
        up.join()  # the client closed (or said quit): the worker reads EOF and exits
        down.join(5.0)
    finally:
        stop_process(proc)
        log("rvz-bench server: client done")
    return True


def serve(address: str, once: bool, log: Any) -> int:
    host, port = cluster.split_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
            listener.listen(4)
        except OSError as exc:
            raise WorkerError(f"--server cannot listen on {address}: {exc.strerror or exc}") from None
        log(f"rvz-bench server: listening on {address} (Ctrl-C to stop)")
        while True:
            conn, _ = listener.accept()
            served = True
            with conn:
                try:
                    # --once counts clients, not connections of something else (a probe)
                    served = serve_one(conn, log)
                except OSError as exc:  # a client that vanished must not stop the server
                    log(f"rvz-bench server: client lost ({exc})")
            if once and served:
                return 0
