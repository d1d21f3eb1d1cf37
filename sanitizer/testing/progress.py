"""A campaign's progress on stderr: one redrawn line on a terminal, else a line at each tenth of the cases.

Shared by ``ownsan fuzz`` (the project's campaign) and ``ownsan fuzz --consumer`` (a user's consumer).
"""
from __future__ import annotations

import sys
import time
from typing import Any


class ProgressLine:
    """Call it with ``(done, total, failures)`` after each case or batch; ``noun`` names what is counted."""

    def __init__(self, stream: Any = None, noun: str = "cases"):
        self.stream = stream or sys.stderr
        self.noun = noun
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.shown = 0  # tenths already printed (not a terminal)

    def __call__(self, done: int, total: int, failures: int) -> None:
        elapsed = time.monotonic() - self.start
        eta = f", about {elapsed / done * (total - done):.0f} s left" if 0 < done < total else ""
        line = f"fuzz: {done}/{total} {self.noun}, {failures} failure{'s' * (failures != 1)}, {elapsed:.1f} s{eta}"
        if self.tty:
            self.stream.write(f"\r{line}\x1b[K" + ("\n" if done >= total else ""))
        elif done * 10 // total > self.shown or done == total:
            self.shown = done * 10 // total
            self.stream.write(line + "\n")
        else:
            return
        self.stream.flush()

    def end(self, done: int, total: int, failures: int) -> None:
        """The last line, always shown (a run stopped at a failure ends short of ``total``, between tenths)."""
        elapsed = time.monotonic() - self.start
        line = f"fuzz: {done}/{total} {self.noun}, {failures} failure{'s' * (failures != 1)}, {elapsed:.1f} s"
        self.stream.write((f"\r{line}\x1b[K\n") if self.tty else line + "\n")
        self.stream.flush()


__all__ = ["ProgressLine"]
