"""Stage: the log lines of a one-time start-up stage (a GGUF conversion, the blocks cache, the
kernel build, the warm-up): a line when it begins, saying what it is and that it happens once,
progress lines while it runs past a few seconds, and one when it is done, with its time.

Progress is a log line, not a terminal bar: the workers' stderr is a pipe and the logs may be
JSON, so every update must stand as a line of its own. A stage of a few seconds logs none."""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType

# a stage logs progress once it has run this long, then every PROGRESS_EVERY seconds
PROGRESS_AFTER = 3.0
PROGRESS_EVERY = 5.0


class Stage:
    """`with Stage(log, "caching the blocks of x.gguf", once=..., total=n, unit="MB") as stage:
    stage.advance(k)`. `once` says in the first line where the result is kept, so that the
    next start skips the stage. Progress lines come from a timer thread of the stage's own, so a
    step that reports nothing (a compiler, a library's writer) still shows it is running."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        once: str = "",
        total: float = 0.0,
        unit: str = "",
    ) -> None:
        self.log, self.what, self.once = log, what, once
        self.total, self.unit = total, unit
        self.done = 0.0
        self.started = 0.0
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="probserve-stage", daemon=True)

    def __enter__(self) -> Stage:
        self.started = time.monotonic()
        size = f" ({self.total:,.0f} {self.unit})" if self.total and self.unit else ""
        tail = f"; once: {self.once}" if self.once else ""
        self.log.info("%s%s%s", self.what, size, tail)
        self._ticker.start()
        return self

    def advance(self, amount: float) -> None:
        """`amount` more of `total` done."""
        self.done += amount

    def line(self) -> str:
        """The progress line: a bar and a share where the total is known."""
        seconds = time.monotonic() - self.started
        if not self.total:
            return f"{self.what}: running ({seconds:.0f} s)"
        share = min(1.0, self.done / self.total)
        bar = "#" * round(share * 20)
        return (
            f"{self.what}: [{bar:<20}] {share:4.0%} ({self.done:,.0f} of {self.total:,.0f} "
            f"{self.unit}, {seconds:.0f} s)"
        )

    def _tick(self) -> None:
        wait = PROGRESS_AFTER
        while not self._stop.wait(wait):
            self.log.info("%s", self.line())
            wait = PROGRESS_EVERY

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._ticker.join()
        seconds = time.monotonic() - self.started
        if kind is None:
            self.log.info("%s: done in %.1f s", self.what, seconds)
        else:
            self.log.info("%s: stopped after %.1f s (%s)", self.what, seconds, kind.__name__)
