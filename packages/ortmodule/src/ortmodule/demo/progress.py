"""The one-line progress bar each run prints on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """A one-line progress bar on stderr: steps, loss, steps/s.

    On a terminal the line is redrawn in place; otherwise (a pipe, CI logs) a plain line is
    printed every tenth of the run, so logs stay readable.

    >>> import io
    >>> bar = ProgressBar("eager", total=4, stream=io.StringIO())
    >>> for step in range(4):
    ...     bar.update(step + 1, loss=1.0)
    >>> bar.close()
    """

    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, width: int = 24
    ) -> None:
        self.label = label
        self.total = max(1, total)
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.width = width
        self.every = max(1, self.total // 10)
        self._first_done: float | None = None
        self._last_draw = 0.0

    def start(self, note: str = "") -> None:
        """Show the bar before the first step (which may take a while: export and build)."""
        if self.tty:
            self._draw(0, None, note)
        elif note:
            self._line(f"{self.label}: {note}")

    def update(self, done: int, loss: float) -> None:
        now = time.perf_counter()
        if self._first_done is None:
            self._first_done = now
        if self.tty:
            if now - self._last_draw >= 0.1 or done >= self.total:
                self._draw(done, loss)
                self._last_draw = now
        elif done == 1 or done % self.every == 0 or done >= self.total:
            self._line(
                f"{self.label}: step {done}/{self.total}  loss {loss:.4f}  {self._rate(done, now)}"
            )

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _rate(self, done: int, now: float) -> str:
        # the first step (export and graph build for ORTModule) is left out of the rate
        if self._first_done is None or done < 2 or now <= self._first_done:
            return "- steps/s"
        return f"{(done - 1) / (now - self._first_done):.1f} steps/s"

    def _draw(self, done: int, loss: float | None, note: str = "") -> None:
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"{self.label:<10} [{bar}] {done:>{len(str(self.total))}}/{self.total}"
        if loss is not None:
            text += f"  loss {loss:.4f}  {self._rate(done, time.perf_counter())}"
        if note:
            text += f"  {note}"
        self.stream.write("\r\x1b[2K" + text)
        self.stream.flush()

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
