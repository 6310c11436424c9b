"""Bind the listening socket (so a port in use is one clear error, before anything else) and
run uvicorn on it until SIGTERM/SIGINT, then drain.

uvicorn's own shutdown does the draining: it stops accepting, waits up to `drain_s` for open
requests and streams to finish (the engine keeps running meanwhile), cancels what is left, and
only then runs the app's lifespan shutdown, which stops the engine loop. After SIGTERM the
process exits 0.
"""

from __future__ import annotations

import errno
import signal
import socket
from typing import Any

from quantkit.http_api.protocol import ServerError

__all__ = ["bind", "serve"]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    if not 0 <= port <= 65535:
        raise ServerError(f"--port: expected 0-65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ServerError(f"--host {host}: expected an address this machine has, got {e}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServerError(
                f"--port {port}: expected a free port on {host}, got one already in use "
                "(another server is running there; pick another --port, or 0 for any)"
            ) from None
        raise ServerError(f"--host {host} --port {port}: cannot listen there: {e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(app: Any, sock: socket.socket, *, drain_s: float, log_level: str = "warning") -> None:
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=max(1, round(drain_s)),
        lifespan="on",
    )
    # uvicorn re-raises a captured signal once it has shut down, to the handler that was there
    # before it; a SIGTERM that drained cleanly should end the process with 0, so the handler
    # it finds is a no-op (SIGINT keeps Python's: Ctrl-C reads as an interruption, 130).
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
