"""NBD servers for the NBD image kinds, started and stopped by the runner.

On an NBD image (``nbd``, ``nbd-delay``) every client target (fusex's NBD
client, nbdfuse) connects to *one* server the runner starts before mounting
them, so the clients are compared against the same server process in the same
run. The server's CPU time counts for whichever client is running (only one
runs at a time).

* ``nbd``: qemu-nbd on a unix socket, ``--shared`` well above the clients'
  total connections: qemu-nbd advertises multi-conn for a writable export
  only with ``--shared`` > 1 (docs/nbd.md), and without multi-conn fusex
  serves one queue and nbdfuse one connection.
* ``nbd-delay``: nbdkit's file plugin behind the delay filter (1 ms before
  every read, write and zero request) with ``--threads 64``, so the server
  runs up to 64 requests at once: latency where parallelism is everything.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .images import Image
from .targets import _tail, _terminate, spawn

# Connections qemu-nbd accepts at once: fusex (one per queue) and nbdfuse (4) are connected together.
QEMU_NBD_SHARED = 16
NBDKIT_THREADS = 64
DELAY_MS = 1
READY_TIMEOUT_S = 20.0


class ServerError(RuntimeError):
    """The NBD server did not come up (the message says why)."""


def server_command(image: Image, sock: str, qemu_nbd: Optional[str], nbdkit: Optional[str]) -> list[str]:
    """The command serving ``image`` (an NBD kind) on the unix socket ``sock``."""
    assert image.path
    if image.kind == "nbd":
        if not qemu_nbd:
            raise ServerError("qemu-nbd not installed (Debian: qemu-utils)")
        cache = "none" if image.direct else "writeback"
        return [qemu_nbd, "--persistent", f"--shared={QEMU_NBD_SHARED}", f"--socket={sock}",
                f"--cache={cache}", "--aio=io_uring", "--image-opts",
                f"driver=raw,file.driver=file,file.filename={image.path},file.locking=off"]
    if image.kind == "nbd-delay":
        if not nbdkit:
            raise ServerError("nbdkit not installed (Debian: nbdkit)")
        d = f"{DELAY_MS}ms"
        return [nbdkit, "--foreground", "--exit-with-parent", "--unix", sock,
                "--threads", str(NBDKIT_THREADS), "--filter=delay", "file", f"file={image.path}",
                f"delay-read={d}", f"delay-write={d}", f"delay-zero={d}"]
    raise ServerError(f"image kind {image.kind} has no NBD server")


def missing_tool(image: Image, qemu_nbd: Optional[str], nbdkit: Optional[str]) -> Optional[str]:
    """Why the server of ``image`` cannot run here (None if it can, or the image is not an NBD kind)."""
    if image.kind == "nbd" and not qemu_nbd:
        return "qemu-nbd not installed (Debian: qemu-utils)"
    if image.kind == "nbd-delay" and not nbdkit:
        return "nbdkit not installed (Debian: nbdkit)"
    return None


@dataclass
class NbdServer:
    """One running server (a child in its own session, SIGTERM when the runner dies)."""

    image_label: str
    sock: str
    command: list[str]
    log: str
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def to_json(self) -> dict[str, Any]:
        return {"image": self.image_label, "socket": self.sock, "command": list(self.command), "log": self.log}

    def stop(self) -> None:
        """Stop the server (after its clients are gone; idempotent)."""
        if self.proc is None:
            return
        with contextlib.suppress(Exception):
            _terminate(self.proc)
        self.proc = None
        with contextlib.suppress(OSError):
            os.unlink(self.sock)


def wait_listening(sock: str, proc: subprocess.Popen, log: str, timeout: float = READY_TIMEOUT_S) -> None:
    """Wait until ``sock`` accepts a connection (the server answers the handshake after that)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"{os.path.basename(str(proc.args[0]))} exited with {proc.returncode}: {_tail(log)}")
        if os.path.exists(sock):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(sock)
                return
            except OSError:
                pass
            finally:
                s.close()
        time.sleep(0.02)
    raise ServerError(f"{sock} not accepting connections after {timeout:.0f} s: {_tail(log)}")


def start_server(image: Image, workdir: str, qemu_nbd: Optional[str], nbdkit: Optional[str]) -> NbdServer:
    """Start the server of ``image`` in ``workdir``; sets the image's socket and server pid."""
    os.makedirs(workdir, exist_ok=True)
    sock = os.path.join(workdir, "nbd.sock")
    cmd = server_command(image, sock, qemu_nbd, nbdkit)
    log = os.path.join(workdir, f"{os.path.basename(cmd[0])}.log")
    srv = NbdServer(image.label, sock, cmd, log)
    srv.proc = spawn(cmd, log)
    try:
        wait_listening(sock, srv.proc, log)
    except BaseException:
        srv.stop()
        raise
    image.nbd_socket = sock
    image.nbd_server_pid = srv.proc.pid
    return srv
