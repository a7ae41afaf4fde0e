"""tiaccrun without ``MASTER_PORT``: concurrent jobs never lose their rendezvous port.

tiaccrun used to pick ``MASTER_PORT`` by binding port 0 and closing the
socket; rank 0's store bound it seconds later, after the rank's start and
torch's import, and any port-0 socket of another process in between took it
(``EADDRINUSE``). It now hosts the store itself, bound on port 0 before a
rank starts. Here 4 jobs start at once while a thread of this process keeps
a rolling set of 9000 port-0 listeners open, about two thirds of the ports
the kernel hands a port-0 bind first (the odd half of the default ephemeral
range). With the old picker put back, 8 of 8 runs failed, 1 to 4 of the 4
jobs each, every failure rank 0's ``TCPStore`` unable to bind its port
(``EADDRINUSE``); with the store in tiaccrun, 5 of 5 runs passed (2 cores,
20 to 34 s a run either way).
"""

from __future__ import annotations

import collections
import json
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from _launch import json_lines, launcher_env

LAUNCH = [sys.executable, "-m", "tiacc_training.tools.tiaccrun"]
JOBS = 4
# Port-0 listeners held at once by the churn, the oldest replaced by a new one.
CHURN_LISTENERS = 9000

JOB_SCRIPT = """\
import json, os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(3) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("RESULT " + json.dumps({"rank": dist.get_rank(), "sum": t.tolist(),
      "port": os.environ["MASTER_PORT"],
      "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}), flush=True)
dist.destroy_process_group()
"""

WORLD_OF_ONE = """\
import json, os
import torch.distributed as dist
import tiacc_training.torch.horovod as hvd
from tiacc_training.torch.distributed import _launch
hvd.init()  # the library makes the group from the (absent) launcher's variables
store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):
    store = store.underlying_store
print("RESULT " + json.dumps({"env": os.environ["MASTER_PORT"], "group": store.port,
      "held": _launch._held_store.port, "world": dist.get_world_size()}), flush=True)
hvd.shutdown()
"""


def _churn(stop: threading.Event, held: int, counter: list[int]) -> None:
    """Binds listeners on port 0 until ``stop``, ``held`` of them open at once."""
    listeners: collections.deque[socket.socket] = collections.deque()
    try:
        while not stop.is_set():
            listener = socket.socket()
            try:
                listener.bind(("0.0.0.0", 0))
                listener.listen(1)
            except OSError:  # the range is full for a moment: let some go
                listener.close()
                for _ in range(min(100, len(listeners))):
                    listeners.popleft().close()
                continue
            listeners.append(listener)
            while len(listeners) > held:
                listeners.popleft().close()
            counter[0] += 1
    finally:
        for listener in listeners:
            listener.close()


def _run_jobs(launch: list[str], script: Path, jobs: int, held: int) -> list[dict]:
    """Starts ``jobs`` two-rank jobs at once under the churn; each one's outcome."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, held + 1024)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    stop = threading.Event()
    counter = [0]
    churn = threading.Thread(target=_churn, args=(stop, held, counter), daemon=True)
    churn.start()
    try:
        while counter[0] < held and churn.is_alive():  # the churn at full strength first
            time.sleep(0.05)
        procs = [
            subprocess.Popen(
                [*launch, "-np", "2", sys.executable, str(script)],
                env=launcher_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(jobs)
        ]
        outcomes = []
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=300)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
            outcomes.append({"code": proc.returncode, "stdout": out, "stderr": err})
    finally:
        stop.set()
        churn.join()
        if soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return outcomes


def _results(stdout: str) -> list[dict]:
    lines = [line.partition("<stdout>:")[2] for line in stdout.splitlines()]
    return json_lines("\n".join(lines))


def test_concurrent_jobs_without_a_port_never_collide(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    outcomes = _run_jobs(LAUNCH, script, JOBS, CHURN_LISTENERS)
    report = "\n".join(json.dumps(o) for o in outcomes)
    for outcome in outcomes:
        text = outcome["stdout"] + outcome["stderr"]
        assert "EADDRINUSE" not in text and "address already in use" not in text.lower(), report
        assert outcome["code"] == 0, report
    results = [_results(o["stdout"]) for o in outcomes]
    ports = set()
    for job in results:
        assert sorted(r["rank"] for r in job) == [0, 1], report
        assert all(r["sum"] == [3.0, 3.0, 3.0] for r in job), report
        # The ranks joined the store tiaccrun hosts for them.
        assert {r["agent_store"] for r in job} == {"True"}, report
        assert len({r["port"] for r in job}) == 1, report
        ports.add(job[0]["port"])
    assert len(ports) == JOBS


def test_world_of_one_shares_the_store_bound_on_port_0(tmp_path: Path) -> None:
    # A plain ``python script.py`` (no launcher, no MASTER_PORT): the port
    # comes from a store bound on port 0, and the group's store shares its
    # server rather than binding the port a second time.
    script = tmp_path / "one.py"
    script.write_text(WORLD_OF_ONE)
    done = subprocess.run(
        [sys.executable, str(script)],
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    got = json_lines(done.stdout)[-1]
    assert got["world"] == 1
    assert int(got["env"]) == got["group"] == got["held"] > 0
