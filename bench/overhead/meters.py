"""What is read off the processes and the machine: CPU and RSS from /proc, and a meter of CPU
between two moments."""

from __future__ import annotations

import os
import resource
import sys
import time

__all__ = ["CpuMeter", "log", "proc_cpu_s", "proc_rss_mb", "system_busy_s"]

CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    """A progress line on stderr (the report goes to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, all threads, in seconds (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_rss_mb(pid: int) -> float:
    """Resident set size of a process, MB (VmRSS in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise KeyError("VmRSS")


def system_busy_s() -> float:
    """CPU seconds all cores spent not idle (/proc/stat), to see load we did not cause."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:9]]
    return (sum(vals) - vals[3] - vals[4]) / CLK_TCK


class CpuMeter:
    """CPU used by each of some processes, by this process, and by the whole machine, between
    ``__enter__`` and ``__exit__``."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.delta: dict[str, float] = {}
        self.self_s = 0.0
        self.system_s = 0.0
        self.wall_s = 0.0

    def _snap(self) -> tuple[dict[str, float], float, float, float]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return (
            {k: proc_cpu_s(p) for k, p in self.pids.items()},
            r.ru_utime + r.ru_stime,
            system_busy_s(),
            time.monotonic(),
        )

    def __enter__(self) -> CpuMeter:
        self._before = self._snap()
        return self

    def __exit__(self, *exc: object) -> None:
        (p0, s0, b0, w0), (p1, s1, b1, w1) = self._before, self._snap()
        self.delta = {k: p1[k] - p0[k] for k in p0}
        self.self_s = s1 - s0
        self.system_s = b1 - b0
        self.wall_s = w1 - w0

    def other_cores(self, *extra_cpu_s: float) -> float:
        """Cores the machine spent outside the metered processes, this one and ``extra_cpu_s``
        (e.g. h2load's), over the metered interval."""
        busy = self.system_s - sum(self.delta.values()) - self.self_s - sum(extra_cpu_s)
        return max(0.0, busy) / self.wall_s if self.wall_s else 0.0
