"""The server around the app: which Host names it answers to, the listening socket, uvicorn
with signals that end it at once, and the access log."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from attnmt.errors import AttnmtError
from attnmt.serve.scheduler import Scheduler

if TYPE_CHECKING:
    from attnmt.serve.workers import ForkedScheduler


def error_response(status: int, message: str) -> JSONResponse:
    """Every error's shape: {"error": message}."""
    return JSONResponse({"error": message}, status_code=status)


def served_hosts(host: str, allowed: list[str]) -> frozenset[str] | None:
    """The Host header names answered when bound to `host`: the address itself (a loopback
    address: also localhost and the other loopback names) and `allowed`; None (any) when
    bound to every interface and nothing more is named."""
    wildcard = host in ("0.0.0.0", "::", "")
    if wildcard and not allowed:
        return None
    names = {h.lower() for h in allowed} | ({host.lower()} if not wildcard else set())
    if host in ("127.0.0.1", "::1", "localhost"):
        names |= {"127.0.0.1", "::1", "localhost"}
    return frozenset(names)


class HostCheck:
    """ASGI middleware: 400 for a request whose Host header is not one the server answers to,
    so a page on another site that rebinds its DNS name to this address reads nothing."""

    def __init__(self, app: Any, hosts: frozenset[str]) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
            name = header[1:].split("]")[0] if header.startswith("[") else header.split(":")[0]
            if name not in self.hosts:
                message = f"Host {header or 'missing'} is not served here (serve --allowed-host)"
                await error_response(400, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, before anything is announced: a port in use or an address
    not ours is one line and exit code 2, not uvicorn's log and exit code 3."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: an answer's headers and body, written one after the
    # other, go out at once instead of the body waiting for the client's delayed ACK (40 ms
    # on Linux, on every request of a kept-alive connection).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise AttnmtError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    return sock


def run(app: FastAPI, host: str, port: int, name: str, search: Scheduler | ForkedScheduler) -> None:
    """Serve `app` on host:port with `search` running in the main thread (Scheduler.run: the
    fast one for torch; ForkedScheduler.run: its workers' answers) and the HTTP server in
    another, until SIGINT (exit code 130, as the other commands) or SIGTERM (143), at once,
    whatever the search is doing."""
    import uvicorn

    def leave(sig: int, frame: Any) -> None:
        # A search may be inside torch, and a graceful shutdown would wait for it; the
        # interpreter's exit would run destructors under its thread pool (seen: "terminate
        # called without an active exception"). The process ends now.
        print(f"attnmt: {'interrupted' if sig == 2 else 'terminated'}", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(128 + sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, leave)
    sock = listen(host, port)
    bound = sock.getsockname()[1]
    where = f"{host}:{bound}" if ":" not in host else f"[{host}]:{bound}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="attnmt-http")
    http.start()
    print(f"attnmt: serving {name} on http://{where}", file=sys.stderr, flush=True)
    search.run(alive=http.is_alive)  # returns if the HTTP server stops (it failed)
    os._exit(1)


class AccessLog:
    """ASGI middleware: one line per HTTP request on stderr (client, method, path, status,
    lines, milliseconds). Plain ASGI, not Starlette's BaseHTTPMiddleware, which would keep the
    endpoint from seeing that its client has gone."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            ms = (time.perf_counter() - start) * 1000
            lines = scope.get("state", {}).get("lines", "-")
            client = scope["client"][0] if scope.get("client") else "-"
            print(
                f"attnmt: {client} {scope['method']} {scope['path']} {status} {lines} lines "
                f"{ms:.1f} ms", file=sys.stderr, flush=True,
            )  # fmt: skip
