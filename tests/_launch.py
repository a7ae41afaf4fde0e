"""Launch helpers for the multi-process tests: plain processes on loopback.

Shared by ``tests/distributed`` and ``tests/gpu`` (this folder is on
``sys.path`` through its conftest).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "distributed" / "ddp_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        rank_env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank % (local_size or world)),
                "LOCAL_WORLD_SIZE": str(local_size or world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
        procs.append(
            subprocess.Popen(
                [*prefix, sys.executable, str(worker), *args],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for rank, proc in enumerate(procs):
        left = max(1.0, timeout - (time.monotonic() - start))
        try:
            out, err = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results.append(Rank(rank, proc.returncode, out, err, time.monotonic() - start))
    return results


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
