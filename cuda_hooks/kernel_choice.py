"""Serial or parallel: which CPU hash kernel runs a large input, chosen by how fast each ran lately.

Why: the parallel kernel is a fork-join over numba's thread pool.  On an idle
machine it halves the time (2 threads read 79 GB/s where one reads 42, from
DRAM), but when the CPUs are oversubscribed a woken worker waits for its
turn, and the join with it: on the 2-core dev machine at load average 14 a
32 MiB hash took 47-60 ms in parallel against 0.9-1.1 ms serial, and a
256 MiB one 60-98 ms against 43-57 ms.  No fixed size threshold serves both
machines, so for inputs above :data:`PARALLEL_MIN_BYTES` the process measures:
each kernel's seconds per byte over its last few calls, the cheaper one runs,
and the other one is tried again now and then (a probe), less often while
the probes confirm the choice.  The kernels give bit-identical hashes, so
only the time depends on the choice.

This module imports neither numba nor numpy; :mod:`cuda_hooks.cpu` times the
calls and reports them here.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Deque, Dict, Tuple

__all__ = ["KernelChoice", "SERIAL", "PARALLEL", "PARALLEL_MIN_BYTES", "SAMPLES", "MIN_PROBE_INTERVAL",
           "MAX_PROBE_INTERVAL"]

#: Below this size the serial kernel is used, always. Waking numba's thread
#: pool is a fork-join: on a busy machine (torch's own pool, other processes)
#: a descheduled worker stalls the join for one or more scheduler ticks.
#: Re-measured on the 2-core dev machine (serial / parallel, best and median
#: of 21 interleaved calls): at its quietest the parallel kernel wins from
#: 2 MiB (16 MiB 0.21 / 0.11 ms, 32 MiB 0.61 / 0.33 ms), but at load average
#: 5.5 its median was 3-30 ms at every size from 1 to 128 MiB (serial 0.03-3.5
#: ms). Below 32 MiB the best gain is under 0.3 ms, not worth a stall (nor a
#: probe by :class:`KernelChoice`, which decides above); the stored machine
#: code (:mod:`cuda_hooks.machine_code`) runs the serial hash below it; a loader's tensors are mostly below and often still in cache.
PARALLEL_MIN_BYTES = 32 << 20

SERIAL = "serial"
PARALLEL = "parallel"
#: Calls remembered per kernel; the estimate is their median, so one stalled call does not flip the choice.
SAMPLES = 3
#: Calls of the chosen kernel between two probes of the other one: starts here, doubles each time a
#: probe confirms the choice (up to the maximum), and starts again here when a probe changes it.
MIN_PROBE_INTERVAL = 4
MAX_PROBE_INTERVAL = 64


class KernelChoice:
    """The kernel to run next for a large input, from the measured seconds per byte of each (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: Dict[str, Deque[float]] = {SERIAL: deque(maxlen=SAMPLES), PARALLEL: deque(maxlen=SAMPLES)}
        self._interval = MIN_PROBE_INTERVAL
        self._until_probe = MIN_PROBE_INTERVAL
        self.runs: Dict[str, int] = {SERIAL: 0, PARALLEL: 0}

    def pick(self) -> Tuple[str, bool]:
        """``(kernel, is_probe)``: parallel first, then serial once, then the cheaper with periodic probes."""
        with self._lock:
            if not self._samples[PARALLEL]:
                return PARALLEL, True
            if not self._samples[SERIAL]:
                return SERIAL, True
            best = self._best()
            if self._until_probe <= 0:
                self._until_probe = self._interval  # record() reschedules from the probe's outcome
                return (SERIAL if best == PARALLEL else PARALLEL), True
            self._until_probe -= 1
            return best, False

    def record(self, kernel: str, seconds_per_byte: float, probe: bool) -> None:
        """Remember one timed call of ``kernel``; after a probe, schedule the next one."""
        if kernel not in self._samples:
            raise ValueError(f"kernel must be {SERIAL!r} or {PARALLEL!r}, got {kernel!r}")
        with self._lock:
            before = self._best() if all(self._samples.values()) else None
            self._samples[kernel].append(seconds_per_byte)
            self.runs[kernel] += 1
            if probe and before is not None:
                confirmed = self._best() == before
                self._interval = min(2 * self._interval, MAX_PROBE_INTERVAL) if confirmed else MIN_PROBE_INTERVAL
                self._until_probe = self._interval

    def estimate(self, kernel: str) -> float:
        """Seconds per byte expected of ``kernel`` (median of its last calls; inf before any)."""
        with self._lock:
            return self._estimate(kernel)

    def _estimate(self, kernel: str) -> float:
        samples = sorted(self._samples[kernel])
        return samples[len(samples) // 2] if samples else float("inf")

    def _best(self) -> str:
        return PARALLEL if self._estimate(PARALLEL) <= self._estimate(SERIAL) else SERIAL
