"""Helpers of the communication fault tests: launching ranks (on loopback or
on the emulated two-node cluster), reading the times they print, and
checking that nothing is left behind.

Workers are ``tests/distributed/ddp_worker.py``; each prints ``FAULT_AT``
(the faulty rank, as it injects its fault) and ``ERROR_AT`` (a rank that
failed) as wall-clock times, so the time to error is measured from the
fault, not from process start (start-up takes most of a run on a busy
machine). Every measured time is printed as a ``TIME_TO_ERROR`` line, which
``tools/fault_table.py`` collects into the README's results table.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tools"))

from _launch import WORKER, base_env, free_port, torchrun_variables  # noqa: E402

# Seconds the whole launch of one case may take before its ranks are killed
# (start-up on a loaded 2-core machine is slow; the bounds that matter are
# measured from the fault).
LAUNCH_LIMIT = 240.0


@dataclass
class Ran:
    """One rank's process and what it printed."""

    rank: int
    pid: int
    returncode: int | None
    stdout: str
    stderr: str

    def line(self, prefix: str) -> str | None:
        """The first stdout line starting with ``prefix``, without it."""
        for line in self.stdout.splitlines():
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        return None

    def time_of(self, marker: str) -> float | None:
        """The wall-clock time a ``FAULT_AT``/``ERROR_AT`` line gives."""
        value = self.line(marker + " ")
        return float(value) if value is not None else None

    @property
    def error(self) -> str:
        """The ``WORKER_ERROR`` line (type and message), or ``""``."""
        return self.line("WORKER_ERROR ") or ""


def describe(ranks: list[Ran]) -> str:
    return "\n".join(
        f"--- rank {r.rank} rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-3000:]}"
        for r in ranks
    )


class Job:
    """Ranks started with torchrun-style variables; output goes to files so
    a test can watch it while the ranks run.

    ``timeout`` is the engine's timeout in seconds, every case's
    ``TIACC_TRAINING_TIMEOUT`` (as ``str`` writes it); ``env`` adds other
    variables.
    """

    def __init__(
        self,
        world: int,
        args: list[str],
        out: Path,
        timeout: float,
        env: dict[str, str] | None = None,
        rank_env: Callable[[int], dict[str, str]] | None = None,
        command: Callable[[int, list[str]], list[str]] | None = None,
        master_addr: str = "127.0.0.1",
        local_size: int | None = None,
    ) -> None:
        self.out = out
        self.port = free_port()
        self.procs: list[subprocess.Popen[str]] = []
        out.mkdir(parents=True, exist_ok=True)
        for rank in range(world):
            variables = base_env({"TIACC_TRAINING_TIMEOUT": str(timeout), **(env or {})})
            variables.update(torchrun_variables(rank, world, self.port, local_size, master_addr))
            variables.update(rank_env(rank) if rank_env else {})
            argv = [sys.executable, str(WORKER), "--out", str(out), *args]
            argv = command(rank, argv) if command else argv
            self.procs.append(
                subprocess.Popen(
                    argv,
                    env=variables,
                    stdout=open(out / f"rank{rank}.out", "w"),  # noqa: SIM115
                    stderr=open(out / f"rank{rank}.err", "w"),  # noqa: SIM115
                    text=True,
                )
            )

    def output(self, rank: int) -> str:
        return (self.out / f"rank{rank}.out").read_text()

    def wait_for(self, rank: int, text: str, limit: float = LAUNCH_LIMIT) -> None:
        """Waits until ``rank`` printed ``text`` (fails if it exits first)."""
        end = time.monotonic() + limit
        while text not in self.output(rank):
            if self.procs[rank].poll() is not None or time.monotonic() > end:
                self.kill()
                pytest.fail(f"rank {rank} never printed {text!r}:\n{describe(self.results())}")
            time.sleep(0.05)

    def finish(self, limit: float = LAUNCH_LIMIT, kill: tuple[int, ...] = ()) -> list[Ran]:
        """Waits for every rank (SIGKILLing ``kill`` ranks once the others
        are done, and any rank still running at ``limit``)."""
        end = time.monotonic() + limit
        for rank, proc in enumerate(self.procs):
            if rank in kill:
                continue
            try:
                proc.wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for rank in kill:
            self.procs[rank].send_signal(signal.SIGKILL)
            self.procs[rank].wait()
        return self.results()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def results(self) -> list[Ran]:
        return [
            Ran(
                rank,
                proc.pid,
                proc.returncode,
                self.output(rank),
                (self.out / f"rank{rank}.err").read_text(),
            )
            for rank, proc in enumerate(self.procs)
        ]


def time_to_error(case: str, ranks: list[Ran], fault_rank: int) -> list[float]:
    """Seconds from the fault to each rank's error (the faulty rank's too
    when it lives to report one), printed as ``TIME_TO_ERROR`` lines."""
    fault = ranks[fault_rank].time_of("FAULT_AT")
    assert fault is not None, describe(ranks)
    times = []
    for r in ranks:
        at = r.time_of("ERROR_AT")
        if at is None and r.rank == fault_rank:
            continue  # killed or stopped: it cannot report
        assert at is not None, describe(ranks)
        times.append(at - fault)
        print(f"TIME_TO_ERROR {case} rank={r.rank} seconds={at - fault:.2f}")
    return times


def report(case: str, **values: object) -> None:
    """Prints one measured result for the results table."""
    fields = " ".join(f"{k}={v}" for k, v in values.items())
    print(f"FAULT_RESULT {case} {fields}")


def assert_nothing_left(ranks: list[Ran]) -> None:
    """Every rank's process is gone, and no socket is left on the job's
    ports (the store's and each engine's listener) on this host."""
    for r in ranks:
        assert r.returncode is not None, f"rank {r.rank} still running"
        assert not Path(f"/proc/{r.pid}").exists() or _zombie_free(r.pid), f"rank {r.rank} left"
    children = [
        pid
        for pid in os.listdir("/proc")
        if pid.isdigit() and _parent(int(pid)) == os.getpid() and _alive(int(pid))
    ]
    assert children == [], f"processes left behind: {children}"
    ports = {int(p) for r in ranks for p in (r.line("PORTS ") or "").split()}
    # A socket still bound to one of these ports, in any state but
    # TIME_WAIT (which the kernel keeps after a clean close, no process).
    left = [entry for entry in _sockets() if entry[0] in ports and entry[1] != "06"]
    assert left == [], f"sockets left on the job's ports {sorted(ports)}: {left}"


def _parent(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _zombie_free(pid: int) -> bool:
    """A pid that exists again belongs to something else, not our rank."""
    return _parent(pid) != os.getpid()


def _sockets() -> list[tuple[int, str]]:
    """(local port, state) of every TCP socket in this network namespace."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            out.append((int(fields[1].rsplit(":", 1)[1], 16), fields[3]))
    return out


def netns_available() -> None:
    """Skips the calling test unless network namespaces can be made here."""
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces (CI runs as root)")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs iproute2 (ip, tc) for the emulated cluster: make setup installs it")


def in_namespace(node: object, argv: list[str]) -> list[str]:
    return node.command(argv)  # type: ignore[attr-defined]


@contextmanager
def two_nodes(rate_mbit: float = 1000.0) -> Iterator[tuple[object, ...]]:
    """The emulated two-node cluster (``tools/netns_cluster.py``)."""
    netns_available()
    from netns_cluster import cluster

    with cluster(rate_mbit=rate_mbit) as nodes:
        yield nodes


def require_netem() -> None:
    """Skips the calling test unless the kernel has the netem qdisc (tried on
    the loopback device of a throwaway namespace)."""
    netns_available()
    probe = "tiacc-netem-probe"
    subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True)
    try:
        tried = subprocess.run(
            ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root"]
            + ["netem", "delay", "1ms"],
            capture_output=True,
            text=True,
        )
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    if tried.returncode != 0:
        pytest.skip(f"this kernel has no netem qdisc (sch_netem): {tried.stderr.strip()}")


def netem(node: object, spec: list[str]) -> None:
    """Replaces the rate limit on ``node``'s end of the link with ``tc netem``
    (``spec``: e.g. ``loss 5% delay 50ms``)."""
    veth = node.veth  # type: ignore[attr-defined]
    argv = ["tc", "qdisc", "replace", "dev", veth, "root", "netem", *spec]
    subprocess.run(in_namespace(node, argv), check=True, capture_output=True)


def link_down(node: object) -> None:
    veth = node.veth  # type: ignore[attr-defined]
    subprocess.run(
        in_namespace(node, ["ip", "link", "set", veth, "down"]), check=True, capture_output=True
    )


def error_type(r: Ran) -> str:
    """The engine's exception type in the ``WORKER_ERROR`` line (DDP may wrap
    it in a ``RuntimeError`` that quotes it), else the line's own type."""
    found = re.search(r"\b(CommTimeoutError|CommError|ConfigError)\b", r.error)
    return found.group(1) if found else r.error.split(":", 1)[0]


def mentions(text: str, pattern: str) -> bool:
    return re.search(pattern, text) is not None
