"""Runs one stage of the GPU check and records it in ``stages.json``.

Its commands run in sessions of their own, within the stage's time, with
the GPU sampled meanwhile. What leaves a stage's processes behind is stopped (``_process_tree.py``);
what each stage runs is ``_gpu_stages.py``'s.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from _gpu_stages import INDEPENDENT, JUNIT
from _process_tree import POLL, exited, stage_processes, stop_processes

REPO = Path(__file__).resolve().parent.parent
# How often the summary is rewritten and the GPU sampled while a stage runs (seconds).
TICK = 10.0
# Seconds the processes of a stage being stopped get between SIGTERM and SIGKILL.
GRACE = 5.0


def run_stage(
    stage: str,
    commands: list[list[str]],
    env: dict[str, str],
    out: Path,
    timeout: float,
    tick: Callable[[Path], None] | None = None,
) -> bool:
    """Runs one stage's commands into ``<stage>.log``; records it in ``stages.json``.

    ``tick(out)`` runs every ``TICK`` seconds meanwhile (the summary), after
    the GPU is sampled, and the stage is recorded as running first, so a
    run cut off mid-stage still shows it. A command that fails ends the
    stage, unless the stage's commands are ``INDEPENDENT``; the timeout
    ends it always. Each command runs in a session of its own, and when it
    ends (exit or timeout) whatever it left running is stopped (see
    ``stop_processes``), so the next command starts on an idle machine.
    """
    start = time.monotonic()
    for name in (*JUNIT.get(stage, ()), f"outcomes-{stage}.jsonl"):  # no earlier run's results
        (out / name).unlink(missing_ok=True)
    gpu = GpuUse.at_start()
    record_stage(out, stage, "running (cut off here if nothing follows)", 0.0, gpu)
    failures: list[str] = []
    timed_out = False

    def every_tick() -> None:
        gpu.sample()
        seconds = round(time.monotonic() - start, 1)
        record_stage(out, stage, "running (cut off here if nothing follows)", seconds, gpu)
        if tick is not None:
            tick(out)

    with (out / f"{stage}.log").open("w") as log:
        for number, command in enumerate(commands, 1):
            log.write(f"$ {shlex.join(command)}\n")
            log.flush()
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )
            exited, seen = _wait(proc, start + timeout, every_tick)
            stopped = stop_processes(proc, seen, GRACE)
            code = proc.wait()
            if not exited:
                log.write(f"timed out after {timeout:.0f} s: the command was stopped\n")
            if stopped:
                log.write(f"stopped {stopped} process(es) the stage left running\n")
            log.flush()
            if not exited:
                timed_out = True
                break
            if code != 0:
                failures.append(
                    f"exit code {code}"
                    if len(commands) == 1
                    else f"command {number}: exit code {code}"
                )
                if stage not in INDEPENDENT:
                    break
    gpu.sample()
    status = "passed" if not failures else "failed"
    if timed_out:
        status = f"timed out after {timeout:.0f} s"
    if failures:
        status += f" ({'; '.join(failures)})"
    seconds = round(time.monotonic() - start, 1)
    record_stage(out, stage, status, seconds, gpu)
    print(f"{stage}: {status} in {seconds} s (log: {out / f'{stage}.log'})")
    return status == "passed"


def _wait(
    proc: subprocess.Popen, deadline: float, every_tick: Callable[[], None]
) -> tuple[bool, dict[int, int]]:
    """Waits for ``proc`` to exit, leaving it unreaped (its pid stays its own).

    Returns whether it exited before ``deadline``, and the processes it
    started that were seen meanwhile (pid: start time), looked for every
    ``TICK`` seconds, when ``every_tick()`` runs too.
    """
    seen: dict[int, int] = {}
    next_tick = time.monotonic() + TICK
    while not exited(proc):
        now = time.monotonic()
        if now >= deadline:
            return False, seen
        if now >= next_tick:
            seen.update(stage_processes(proc.pid))
            every_tick()
            next_tick = time.monotonic() + TICK
        time.sleep(max(0.0, min(POLL, deadline - now, next_tick - now)))
    return True, seen


# -- the GPU's memory and processes, sampled while a stage runs -------------


@dataclass
class GpuUse:
    """A stage's GPU memory and processes, from ``nvidia-smi`` (None: not sampled)."""

    processes_at_start: int | None = None
    peak_mib: int | None = None
    total_mib: int | None = None

    @classmethod
    def at_start(cls) -> GpuUse:
        """A first sample, before the stage's commands run."""
        found = gpu_sample()
        if found is None:
            return cls()
        used, total, processes = found
        return cls(processes, used, total)

    def sample(self) -> None:
        """Takes the peak of the memory used so far and now."""
        found = gpu_sample()
        if found is not None:
            self.peak_mib = max(found[0], self.peak_mib or 0)
            self.total_mib = found[1]

    def record(self) -> dict[str, int | None]:
        """The fields of the stage's record in ``stages.json``."""
        return {
            "gpu_memory_peak_mib": self.peak_mib,
            "gpu_memory_total_mib": self.total_mib,
            "gpu_processes_at_start": self.processes_at_start,
        }


def gpu_sample() -> tuple[int, int, int] | None:
    """The GPUs' memory used and total (MiB, summed) and their compute processes.

    ``None`` where ``nvidia-smi`` is missing, fails or says something else.
    """
    try:
        memory = _nvidia_smi(
            "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"
        )
        apps = _nvidia_smi("--query-compute-apps=pid", "--format=csv,noheader")
        rows = [[int(x) for x in line.split(",")] for line in memory.splitlines() if line.strip()]
        used, total = (sum(column) for column in zip(*rows))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return used, total, sum(line.strip().isdigit() for line in apps.splitlines())


def _nvidia_smi(*args: str) -> str:
    return subprocess.run(
        ["nvidia-smi", *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout


def record_stage(
    out: Path, stage: str, status: str, seconds: float, gpu: GpuUse | None = None
) -> None:
    """Writes one stage's result into ``stages.json``."""
    stages_file = out / "stages.json"
    stages = json.loads(stages_file.read_text()) if stages_file.exists() else {}
    stages[stage] = {"status": status, "seconds": seconds, **(gpu or GpuUse()).record()}
    stages_file.write_text(json.dumps(stages, indent=2) + "\n")
