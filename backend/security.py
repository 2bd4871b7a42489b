"""Token check and body-size bound, as one ASGI middleware in front of everything.

With a token configured, every HTTP request and websocket needs it, as
``Authorization: Bearer TOKEN`` or the ``workbench_token`` cookie (browsers send cookies on
websockets, not headers). Opening ``/?token=TOKEN`` once sets the cookie (HttpOnly,
SameSite=Strict) and redirects to ``/``, so the dashboard works from a link.
Bodies above ``max_body_bytes`` get 413 whether or not they announce a Content-Length.

Browsers are the other threat to a tokenless loopback server: any web page can send requests
to 127.0.0.1 or open a websocket to it. So without a token the ``Host`` must be a loopback
name (a DNS-rebinding page arrives with its own host name), and a request that carries an
``Origin`` (browsers send one on websockets and cross-site writes) must come from this server's
own origin; both get 403 otherwise.
"""

from __future__ import annotations

import hmac
import json
from http.cookies import SimpleCookie
from urllib.parse import parse_qs, urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend.errors import error_body

COOKIE = "workbench_token"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
UNSAFE = ("POST", "PUT", "PATCH", "DELETE")


def _hostname(netloc: str) -> str:
    try:
        return (urlsplit("//" + netloc).hostname or "").lower()
    except ValueError:
        return ""


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def presented_token(scope: Scope) -> str | None:
    """The token a request carries (bearer header first, then cookie), or None."""
    auth = _header(scope, b"authorization")
    if auth and auth.lower().startswith("bearer "):
        return auth[7:].strip()
    cookie = _header(scope, b"cookie")
    if cookie:
        jar = SimpleCookie()
        try:
            jar.load(cookie)
        except Exception:
            return None
        if COOKIE in jar:
            return jar[COOKIE].value
    return None


async def _send_json(send: Send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def _ws_close(receive: Receive, send: Send, body: dict, code: int, reason: str) -> None:
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": json.dumps(body)})
    await send({"type": "websocket.close", "code": code, "reason": reason})


class SecurityMiddleware:
    """Rejects requests without the token (401) and bodies over the limit (413)."""

    def __init__(self, app: ASGIApp, token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.token = token
        self.max_body_bytes = max_body_bytes

    def _authorized(self, scope: Scope) -> bool:
        if not self.token:
            return True
        given = presented_token(scope)
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if self.token and scope["type"] == "http" and scope["path"] == "/":
            given = parse_qs(scope.get("query_string", b"").decode()).get("token", [None])[0]
            if given is not None and hmac.compare_digest(given.encode(), self.token.encode()):
                cookie = f"{COOKIE}={given}; HttpOnly; SameSite=Strict; Path=/"
                await send(
                    {
                        "type": "http.response.start",
                        "status": 303,
                        "headers": [(b"location", b"/"), (b"set-cookie", cookie.encode())],
                    }
                )
                await send({"type": "http.response.body", "body": b""})
                return
        refused = self._refused_origin(scope)
        if refused:
            body = error_body("forbidden", refused)
            if scope["type"] == "websocket":
                await _ws_close(receive, send, body, 4403, "forbidden")
            else:
                await _send_json(send, 403, body)
            return
        if not self._authorized(scope):
            body = error_body(
                "unauthorized",
                "this server needs its token: 'Authorization: Bearer TOKEN', the "
                f"{COOKIE} cookie, or open /?token=TOKEN once",
            )
            if scope["type"] == "websocket":
                await _ws_close(receive, send, body, 4401, "unauthorized")
                return
            await _send_json(send, 401, body, [(b"www-authenticate", b"Bearer")])
            return
        if scope["type"] == "http" and scope["method"] in UNSAFE:
            await self._bounded(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refused_origin(self, scope: Scope) -> str | None:
        """Why a browser-borne request is refused (wrong Host or foreign Origin), or None."""
        host = _header(scope, b"host") or ""
        if not self.token and _hostname(host) not in LOOPBACK_NAMES:
            return (
                f"Host {host!r} is not a loopback name; without a token this server only "
                "answers to 127.0.0.1, localhost or [::1]"
            )
        origin = _header(scope, b"origin")
        if (
            origin
            and origin != "null"
            and (scope["type"] == "websocket" or scope["method"] in UNSAFE)
        ):
            if urlsplit(origin).netloc.lower() != host.lower():
                return f"cross-origin request from {origin!r} refused"
        elif origin == "null" and scope["type"] == "websocket":
            return "websocket from an opaque origin refused"
        return None

    async def _bounded(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.max_body_bytes
        too_large = error_body("body_too_large", f"request body is over the limit of {limit} bytes")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_json(send, 413, too_large)
            return
        # Read the whole (bounded) body first: a chunked body that grows past the limit is
        # refused before the app sees any of it.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_json(send, 413, too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
