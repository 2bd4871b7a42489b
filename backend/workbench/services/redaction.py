"""The server's token kept out of its logs, at every level, by one logging filter
(``RedactToken``) on every handler.

Where a token reaches a log line:

- a query string: ``/?token=T`` is how a link hands the token over, and uvicorn logs every
  request's path with its query (the access log; its error log for websockets), the refused
  spellings too (``?token[]=T``, ``?x=1;token=T``, ``?token%00=T``, ``?%2574oken=T``): the
  value of every parameter whose name, percent-decoded, holds ``token`` is redacted;
- a header: at ``--log-level debug`` the ``websockets`` library logs each handshake header as
  ``logger.debug("< %s: %s", name, value)`` (``< authorization: Bearer T``, ``< cookie:
  workbench_token=T``), and an ASGI message's headers show as ``(b'cookie', b'...')``: the
  value of ``authorization``, ``proxy-authorization``, ``cookie`` and ``set-cookie`` is
  redacted, whether it is the argument after the header's name or inside one text;
- anything else: the configured token itself, wherever it stands, whatever its spelling
  around it.
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import unquote_plus

REDACTED = "[redacted]"
SECRET_HEADERS = ("authorization", "proxy-authorization", "cookie", "set-cookie")
"""Headers whose value carries a credential (the token as a bearer or as the cookie)."""

QUERY_PARAMETER = re.compile(r"([?&;])([^=&;\s?#\"']*)=([^&;\s#\"']*)")
"""One ``name=value`` of a query string inside a log line (a path, a URL); ``;`` separates
parameters too (some parsers, and so some users, take it)."""
_HEADER_LINE = re.compile(
    r"(?i)\b(" + "|".join(SECRET_HEADERS) + r")(\s*:\s*)([^\r\n]*)",
)
"""``authorization: Bearer T`` inside one text (a header dump)."""
_HEADER_PAIR = re.compile(
    r"""(?i)(b?['"](?:""" + "|".join(SECRET_HEADERS) + r""")['"],\s*b?)(['"])(.*?)\2""",
)
"""``(b'cookie', b'workbench_token=T')``: a header in an ASGI message's repr."""


def _token_name(name: str) -> bool:
    """Whether a query parameter's name is about a token: ``token``, ``TOKEN``, ``%74oken``
    (decoded up to three times: ``%2574oken``), ``token[]``, ``token%00``, ``x_token``."""
    for _ in range(3):
        name, before = unquote_plus(name), name
        if name == before:
            break
    return "token" in re.sub(r"[^a-z]", "", name.lower())


def redact_query(text: str) -> str:
    """``text`` with the value of every query parameter whose name is about a token
    (``_token_name``) replaced by ``[redacted]``."""
    return QUERY_PARAMETER.sub(
        lambda m: f"{m[1]}{m[2]}={REDACTED}" if _token_name(m[2]) else m[0], text
    )


def redact(text: str, token: str | None = None) -> str:
    """``text`` with query tokens (``redact_query``), credential header values and the
    configured ``token`` itself replaced by ``[redacted]``."""
    text = redact_query(text)
    text = _HEADER_LINE.sub(lambda m: f"{m[1]}{m[2]}{REDACTED}", text)
    text = _HEADER_PAIR.sub(lambda m: f"{m[1]}{m[2]}{REDACTED}{m[2]}", text)
    if token:
        text = text.replace(token, REDACTED)
    return text


class RedactToken(logging.Filter):
    """Redacts the token from a log record, so that no handler writes it, at any level.

    ``token``: the server's own token, redacted wherever it appears; the forms above are
    redacted without it too (a mistyped token is a secret as well). A record whose text holds
    nothing to redact is left as it is. Otherwise its message and arguments are redacted in
    their places (uvicorn's access formatter unpacks the arguments): a string in place, the
    string after a credential header's name (``"< %s: %s"``) replaced, another object by its
    redacted text when that text held a secret. When the text formatted from them still holds
    one (a secret split across arguments), the record becomes its redacted text alone."""

    def __init__(self, token: str | None = None) -> None:
        super().__init__()
        self.token = token or None

    def _clean(self, text: str) -> bool:
        return redact(text, self.token) == text

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - logging reports a record that does not format
            return True
        if self._clean(text):
            return True
        if isinstance(record.msg, str):
            record.msg = redact(record.msg, self.token)
        if isinstance(record.args, tuple):
            args, secret_next = [], False
            for arg in record.args:
                arg = REDACTED if secret_next and isinstance(arg, (str, bytes)) else self._arg(arg)
                args.append(arg)
                secret_next = isinstance(arg, str) and arg.strip().lower() in SECRET_HEADERS
            record.args = tuple(args)
        elif isinstance(record.args, dict):
            record.args = {
                k: REDACTED if str(k).lower() in SECRET_HEADERS else self._arg(v)
                for k, v in record.args.items()
            }
        try:
            clean = self._clean(record.getMessage())
        except Exception:  # noqa: BLE001 - a placeholder went with a redacted value
            clean = False
        if not clean:
            record.msg, record.args = redact(text, self.token), ()
        return True

    def _arg(self, arg: Any) -> Any:
        if isinstance(arg, str):
            return redact(arg, self.token)
        if isinstance(arg, (int, float)) or arg is None:  # %d, %f: kept numbers
            return arg
        text = str(arg)
        shown = redact(text, self.token)
        return shown if shown != text else arg
