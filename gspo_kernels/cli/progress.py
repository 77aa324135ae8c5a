"""One status line that rewrites itself on a terminal and stays quiet in a log."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, stream=None) -> None:
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.start = time.perf_counter()
        self._last_line = 0.0

    def step(self, label: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        line = f"[{self.done}/{self.total} {elapsed:5.0f}s] {label}"
        if self.live:
            self.stream.write("\r" + line[:120].ljust(120))
            self.stream.flush()
        elif elapsed - self._last_line >= 10 or self.done == self.total:
            # In a log, one line every 10 s at most: enough to see it is alive.
            self._last_line = elapsed
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.live:
            self.stream.write("\r" + " " * 120 + "\r")
            self.stream.flush()
