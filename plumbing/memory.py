"""How much memory a job can still take, asked before a large allocation so that a run that
cannot fit is one clear line rather than an out-of-memory kill (or a machine swapping itself
to a halt).

On an accelerator: its allocator's limit less what is in use. On the host: the least of the
kernel's MemAvailable and, for every cgroup this process is in that sets a memory limit (a
container's, a batch job's, a systemd slice's), that limit less what the cgroup uses. The
cgroup's inactive file cache counts as free, as the kernel reclaims it first. cgroup v2 and
v1 are both read; a limit this process cannot see is not applied.

    >>> available_bytes() is None or available_bytes() > 0
    True
    >>> human_bytes(3 * 2**30), human_bytes(512)
    ('3.0 GiB', '512 bytes')
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

UNLIMITED_V1 = 1 << 60  # cgroup v1 writes "no limit" as a huge number (9223372036854771712)
PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_bytes(device: Any = None) -> int | None:
    """Free memory for a job on `device` (a JAX device; None or a CPU device: the host), or
    None when it cannot be told."""
    if device is not None and device.platform != "cpu":
        return device_available_bytes(device)
    return host_available_bytes()


def device_available_bytes(device: Any) -> int | None:
    """An accelerator's free memory (its allocator's limit less what is in use), or None."""
    try:
        stats = device.memory_stats()
    except Exception:  # backends without stats raise or return None
        return None
    if not stats or not stats.get("bytes_limit"):
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def host_available_bytes(proc: Path | None = None, cgroup_root: Path | None = None) -> int | None:
    """The host memory this process can still take (see the module docstring); None when
    neither /proc/meminfo nor a cgroup limit can be read. `proc` and `cgroup_root` default to
    PROC and CGROUP_ROOT (tests point them at a made-up machine)."""
    proc = PROC if proc is None else proc
    cgroup_root = CGROUP_ROOT if cgroup_root is None else cgroup_root
    found = [free for free in (_mem_available(proc),) if free is not None]
    found += [max(limit - used, 0) for limit, used in cgroup_limits(proc, cgroup_root)]
    return min(found) if found else None


def cgroup_limits(proc: Path, cgroup_root: Path) -> list[tuple[int, int]]:
    """(limit, bytes in use) of every cgroup of this process, and each of its ancestors, that
    sets a memory limit."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":  # the v2 (unified) hierarchy
            v2_root = cgroup_root if (cgroup_root / "cgroup.controllers").exists() else None
            base = v2_root or cgroup_root / "unified"
            files = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # a v1 memory hierarchy
            base = cgroup_root / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for directory in _levels(base, path):
            limit = _read_int(directory / files[0])
            if limit is None or limit >= UNLIMITED_V1:
                continue
            used = _read_int(directory / files[1])
            if used is not None:
                found.append((limit, used - _stat(directory / "memory.stat", files[2])))
    return found


def _levels(base: Path, path: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount point. In a container the
    mount point is often the container's own cgroup, and the path as /proc names it does not
    exist below it: then only the mount point is read."""
    levels = [base]
    current = base
    for part in Path(path.strip()).parts[1:]:
        current = current / part
        levels.append(current)
    return [d for d in levels if d.is_dir()]


def _mem_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    """A number in a cgroup file; None for 'max' (v2: no limit) or a file that is not there."""
    try:
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _stat(path: Path, key: str) -> int:
    """One counter of a cgroup's memory.stat, 0 when it is not there."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def human_bytes(n: float) -> str:
    """A size for a message: bytes below 1 KiB, else KiB, MiB, GiB or TiB with one decimal."""
    if n < 1024:
        return f"{n:,.0f} bytes"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:,.1f} {unit}"
    return f"{n / 1024:,.1f} TiB"
