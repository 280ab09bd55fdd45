"""A progress line on stderr for long runs, with no dependency.

On a terminal it redraws one line (``\\r``); into a log file it writes a line at every 10% so
logs stay short. Only the main rank reports.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """``Progress(total, label)``; ``update(done, **fields)`` after each unit of work; ``close()``."""

    WIDTH = 24

    def __init__(self, total: int, label: str, stream=None, enabled: bool = True):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.start = time.perf_counter()
        self._last_decile = -1

    def update(self, done: int, **fields) -> None:
        if not self.enabled:
            return
        decile = 10 * done // self.total
        if not self.tty and decile == self._last_decile and done != self.total:
            return
        self._last_decile = decile
        filled = self.WIDTH * done // self.total
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        extra = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        line = f"{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{self.total} {elapsed:.0f}s (eta {eta:.0f}s) {extra}"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
