"""How much memory this process may still take: what Linux reports available, within the cgroup
limit when there is one (containers). Used before copies that cannot be paged back to a file:
page-locked expert weights (streamed_experts) and repacked experts (native.moe)."""
from __future__ import annotations


def memory_total_available() -> tuple[int, int]:
    """(total, available) bytes; (0, 0) when /proc/meminfo cannot be read."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        total, avail = info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return 0, 0
    try:                                    # cgroup v2 (containers): the limit and what is used of it
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            used = int(open("/sys/fs/cgroup/memory.current").read().strip())
            total, avail = min(total, int(limit)), min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return total, avail
