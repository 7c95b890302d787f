"""The free-core cap on a step's threads (runtime/kernels/cores.py), on /proc/stat files written here: what
others used is the allowed CPUs' busy time less this process's own CPU time, per second of wall clock."""
import os

import pytest

from runtime.kernels.cores import CoreMonitor, free_cores


def stat_text(busy: dict, idle: int = 1000) -> str:
    """A /proc/stat with per-CPU user time ``busy[cpu]`` jiffies (system and the rest 0)."""
    lines = [f"cpu  {sum(busy.values())} 0 0 {idle * len(busy)} 0 0 0 0 0 0"]
    lines += [f"cpu{c} {b} 0 0 {idle} 0 0 0 777 0 0" for c, b in sorted(busy.items())]
    return "\n".join(lines + ["intr 12345 0 0", "ctxt 999", "procs_running 3"]) + "\n"


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_others_use_is_busy_time_less_our_own(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    wall, own = Clock(), Clock()
    m = CoreMonitor(interval=0.1, stat=str(stat), cpus=[0, 1], clock=wall, cpu_time=own)
    busy = {0: 0, 1: 0, 2: 0}
    stat.write_text(stat_text(busy))
    assert m.free() == 2                                   # nothing to compare yet: all of them
    # 1 s: CPU 0 fully busy with us (1 s of our CPU time), CPU 1 idle -> nobody else: 2 free
    wall.t, own.t = 1.0, 1.0
    busy[0] += tick
    stat.write_text(stat_text(busy))
    assert m.free() == 2 and m.others == pytest.approx(0.0)
    # the next second: another process takes CPU 1 whole, we still use CPU 0 -> 1 free
    wall.t, own.t = 2.0, 2.0
    busy[0] += tick
    busy[1] += tick
    stat.write_text(stat_text(busy))
    assert m.free() == 1 and m.others == pytest.approx(1.0)
    # a CPU outside this process's affinity (2) is not counted, however busy
    wall.t, own.t = 3.0, 3.0
    busy[0] += tick
    busy[2] += tick
    stat.write_text(stat_text(busy))
    assert m.free() == 2
    # remeasured only after `interval`: within it the last answer stands, whatever the file says
    busy[1] += 50 * tick
    stat.write_text(stat_text(busy))
    wall.t = 3.05
    assert m.free() == 2
    # a light load (0.3 of a CPU) rounds to none: 2 free; 0.6 of one rounds to a whole one: 1 free
    wall.t, own.t = 4.0, 4.0
    busy[1] -= 50 * tick
    busy[0] += tick
    busy[1] += int(0.3 * tick)
    stat.write_text(stat_text(busy))
    assert m.free() == 2
    wall.t, own.t = 5.0, 5.0
    busy[0] += tick
    busy[1] += int(0.6 * tick)
    stat.write_text(stat_text(busy))
    assert m.free() == 1
    # never below one, whatever others take
    wall.t, own.t = 6.0, 6.0
    busy[0] += 2 * tick
    busy[1] += 2 * tick
    stat.write_text(stat_text(busy))
    assert m.free() == 1


def test_unreadable_stat_leaves_the_cap_off(tmp_path):
    m = CoreMonitor(stat=str(tmp_path / "missing"), cpus=[0, 1, 2])
    assert m.free() == 3 and m.broken


def test_switch_off_and_this_machine(monkeypatch):
    monkeypatch.setenv("TIERED_MOE_ADAPT_THREADS", "0")
    assert free_cores() is None
    monkeypatch.delenv("TIERED_MOE_ADAPT_THREADS")
    n = free_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))
