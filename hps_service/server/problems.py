"""REST error bodies: RFC 9457 problems (``application/problem+json``), built the same way by the admin API and by
the gatekeeper in front of it (which answers before the API sees the request)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import Send

PROBLEM_JSON = "application/problem+json"


def problem(code: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    """An RFC 9457 problem (``type``, ``title``, ``status``, ``detail``) that also keeps ``error`` for callers
    written against the earlier ``{"error": message}`` body; ``extra`` adds extension members."""
    body = {"type": "about:blank", "title": HTTPStatus(code).phrase, "status": code, "detail": message,
            "error": message, **extra}
    return JSONResponse(body, status_code=code, headers=headers, media_type=PROBLEM_JSON)


#: Sent with a refusal that leaves a request's body unread: the server closes the connection behind its answer
#: instead of reading (and dropping) the rest of the body to reach the next request.
CLOSE = {"Connection": "close"}


async def send_problem(send: Send, code: int, message: str, headers: dict[str, str] | None = None) -> None:
    """Answer an ASGI request with a problem, from a middleware, and close the connection (its body is unread)."""
    response = problem(code, message, {**(headers or {}), **CLOSE})
    await send({"type": "http.response.start", "status": code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
