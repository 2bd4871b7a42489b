"""Reading a file a user named (a pipeline folder's JSON and safetensors headers, a caption):
regular files only, a bounded number of bytes, JSON no deeper than a limit.

Three things in such a folder stop a reader that trusts it (issue 54):

- a name that is not a regular file. ``open`` of a FIFO blocks until a writer comes, forever in
  a folder no one writes to (``mkfifo transformer/zz.safetensors`` held a server thread per
  inspection until the API stopped answering); a character device (``/dev/zero``) never ends.
  ``open_regular`` looks before it opens (``os.stat``), opens with ``O_NONBLOCK`` (a FIFO's open
  returns at once) and checks what it opened (``os.fstat``: the name may have changed between
  the two), so nothing but a regular file is ever read;
- a file far larger than its kind is (a 1 GB caption, a config.json of gigabytes): read whole,
  it costs its size in memory, twice once decoded. ``read_prefix`` reads at most a bound;
- JSON nested tens of thousands of levels deep: ``json.loads`` recurses once per level and
  raises ``RecursionError`` (a 500), and a structure that parses just under the limit fails the
  next recursive reader (``copy.deepcopy`` in ``from_config``, ``repr``). ``loads`` refuses any
  nesting deeper than ``MAX_JSON_DEPTH`` before parsing.

The standard library only: the runtime's safetensors reader, the worker's folder inspection and
scan, and the server all use it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from typing import Any, BinaryIO

MAX_JSON_DEPTH = 32
"""Deepest nesting of objects and arrays a JSON file of a model folder or a request body may
have: a safetensors header nests 3 levels, a ``config.json`` or ``model_index.json`` 2 or 3, a
preset 5."""
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
"""A JSON string (brackets inside it do not nest) or one bracket."""
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class NotRegularFile(OSError):
    """A name that is not a regular file (a FIFO, a device, a socket, a folder): never opened
    for reading. ``strerror`` says what it is."""

    def __init__(self, path: str | os.PathLike[str], mode: int) -> None:
        kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
        super().__init__(errno.EINVAL, f"{kind}, not a regular file", os.fspath(path))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


class JsonTooDeep(ValueError):
    """JSON text nested deeper than the limit (``MAX_JSON_DEPTH``)."""


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """The regular file ``path`` opened for binary reading (symlinks followed), without ever
    blocking on or reading from anything else.

    Raises:
        NotRegularFile: ``path`` is a FIFO, socket, device or folder (``strerror`` says which).
        OSError: it cannot be opened (missing, no permission, a name too long...).
    """
    found = os.stat(path)  # before the open: a device's open alone can act (a tape rewinds)
    if not stat.S_ISREG(found.st_mode):
        raise NotRegularFile(path, found.st_mode)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    try:
        opened = os.fstat(fd)  # what was opened: the name may have been replaced since the stat
        if not stat.S_ISREG(opened.st_mode):
            raise NotRegularFile(path, opened.st_mode)
        os.set_blocking(fd, True)  # a regular file's reads never block; plain reads from here
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_prefix(path: str | os.PathLike[str], max_bytes: int) -> tuple[bytes, int]:
    """``(the first max_bytes bytes or fewer, the file's size in bytes)`` of the regular file
    ``path``; a caller compares the two to know whether the file was cut.

    Raises:
        NotRegularFile: ``path`` is not a regular file.
        OSError: it cannot be opened or read.
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        return f.read(max_bytes), size


def json_depth_over(body: bytes, limit: int) -> bool:
    """Whether the JSON text ``body`` nests objects and arrays more than ``limit`` levels deep,
    counted in one pass without recursion and without parsing (brackets inside strings do not
    count; text that is not JSON is left to the parser to refuse). The server's request bodies
    (``backend/workbench/api/security.py``) and the files read here share it."""
    depth = 0
    for match in _JSON_TOKEN.finditer(body):
        token = match.group()
        if token in (b"{", b"["):
            depth += 1
            if depth > limit:
                return True
        elif token in (b"}", b"]"):
            depth -= 1
    return False


def loads(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(raw)`` after checking its nesting is at most ``max_depth`` levels.

    Raises:
        JsonTooDeep: nested deeper than ``max_depth`` (says the limit).
        json.JSONDecodeError: not JSON.
        UnicodeDecodeError: bytes that are not UTF-8.
    """
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if json_depth_over(data, max_depth):
        raise JsonTooDeep(
            f"objects and arrays nested more than {max_depth} levels deep; the limit is {max_depth}"
        )
    return json.loads(raw)
