"""Streamed HTTP responses wait for a client that does not read (daphne).

ASGI's `send` is meant to wait while the connection cannot take more, but daphne's
returns at once: Twisted queues what it is given in the connection's memory, without
bound. A history stream (`…/subscribe`, SSE) whose client stops reading, or reads more
slowly than the history comes, made the server read the whole history and hold it in
memory, each such stream its own copy, for as long as the connection stayed open (HTTP
has no ping to end it). WebSockets are bounded by daphne's ping: a client that reads
nothing answers no ping and is dropped within `ping_interval + ping_timeout`.

`SendBackpressure(app)` registers a streaming producer with Twisted for a response of
more than one body part: Twisted pauses it when the connection's send buffer fills and
resumes it when the client has read, and the next part's `send` waits meanwhile, so
the stream reads no more history than its client takes. Under another server (uvicorn
waits in `send` itself) it changes nothing.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], Any, Send], Awaitable[None]]


class _Writable:
    """A Twisted push producer (IPushProducer): the connection tells it when it may write."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.ready.set()

    def pauseProducing(self) -> None:
        self.ready.clear()

    def resumeProducing(self) -> None:
        self.ready.set()

    def stopProducing(self) -> None:
        self.ready.set()


def daphne_request(send: Send) -> Any:
    """The Twisted request a daphne `send` answers (daphne passes the protocol as the
    first argument of a partial of its server's handle_reply); None under another server."""
    if not isinstance(send, functools.partial) or not send.args:
        return None
    request = send.args[0]
    try:
        from twisted.web.http import Request
    except ImportError:
        return None
    return request if isinstance(request, Request) else None


class SendBackpressure:
    """ASGI middleware: see the module's docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        request = daphne_request(send) if scope["type"] == "http" else None
        if request is None:
            await self.app(scope, receive, send)
            return
        writable: _Writable | None = None

        def unregister() -> None:
            nonlocal writable
            if writable is not None and request.producer is writable:
                request.unregisterProducer()
            writable = None

        async def paced_send(message: dict[str, Any]) -> None:
            nonlocal writable
            if message["type"] != "http.response.body":
                await send(message)
                return
            if not message.get("more_body", False):
                unregister()  # the response ends: the connection's next request is not ours
                await send(message)
                return
            await send(message)
            if writable is None and request.producer is None and not request.finished:
                writable = _Writable()
                request.registerProducer(writable, True)
            if writable is not None:
                # The client has not read what was sent: hold the stream here (its next
                # part is not even produced) until it has. A disconnect ends the wait
                # (stopProducing), and Django cancels the response.
                await writable.ready.wait()

        try:
            await self.app(scope, receive, paced_send)
        finally:
            unregister()
