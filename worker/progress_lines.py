"""Progress as whole lines, for where no terminal redraws a bar: a pod's log, a file, a pipe.

A bar redrawn with carriage returns is one ever-growing line in such a log. This prints a line
every `every_s` (done, total, rate, ETA) and one at the end; the same interface as the tqdm bar
the command uses on a terminal (`update(n)`, `close()`).
"""

from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class LineProgress:
    """The rate is that since the previous line, so a run that stands still shows 0 ev/s at once;
    `update(0)` from a timer keeps the lines coming while nothing moves."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", unit: str = "ev", every_s: float = 30.0,
                 out=None, clock=time.monotonic):
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.every_s, self.out, self.clock = every_s, out, clock
        self.started = self.printed = clock()
        self.n_printed = initial

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self.printed >= self.every_s:
            self._line()

    def close(self) -> None:
        self._line()

    def _line(self) -> None:
        now = self.clock()
        rate = (self.n - self.n_printed) / max(now - self.printed, 1e-9)
        self.printed, self.n_printed = now, self.n
        left = max(self.total - self.n, 0)
        eta = "0m00s" if left == 0 else _duration(left / rate) if rate > 0 else "unknown"
        pct = 100 * self.n / self.total if self.total else 100.0
        print(f"{self.desc}: {self.n}/{self.total} {self.unit} ({pct:.0f}%), {rate:.1f} {self.unit}/s, "
              f"{_duration(now - self.started)} elapsed, ETA {eta}", file=self.out or sys.stderr, flush=True)
