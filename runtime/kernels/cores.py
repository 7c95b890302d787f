"""How many of this process's CPUs other processes leave free: the cap on the threads a step splits its work over.

Why: a step's parallel kernels split their work statically and the pool's threads spin between kernels (the gaps
are shorter than a sleep and wake-up; runtime/kernels/moe_cpu.c). On a machine another busy process shares, a
thread of ours that the kernel deschedules stalls every other one at the next join, and the spinners take the
core it needs: on a 2-core machine with one busy process, 2 threads decoded at 0.12x of 1 thread (issue 30).
Threads beyond the free cores only cost, so the model's forward takes min(--threads, free cores).

Measured, not guessed: over the last ``interval`` seconds, the busy time of the CPUs this process may run on
(/proc/stat: user, nice, system, irq, softirq; a VM's steal time is the host's, not another process's) less
this process's own CPU time (all of its threads, spinners included) is what others used; free = allowed CPUs -
that, rounded to the nearest whole core, at least 1. /proc/stat counts the whole machine's CPUs, so a container
limited by a CPU quota (not a cpuset) sees the machine's. ``TIERED_MOE_ADAPT_THREADS=0`` turns the cap off."""
from __future__ import annotations

import os
import time


def _allowed() -> list:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


class CoreMonitor:
    """``free()``: the whole CPUs others leave this process, remeasured at most every ``interval`` seconds
    (the first call, with nothing to compare, says all of them). ``stat``, ``clock`` and ``cpu_time`` are
    injectable for tests (a /proc/stat path, wall-clock and process-CPU-time functions)."""

    def __init__(self, interval: float = 0.1, stat: str = "/proc/stat", cpus: "list | None" = None,
                 clock=time.monotonic, cpu_time=time.process_time) -> None:
        self.interval, self.stat = interval, stat
        self.cpus = set(cpus if cpus is not None else _allowed())
        self.clock, self.cpu_time = clock, cpu_time
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._free = len(self.cpus)
        self.others = 0.0          # CPUs' worth of time others used over the last interval
        self._last = None          # (wall, busy seconds of the allowed CPUs, this process's CPU seconds)
        self.broken = False        # /proc/stat unreadable: the cap stays off

    def _busy(self) -> float:
        """Busy seconds so far of the allowed CPUs."""
        busy = 0
        with open(self.stat) as f:
            for line in f:
                if not line.startswith("cpu"):
                    break                              # the per-CPU lines come first
                name, *v = line.split()
                if name != "cpu" and int(name[3:]) in self.cpus:   # ("cpu": all CPUs summed)
                    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in v[:7])
                    busy += user + nice + system + irq + softirq
        return busy / self.tick

    def free(self) -> int:
        if self.broken:
            return len(self.cpus)
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.interval:
            return self._free
        try:
            sample = (now, self._busy(), self.cpu_time())
        except (OSError, ValueError):
            self.broken = True
            return len(self.cpus)
        if self._last is not None:
            wall = sample[0] - self._last[0]
            others = ((sample[1] - self._last[1]) - (sample[2] - self._last[2])) / wall
            self.others = max(0.0, others)
            self._free = max(1, min(len(self.cpus), int(len(self.cpus) - self.others + 0.5)))
        self._last = sample
        return self._free


_monitor = None


def free_cores() -> "int | None":
    """The process-wide monitor's answer, or None when turned off (TIERED_MOE_ADAPT_THREADS=0)."""
    global _monitor
    if os.environ.get("TIERED_MOE_ADAPT_THREADS", "1") == "0":
        return None
    if _monitor is None:
        _monitor = CoreMonitor()
    return _monitor.free()
