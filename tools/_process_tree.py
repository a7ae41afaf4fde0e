"""The processes a command started, and stopping them all when it ends.

A stage of the GPU check (``gpu_check.py``) runs each command in a session
of its own; pytest-xdist workers, the ranks a test starts and torchrun's
agents may start sessions of their own too, and outlive a command that is
killed. Here a command's processes are found by parent links and by
session and process group, each remembered with its start time so that a
pid the system has since given to another process is never signalled.
Nothing is looked up by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass

# How often a wait looks again (seconds).
POLL = 0.1


def exited(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` has exited, without reaping it."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored)
        return True


@dataclass(frozen=True)
class _Task:
    """One process, from ``/proc/<pid>/stat``."""

    ppid: int
    pgrp: int
    session: int
    start: int  # clock ticks after boot: tells a process from a later one with its pid


def _processes() -> dict[int, _Task]:
    """Every process that has not exited (zombies left out), by pid."""
    table = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the command's name
            except OSError:  # exited meanwhile
                continue
            if fields[0] != "Z":
                pid, numbers = int(entry), [int(fields[i]) for i in (1, 2, 3, 19)]
                table[pid] = _Task(*numbers)
    return table


def stage_processes(root: int) -> dict[int, int]:
    """What the stage command ``root`` started and still runs (pid: start time).

    Its descendants by parent links, read in one pass before anything is
    signalled (a killed process's children move to init), and the members
    of its session or process group that outlived their parents (with
    their own descendants). ``root`` itself is left out.
    """
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, task in table.items():
        children.setdefault(task.ppid, []).append(pid)
    todo = [root, *(pid for pid, task in table.items() if root in (task.session, task.pgrp))]
    found: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return {pid: table[pid].start for pid in found - {root} if pid in table}


def _live(pids: dict[int, int]) -> dict[int, int]:
    """Those of ``pids`` still running as the same processes (same start time)."""
    table = _processes()
    return {pid: start for pid, start in pids.items() if pid in table and table[pid].start == start}


def _signal(root: int, pids: dict[int, int], sig: signal.Signals) -> None:
    """Sends ``sig`` to ``root``'s process group and to each of ``pids`` still live."""
    for send, target in ((os.killpg, root), *((os.kill, pid) for pid in _live(pids))):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            send(target, sig)


def _gone(proc: subprocess.Popen, pids: dict[int, int], within: float) -> bool:
    """Waits up to ``within`` seconds for ``proc`` and ``pids`` to exit; whether they did."""
    deadline = time.monotonic() + within
    while not (exited(proc) and not _live(pids)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL)
    return True


def stop_processes(proc: subprocess.Popen, seen: dict[int, int], grace: float) -> int:
    """Stops the stage command ``proc`` if it runs, and every process it left running.

    ``proc`` must not have been reaped (its group's id stays its own). Only
    its process group, its descendants, the members of its session, and
    the processes of ``seen`` (descendants seen earlier, each still the
    same process) are signalled: SIGTERM, ``grace`` seconds to exit, then
    SIGKILL to what is left, looked for again. Returns how many processes
    besides ``proc`` it found running.
    """
    pids = _live({**seen, **stage_processes(proc.pid)})
    if not pids and exited(proc):
        return 0
    _signal(proc.pid, pids, signal.SIGTERM)
    if not _gone(proc, pids, grace):
        _signal(proc.pid, {**pids, **stage_processes(proc.pid)}, signal.SIGKILL)
        _gone(proc, pids, grace)
    return len(pids)
