"""Requests answered before their body was read close their connection behind the answer.

HTTP/1.1 keeps a connection for the next request, so a server that answers early (a path no route serves, a method
the route does not take, the starting server's 503) would otherwise read, and drop, the rest of the body to find the
next request's headers: 60 MiB sent to an unknown path used to be read whole. Answered with ``Connection: close``,
uvicorn closes the connection at once instead. The gatekeeper's own refusals already say so.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

#: ASGI's scope and messages, and its receive and send callables.
Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CLOSE_HEADER = (b"connection", b"close")


def declares_body(scope: Scope) -> bool:
    """Whether a request says it has a body: a Content-Length above 0, or a Transfer-Encoding (chunked)."""
    for key, value in scope.get("headers") or ():
        if key == b"transfer-encoding" or (key == b"content-length" and value.strip() not in (b"0", b"")):
            return True
    return False


class CloseUnread:
    """ASGI middleware: a response that starts before its request's body was received whole says
    ``Connection: close``."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not declares_body(scope):
            await self.app(scope, receive, send)
            return
        received = False

        async def receiving() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                received = True
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and not received:
                headers = list(message.get("headers") or ())
                if not any(key.lower() == b"connection" for key, _ in headers):
                    message = {**message, "headers": [*headers, CLOSE_HEADER]}
            await send(message)

        await self.app(scope, receiving, sending)
