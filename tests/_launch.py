"""Launch helpers for the multi-process tests: plain processes on loopback.

Shared by ``tests/distributed`` and ``tests/gpu`` (this folder is on
``sys.path`` through its conftest), and :func:`free_port` by every launcher
of the tests, benches and tools (which put this folder on ``sys.path``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "distributed" / "ddp_worker.py"

# free_port's ports: from here up to the kernel's ephemeral range, above the
# ports services usually listen on.
PORT_FLOOR = 20000
# Linux's default ephemeral range, where /proc does not say.
EPHEMERAL_DEFAULT = (32768, 60999)
# Fewer ports than this below (or above) the ephemeral range: use the whole
# range from PORT_FLOOR up, with the bind check and the reservations only.
MIN_POOL = 1000
# torch's default rendezvous ports (MASTER_PORT, torchrun's c10d
# rendezvous): a launch that names no port takes them.
TORCH_DEFAULT_PORTS = frozenset({29400, 29500})
# Seconds a port handed out stays reserved: longer than a test's launch
# (whose rank 0 may bind, close and bind the port again between restarts).
RESERVATION_S = 30 * 60.0
# Where the reservations are kept: one file per port, its mtime the time the
# port was handed out, plus the lock that serializes free_port across
# processes.
RESERVATIONS = Path(tempfile.gettempdir()) / f"tiacc-training-test-ports-{os.getuid()}"

_random = random.SystemRandom()  # no state shared with forked processes


def free_port() -> int:
    """A loopback TCP port for a job's rendezvous, reserved for this caller.

    Binding port 0 and closing the socket hands out an ephemeral port that
    nothing holds until rank 0's store binds it: another launch's port-0
    pick, a port-0 listener (gloo's) or an outgoing connection could take it
    first (``EADDRINUSE`` with 16 pytest-xdist workers launching at once).
    So the port is taken from below the kernel's ephemeral range, where no
    port-0 bind or connection lands; it must bind on every local address
    with ``SO_REUSEADDR`` off (stricter than the store, which sets it); and
    it is reserved across processes, under an ``flock``, for
    ``RESERVATION_S``. A random start keeps concurrent callers apart.

    Returns:
        The port number.

    Raises:
        RuntimeError: every port of the pool is reserved or in use.
    """
    pool = _port_pool()
    start = _random.randrange(len(pool))
    RESERVATIONS.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = os.open(RESERVATIONS / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        for i in range(len(pool)):
            port = pool[(start + i) % len(pool)]
            if port in TORCH_DEFAULT_PORTS:
                continue
            mark = RESERVATIONS / str(port)
            try:
                if abs(now - mark.stat().st_mtime) < RESERVATION_S:
                    continue
            except FileNotFoundError:
                pass
            if not _bindable(port):
                continue
            mark.write_text(f"{os.getpid()}\n")  # sets the mtime: reserved from now
            return port
    finally:
        os.close(lock)  # releases the flock
    raise RuntimeError(
        f"no free port in {pool.start}-{pool.stop - 1}: all reserved in the last "
        f"{RESERVATION_S:.0f} s (under {RESERVATIONS}) or in use"
    )


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range, first and last port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT
    return low, high


def _port_pool() -> range:
    """The ports ``free_port`` picks from: outside the ephemeral range where it can."""
    low, high = _ephemeral_range()
    below = range(PORT_FLOOR, low)
    above = range(max(high + 1, PORT_FLOOR), 65536)
    pool = max(below, above, key=len)
    return pool if len(pool) >= MIN_POOL else range(PORT_FLOOR, 65536)


def _bindable(port: int) -> bool:
    """Whether ``port`` binds now on every IPv4 and IPv6 address, ``SO_REUSEADDR`` off."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host
            continue
        with sock:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                if family == socket.AF_INET6 and e.errno == errno.EADDRNOTAVAIL:
                    continue  # IPv6 off: nothing can listen there either
                return False
    return True


# TIACC_TEST_BACKEND_FORM=process-group runs every job with the "tiacc"
# backend in its older form, even on a torch that takes the newer one.
FORCED_FORM = os.environ.get("TIACC_TEST_BACKEND_FORM", "")


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIACC_TRAINING_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    if FORCED_FORM == "process-group":
        env["TIACC_TRAINING_COLLECTIVES"] = "tiacc-process-group"
    env.update(extra or {})
    return env


def launcher_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """``base_env`` for a launcher (torchrun, ``mp.spawn``) whose ranks share one pipe.

    No rank or rendezvous variables from the outer run, and no
    ``PYTHONUNBUFFERED``: where Python buffers, ``print(..., flush=True)``
    writes a line in one piece. torchrun starts its workers with ``python
    -u`` all the same, so parse their output through :func:`unmix`.
    """
    env = base_env()
    outer = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for var in ("PYTHONUNBUFFERED", *outer):
        env.pop(var, None)
    env.update(extra or {})
    return env


def unmix(output: str, tags: tuple[str, ...]) -> str:
    """The output of ranks sharing one pipe, each tagged line on a line of its own.

    Unbuffered (torchrun runs ``python -u``), ``print`` writes its text,
    then its newline: another rank's whole line can land between the two
    ("LOSS 1 1.32RESULT {...}", then both newlines). A line's own text stays
    in one piece, so starting a new line at every tag puts each back.
    """
    pattern = "|".join(re.escape(tag) for tag in tags)
    return re.sub(rf"(?<=[^\n])(?={pattern})", "\n", output)


def tiacc_class() -> str:
    """The class that serves the "tiacc" backend's CPU collectives in the jobs.

    ``TiaccBackend`` where this torch constructs c10d ``Backend`` subclasses
    and the older form is not forced, ``TiaccProcessGroup`` otherwise.
    """
    from tiacc_training.torch.distributed import _backend

    newer = _backend.forms()[_backend.BACKEND] is None
    return "TiaccBackend" if newer and FORCED_FORM != "process-group" else "TiaccProcessGroup"


@dataclass
class Rank:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


def run_ranks(
    world: int,
    args: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 240.0,
    local_size: int | None = None,
    worker: Path = WORKER,
    prefix: tuple[str, ...] = (),
) -> list[Rank]:
    """Starts `world` `worker` processes with torchrun-style variables and
    waits for all of them (killing any still running at `timeout`).

    ``prefix`` goes before each rank's command (``unshare --mount``, say).
    """
    port = free_port()
    procs = []
    start = time.monotonic()
    for rank in range(world):
        rank_env = base_env(env)
        rank_env.update(torchrun_variables(rank, world, port, local_size))
        procs.append(
            subprocess.Popen(
                [*prefix, sys.executable, str(worker), *args],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return wait_ranks(procs, timeout, start)


def torchrun_variables(
    rank: int,
    world: int,
    port: int,
    local_size: int | None = None,
    master_addr: str = "127.0.0.1",
) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of ``world``: its rank and
    local rank (``local_size`` ranks a node, all of them where ``None``) and
    the rendezvous at ``master_addr:port``."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank % (local_size or world)),
        "LOCAL_WORLD_SIZE": str(local_size or world),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
    }


def wait_ranks(
    procs: list[subprocess.Popen[str]], timeout: float, start: float | None = None
) -> list[Rank]:
    """Waits for every rank's process (started with piped output) and collects it.

    ``timeout`` seconds from ``start`` (a ``time.monotonic()`` reading; now
    where ``None``) are all the ranks get together: one still running then
    is killed, its native stacks (:func:`native_stacks`) appended to its
    output. Each :class:`Rank` says when, from ``start``, it was collected.
    """
    start = time.monotonic() if start is None else start
    results = []
    for rank, proc in enumerate(procs):
        left = max(1.0, timeout - (time.monotonic() - start))
        try:
            out, err = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            stacks = native_stacks(proc.pid)
            proc.kill()
            out, err = proc.communicate()
            out += stacks
        results.append(Rank(rank, proc.returncode, out, err, time.monotonic() - start))
    return results


def py_spy() -> str | None:
    """The py-spy command on ``PATH`` or next to this Python, if any."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


def native_stacks(pid: int) -> str:
    """Every thread's native and Python stack of a running process, as
    ``py-spy| `` lines, or ``""`` where py-spy is not installed.

    A rank that outlives its launch's time is stuck somewhere: in NCCL, a
    CUDA wait or a lock, where Python's own stack dump shows no frame. The
    GPU check brings py-spy with its kit.
    """
    tool = py_spy()
    if tool is None:
        return ""
    try:
        dump = subprocess.run(
            [tool, "dump", "--native", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        text = dump.stdout + dump.stderr
    except (OSError, subprocess.SubprocessError) as exc:
        text = f"py-spy could not dump pid {pid}: {exc}"
    return "".join(f"py-spy| {line}\n" for line in [f"stacks of pid {pid}:", *text.splitlines()])


def json_lines(stdout: str, prefix: str = "RESULT ") -> list:
    """Every line of ``stdout`` that starts with ``prefix``, parsed as JSON."""
    return [json.loads(x.removeprefix(prefix)) for x in stdout.splitlines() if x.startswith(prefix)]


def results_of(ranks: list[Rank]) -> list[dict]:
    """Each rank's last ``RESULT`` line; fails, showing every rank's output,
    when a rank failed or printed none."""
    assert all(r.returncode == 0 for r in ranks), describe(ranks)
    results = [json_lines(r.stdout) for r in ranks]
    assert all(results), describe(ranks)
    return [lines[-1] for lines in results]


def describe(ranks: list[Rank]) -> str:
    return "\n".join(
        f"--- rank {r.rank} rc={r.returncode} after {r.seconds:.1f}s\n"
        f"{r.stdout}\n{r.stderr[-3000:]}"
        for r in ranks
    )


def assert_every_rank_failed(ranks: list[Rank], *needles: str) -> None:
    """Every rank exited with a worker's error code (3, :func:`exit_failed`)
    and printed each of ``needles`` on its standard output; fails showing
    every rank's output."""
    for r in ranks:
        assert r.returncode == 3, describe(ranks)
        for needle in needles:
            assert needle in r.stdout, describe(ranks)


def case_lines(stdout: str, case: str) -> list[str]:
    """The lines a ``--cases`` run printed for ``case``, without their ``CASE <id> `` prefix."""
    prefix = f"CASE {case} "
    return [x.removeprefix(prefix) for x in stdout.splitlines() if x.startswith(prefix)]


def case_report(ranks: list[Rank], case: str) -> str:
    """Why ``case`` of a ``--cases`` launch failed, for an assertion's message.

    Its first line names the case and its first ``FAILED`` line (the line a
    cut-off run's outcome file keeps), or the ranks that printed no
    ``DONE`` for it; then every rank's output, and last the case's own
    ``FAILED`` lines again (the outcome file's error lines are the last
    ones, and every rank's output holds the other cases' too).
    """
    failed = [
        f"rank {r.rank}: {line}"
        for r in ranks
        for line in case_lines(r.stdout, case)
        if line.startswith("FAILED ")
    ]
    if failed:
        head = f"case {case}: {failed[0]}" + (f" (+{len(failed) - 1} more)" if failed[1:] else "")
    else:
        silent = [
            r.rank
            for r in ranks
            if not any(line.startswith("DONE") for line in case_lines(r.stdout, case))
        ]
        head = f"case {case}: no DONE line from ranks {silent}"
    return "\n".join([head, describe(ranks), *failed])


def exit_failed(exc: BaseException, linger: float = 0.0) -> None:
    """A worker's way out after an error: the traceback, one ``WORKER_ERROR``
    line the tests read, then exit code 3.

    ``linger`` keeps the process (and, on rank 0, the store that holds the
    job's failure board) up a moment, so ranks failing later can still read
    the first failure.
    """
    import time
    import traceback

    traceback.print_exc()
    # When it failed (wall clock, comparable across the job's processes).
    print(f"ERROR_AT {time.time():.3f}", flush=True)
    print(f"WORKER_ERROR {type(exc).__name__}: {exc}", flush=True)
    sys.stdout.flush()
    time.sleep(linger)
    os._exit(3)


def line_matching(
    lines: list[str], pattern: str, after: int, limit: float, running: Callable[[], bool]
) -> int | None:
    """The index of the first of ``lines`` from ``after`` on that matches ``pattern``.

    ``lines`` grows while a job runs (a reader thread appends to it); waits
    up to ``limit`` seconds, and gives ``None`` once the job stopped
    (``running()`` false) or the time is up without such a line.
    """
    deadline = time.monotonic() + limit
    seen = after
    while time.monotonic() < deadline:
        while seen < len(lines):
            if re.search(pattern, lines[seen]):
                return seen
            seen += 1
        if not running():
            return None
        time.sleep(0.05)
    return None
