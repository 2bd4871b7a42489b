"""Token check and body-size bound, as one ASGI middleware in front of everything.

With a token configured, every HTTP request and websocket needs it, as
``Authorization: Bearer TOKEN`` or the ``workbench_token`` cookie (browsers send cookies on
websockets, not headers). Opening ``/?token=TOKEN`` once sets the cookie (HttpOnly,
SameSite=Strict) and redirects to ``/``, so the dashboard works from a link and the token does
not stay in the address bar; ``workbench.services.redaction.RedactToken`` keeps it out of every log.
Bodies above ``max_body_bytes`` get 413 whether or not they announce a Content-Length, and a
JSON body nested deeper than ``MAX_JSON_DEPTH`` gets one 422 before anything parses it
(``json.loads``, ``copy.deepcopy`` and pydantic recurse once per level: ~1000 levels are a
``RecursionError``, and a fraction of that already costs the stack of every recursion after).

Browsers are the other threat: any web page can send requests to 127.0.0.1 or open a websocket
to it, and ids are sequential. So without a token the ``Host`` must be a loopback name (a
DNS-rebinding page arrives with its own host name), and a websocket or a state-changing request
(POST, PUT, PATCH, DELETE) is refused (403) when the browser says it comes from elsewhere: an
``Origin`` that is not this server's own, ``Origin: null`` (a sandboxed frame, a file, a
redirect) or ``Sec-Fetch-Site: cross-site``. The cookie does not help such a page: another port
on 127.0.0.1 is the same *site*, so SameSite lets the cookie through. Only a request carrying
the token in its ``Authorization`` header (which a page cannot add to a cross-site request) is
let through whatever its Origin says. Same-origin pages and clients that send no Origin (curl,
scripts) keep working.
"""

from __future__ import annotations

import hmac
import json
from http.cookies import SimpleCookie
from urllib.parse import parse_qs, urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stagehand.config.safe_read import MAX_JSON_DEPTH, json_depth_over
from workbench.api.errors import error_body

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


def bearer_token(scope: Scope) -> str | None:
    """The token of an ``Authorization: Bearer`` header, or None."""
    auth = _header(scope, b"authorization")
    if auth and auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return None


def presented_token(scope: Scope) -> str | None:
    """The token a request carries (bearer header first, then cookie), or None."""
    bearer = bearer_token(scope)
    if bearer is not None:
        return bearer
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
        return self._matches(presented_token(scope))

    def _matches(self, given: str | None) -> bool:
        return (
            bool(self.token)
            and given is not None
            and hmac.compare_digest(given.encode(), self.token.encode())
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if self.token and scope["type"] == "http" and scope["path"] == "/":
            given = parse_qs(scope.get("query_string", b"").decode()).get("token", [None])[0]
            if self._matches(given):
                cookie = f"{COOKIE}={given}; HttpOnly; SameSite=Strict; Path=/"
                headers = [
                    (b"location", b"/"),
                    (b"set-cookie", cookie.encode()),
                    (b"cache-control", b"no-store"),
                    (b"referrer-policy", b"no-referrer"),
                ]
                await send({"type": "http.response.start", "status": 303, "headers": headers})
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
        """Why a browser-borne request is refused (wrong Host, or a websocket or write from
        another origin or site), or None."""
        host = _header(scope, b"host") or ""
        if not self.token and _hostname(host) not in LOOPBACK_NAMES:
            return (
                f"Host {host!r} is not a loopback name; without a token this server only "
                "answers to 127.0.0.1, localhost or [::1]"
            )
        writes = scope["type"] == "websocket" or scope["method"] in UNSAFE
        if not writes or self._matches(bearer_token(scope)):
            return None
        origin = _header(scope, b"origin")
        site = _header(scope, b"sec-fetch-site")
        if origin == "null":
            return (
                "request from an opaque origin (Origin: null: a sandboxed frame, a file or a "
                "redirect) refused; send the token in an Authorization: Bearer header"
            )
        if origin and urlsplit(origin).netloc.lower() != host.lower():
            return f"cross-origin request from {origin!r} refused"
        if site == "cross-site":
            return "cross-site request (Sec-Fetch-Site: cross-site) refused"
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
        content_type = (_header(scope, b"content-type") or "").lower()
        if "json" in content_type and json_depth_over(body, MAX_JSON_DEPTH):
            message = (
                f"request body is nested more than {MAX_JSON_DEPTH} levels deep (objects and "
                f"arrays); the limit is {MAX_JSON_DEPTH}"
            )
            await _send_json(send, 422, error_body("json_too_deep", message))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
