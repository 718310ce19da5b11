"""Linux process supervision for the shared engine: a process's identity (pid and start time, so
a reused pid is not taken for it) and state from ``/proc``, the members of its process group, ending
it with its group (``_end_process``), and what tells a kill from outside from a crash: the
out-of-memory kills its memory cgroup counts, and its exit status."""
from __future__ import annotations

import os
import signal
import time
from typing import Optional


def _stat(pid: int) -> Optional[list[str]]:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2:].split()
    except (OSError, ValueError):
        return None


def _process_identity(pid: int) -> tuple[int, int]:
    """(pid, start time in clock ticks since boot): a pid alone may name another process once
    this one is gone. The start time is 0 where /proc is missing."""
    fields = _stat(pid)
    try:
        return pid, int(fields[19]) if fields is not None else 0
    except (ValueError, IndexError):
        return pid, 0


def _process_state(process: tuple[int, int]) -> str:
    """"gone" (exited, or its pid reused), "zombie" (exited, not reaped yet), "stopped" (SIGSTOP,
    a frozen job control, a tracer) or "alive"."""
    pid, started = process
    fields = _stat(pid)
    if fields is None:
        if not os.path.isdir("/proc/self"):  # no /proc: ask the kernel
            try:
                os.kill(pid, 0)
                return "alive"
            except OSError:
                return "gone"
        return "gone"
    if started and int(fields[19]) != started:
        return "gone"
    if fields[0] in ("Z", "X"):
        return "zombie"
    return "stopped" if fields[0] in ("T", "t") else "alive"


def _exists(process: tuple[int, int]) -> bool:
    """Whether the process has not exited (it may be stopped)."""
    return _process_state(process) in ("alive", "stopped")


def _group_members(leader: tuple[int, int]) -> list[tuple[int, int]]:
    """The processes, other than ``leader``, of the process group ``leader`` made (the shared
    engine makes its own as it starts: ``_own_process_group``), started no earlier than it: what
    it started, which may outlive it (vLLM's engine core). [] where /proc is missing."""
    pid, started = leader
    if _process_state(leader) == "gone" and _stat(pid) is not None:
        return []  # its pid is another process's: its group cannot have members left
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    members = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == pid:
            continue
        fields = _stat(int(entry))
        try:
            if (fields is not None and fields[0] not in ("Z", "X") and int(fields[2]) == pid
                    and int(fields[19]) >= started):
                members.append((int(entry), int(fields[19])))
        except (ValueError, IndexError):
            continue
    return members


def _end_process(process: tuple[int, int], wait_s: float = 10.0) -> bool:
    """SIGKILL the process, if it is still the one named, and every process left of its group
    (``_group_members``), whether it is still there or not; wait up to ``wait_s`` for all of
    them to exit (the GPU memory they held is freed as they do). Whether none is left."""
    pid = process[0]
    members = _group_members(process)
    if _exists(process):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if members:
        try:
            os.killpg(pid, signal.SIGKILL)  # the group is theirs: its id cannot be reused meanwhile
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    while _exists(process) or _group_members(process):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


_CGROUP_ROOT = "/sys/fs/cgroup"


def _oom_kill_file(pid: int) -> Optional[str]:
    """The file that counts the out-of-memory kills of the process's memory cgroup: cgroup v2's
    ``memory.events``, else v1's ``memory.oom_control`` (each with an ``oom_kill`` line), under
    the cgroup's path or, where the container sees its own cgroup as the root, at the root. None
    where neither is there (no cgroup memory controller, another OS)."""
    paths = {"v2": "/", "v1": "/"}
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    paths["v2"] = path
                elif "memory" in controllers.split(","):
                    paths["v1"] = path
    except (OSError, ValueError):
        pass
    candidates = (
        os.path.join(_CGROUP_ROOT, paths["v2"].lstrip("/"), "memory.events"),
        os.path.join(_CGROUP_ROOT, "memory.events"),
        os.path.join(_CGROUP_ROOT, "memory", paths["v1"].lstrip("/"), "memory.oom_control"),
        os.path.join(_CGROUP_ROOT, "memory", "memory.oom_control"))
    return next((c for c in candidates if os.path.isfile(c)), None)


def _oom_kills(path: Optional[str]) -> Optional[int]:
    if path is None:
        return None
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def _describe_exit(status: int) -> str:
    if status < 0:
        try:
            return f"ended by {signal.Signals(-status).name}"
        except ValueError:
            return f"ended by signal {-status}"
    return f"exited with status {status}"
