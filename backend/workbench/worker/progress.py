"""Progress output of ``workbench train``: a one-line bar on a terminal, plain lines otherwise
(the backend captures plain lines into ``DIR/worker.log``)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24


def _fmt_s(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60:d}:{seconds % 60:02d}"


class Progress:
    """``stage(...)`` for stage 1, ``step(...)`` for stage 2, ``line(...)`` for anything else."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None, log_every: int = 1):
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.log_every = log_every
        self._open = False  # a bar is drawn on the current line
        self._t0: float | None = None
        self._first_step: int | None = None

    def _bar(self, done: int, total: int) -> str:
        filled = int(BAR_WIDTH * done / max(total, 1))
        return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"

    def _draw(self, text: str) -> None:
        self.stream.write("\r\x1b[2K" + text)
        self.stream.flush()
        self._open = True

    def line(self, text: str) -> None:
        if self._open:
            self.stream.write("\n")
            self._open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def stage(self, stage: str, done: int, total: int, message: str) -> None:
        text = f"{stage:<5} {done}/{total} {message}"
        if self.tty:
            self._draw(f"{stage:<5} {self._bar(done, total)} {done}/{total} {message}")
            if done >= total:
                self.line("")
        elif done >= total or done == 1:
            self.line(text)

    def step(self, step: int, total: int, loss: float, step_s: float) -> None:
        now = time.perf_counter()
        if self._t0 is None:
            self._t0, self._first_step = now - step_s, step - 1
        done = step - (self._first_step or 0)
        rate = (now - self._t0) / max(done, 1)  # s/step over this session's steps
        eta = rate * (total - step)
        text = f"step {step}/{total} loss {loss:.4f} {rate:.2f} s/step ETA {_fmt_s(eta)}"
        if self.tty:
            self._draw(f"train {self._bar(step, total)} {text}")
            if step >= total:
                self.line("")
        elif step % self.log_every == 0 or step >= total or step == 1:
            self.line(text)

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
