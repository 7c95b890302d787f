"""The HTTP transport under the routes: uvicorn's h11 protocol with deadlines and JSON errors, the uvicorn server
built on it, the ASGI Host check (DNS rebinding), the bridge from the engine client's receiver thread to the
event loop, and the signal that a client went away."""
from __future__ import annotations

import asyncio
import json
import socket

from .params import ApiError


class ClientGone(Exception):
    """The client disconnected, or stopped reading a stream: its request is aborted, nobody reads a reply."""


def protocol_class(timeout: float):
    """uvicorn's h11 protocol with what it lacks: a deadline for a request's headers (a client
    that trickles them - slowloris - is cut after ``timeout`` seconds) and JSON for the 400 it
    sends on malformed HTTP."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            # uvicorn writes a response's head and body separately: without TCP_NODELAY, Nagle and
            # the client's delayed ACK hold the body ~40 ms on every keep-alive request.
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
            self._arm()

        def _arm(self):
            self._disarm()
            self._hdr_timer = self.loop.call_later(timeout, self._too_slow)

        def _disarm(self):
            t = getattr(self, "_hdr_timer", None)
            if t is not None:
                t.cancel()
                self._hdr_timer = None

        def _too_slow(self):
            self._hdr_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def handle_events(self):
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:        # a request's headers are complete
                self._disarm()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()                     # the next request's headers get the same deadline

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            import h11
            data = json.dumps(ApiError(400, f"malformed HTTP request: {msg}").body()).encode()
            for ev in (h11.Response(status_code=400, headers=[(b"content-type", b"application/json"),
                                                              (b"content-length", str(len(data)).encode()),
                                                              (b"connection", b"close")], reason=b"Bad Request"),
                       h11.Data(data=data), h11.EndOfMessage()):
                try:
                    self.transport.write(self.conn.send(ev))
                except Exception:  # noqa: BLE001 - h11 refuses in some broken states: just close
                    break
            self.transport.close()

    return Protocol


def uvicorn_server(app, timeout: float):
    """uvicorn serving ``app`` over the protocol above: keep-alive for ``timeout`` seconds, no access log."""
    import uvicorn
    cfg = uvicorn.Config(app, http=protocol_class(timeout), lifespan="off", log_level="warning", access_log=False,
                         server_header=False, timeout_keep_alive=int(max(1, timeout)), timeout_graceful_shutdown=2,
                         h11_max_incomplete_event_size=64 * 1024, ws="none")
    return uvicorn.Server(cfg)


def loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class HostCheck:
    """ASGI wrapper: a request whose Host header names none of ``allowed`` gets a 403 (a page on evil.example whose
    name an attacker re-points at 127.0.0.1 - DNS rebinding - sends Host: evil.example). None: no check."""

    def __init__(self, app, allowed: "set | None") -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if self.allowed is not None and scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if host is not None:
                name = host.rsplit("]", 1)[0].lstrip("[") if host.startswith("[") else host.rsplit(":", 1)[0]
                if name.lower() not in self.allowed:
                    body = json.dumps(ApiError(403, f"Host {host[:100]!r} is not one this server answers to (DNS "
                                                    f"rebinding protection); start it with --allowed-host {name[:60]}",
                                               code="host_not_allowed").body()).encode()
                    await send({"type": "http.response.start", "status": 403,
                                "headers": [(b"content-type", b"application/json"), (b"server", b"tiered-moe"),
                                            (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                    return
        await self.app(scope, receive, send)


class Sink:
    """What the engine client's receiver thread puts into: hands each item to the request's
    asyncio queue on the server's event loop."""

    def __init__(self, loop, q: asyncio.Queue) -> None:
        self.loop, self.q = loop, q

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, item)
        except RuntimeError:   # the server's loop is closed (shutting down): nobody waits for this any more
            pass


async def disconnect(receive) -> None:
    """Returns when the client disconnects (after the request body, receive() yields nothing else)."""
    while (await receive())["type"] != "http.disconnect":
        pass
