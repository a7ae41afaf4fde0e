"""Jobs across two hosts: tiaccrun over real ssh, and torchrun with ``--nnodes 2``.

The two hosts are network namespaces of this machine with their own sshd
(``_two_hosts``): ``hosta`` (NIC ``etha0``) and ``hostb`` (NIC ``ensb1``),
whose ``/etc/hosts`` map the machine's host name to ``127.0.1.1`` as stock
Debian does. So a rank that advertises the address its host name resolves
to is unreachable from the other host, and no flag names an interface: the
jobs must find the link themselves. tiaccrun runs on host A and reaches
host B with plain ``ssh -i KEY -p PORT hostb``; both hosts share the file
system, so the remote ranks run the same Python on the same files, in the
working directory and with the environment tiaccrun forwards.

- A Horovod script across the hosts: its results, and the job's
  environment on no process's command line.
- torchrun on each host (static rendezvous) with a DDP script: the two
  lines' run without an interface variable has the losses of the native
  run that names each host's interface in ``GLOO_SOCKET_IFNAME``.
- A remote rank killed by SIGKILL: tiaccrun names it once, exits 137 at
  once, and no process of the job is left on either host.
- An elastic job that loses a host and gets it back.
- An elastic job whose workers call ``init_process_group`` themselves.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _launch import base_env, launcher_env, line_matching, unmix
from _two_hosts import Host, TwoHosts, Unavailable, processes_with, two_hosts

LAUNCH = [sys.executable, "-m", "tiacc_training.tools.tiaccrun"]
ELASTIC_SCRIPT = Path(__file__).resolve().parent / "user_scripts" / "horovod_elastic.py"
STARTUP = "tiacc_training: DDP communication through the tiacc engine"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[TwoHosts]:
    """Two hosts with their sshds, for one test."""
    with contextlib.ExitStack() as stack:
        try:
            hosts = stack.enter_context(two_hosts(tmp_path / "cluster"))
        except Unavailable as e:
            pytest.skip(f"two hosts cannot be emulated here: {e}")
        yield hosts


class _Job:
    """A command on one host whose output lines are collected as they come."""

    def __init__(
        self,
        cluster: TwoHosts,
        host: Host,
        argv: list[str],
        env: dict[str, str],
        cwd: Path,
        quiet: str = "",
    ) -> None:
        self.argv = argv
        self.quiet = quiet  # a pattern of lines failure messages leave out
        self.proc = cluster.popen(
            host,
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.lines: list[str] = []  # both streams, in the order read
        self.readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line.rstrip("\n"))
            self.lines.append(line.rstrip("\n"))

    def running(self) -> bool:
        return self.proc.poll() is None or any(r.is_alive() for r in self.readers)

    def text(self, last: int = 8000) -> str:
        """The end of what it printed (but its ``quiet`` lines), for a failure's message."""
        lines = [x if len(x) <= 300 else x[:300] + " ..." for x in self.lines]
        if self.quiet:
            lines = [x for x in lines if not re.search(self.quiet, x)]
        return "\n".join(lines)[-last:]

    def wait_for(self, pattern: str, after: int = 0, limit: float = 120) -> int:
        """The index in ``lines`` of the first line from ``after`` on matching ``pattern``."""
        found = line_matching(self.lines, pattern, after, limit, self.running)
        if found is None:
            self.kill()
            raise AssertionError(f"no line matching {pattern!r}:\n{self.text()}")
        return found

    def finish(self, limit: float) -> int:
        """Its exit status; killed (and failing the test) after ``limit`` s."""
        try:
            self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{' '.join(self.argv[:4])} ... still ran after {limit:g} s:\n{self.text()}"
            ) from None
        for reader in self.readers:
            reader.join(10)
        return self.proc.returncode

    def kill(self) -> None:
        # Its session; what it started elsewhere goes with the hosts.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


# Variables that would name an interface or the rendezvous for the jobs:
# the jobs here must find both themselves.
UNSET = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "MASTER_ADDR",
         "MASTER_PORT")  # fmt: skip


def _job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """``base_env`` for tiaccrun, without any of ``UNSET``."""
    env = {k: v for k, v in base_env().items() if k not in UNSET}
    env.update(extra or {})
    return env


def _tiaccrun(cluster: TwoHosts, *args: str) -> list[str]:
    """tiaccrun's command line with the cluster's ssh key and port."""
    return [*LAUNCH, "-i", str(cluster.key), "-p", str(cluster.port), *args]


def _results(lines: list[str]) -> dict[int, dict]:
    """Each rank's ``RESULT`` line (``[rank]<stdout>:RESULT {...}``), by rank."""
    found = {}
    for line in lines:
        prefix, _, rest = line.partition("<stdout>:")
        if rest.startswith("RESULT "):
            data = json.loads(rest[len("RESULT ") :])
            found[data["rank"]] = data
    return found


def _discovery(tmp_path: Path, hosts: str) -> tuple[Path, Path]:
    """A discovery script printing a file's hosts, and the file (``_set_hosts``)."""
    listed = tmp_path / "hosts"
    _set_hosts(listed, hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    return script, listed


def _set_hosts(listed: Path, hosts: str) -> None:
    """Rewrites the discovered hosts in one step (the driver never reads half a file)."""
    partial = listed.with_suffix(".new")
    partial.write_text(hosts)
    os.replace(partial, listed)


# What a rank prints: which host's network it is on, by its only interface.
NIC_OF_RANK = """\
def nic():
    with open("/proc/net/dev") as f:
        names = [line.split(":")[0].strip() for line in f if ":" in line]
    return [n for n in names if n != "lo"]
"""


def test_the_two_hosts_reach_each_other_over_ssh(cluster: TwoHosts) -> None:
    """The harness itself: each host's sshd takes the other's login by alias
    with the cluster's key only, ssh finds both host keys already known, each
    host's name resolves to 127.0.1.1 there, and the hosts' networks are apart."""
    known = (cluster.folder / "known_hosts").read_text()
    for here, there in (cluster.hosts, cluster.hosts[::-1]):
        command = "cat /proc/net/dev; getent hosts $(hostname) hosta hostb; echo SSH_OK"
        done = cluster.run(here, cluster.ssh(there, command), timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr + cluster.sshd_logs()
        assert "SSH_OK" in done.stdout, done.stdout + done.stderr
        assert f"{there.nic}:" in done.stdout and f"{here.nic}:" not in done.stdout
        assert re.search(rf"^127\.0\.1\.1\s+{re.escape(cluster.hostname)}$", done.stdout, re.M)
        for host in cluster.hosts:
            assert re.search(rf"^{re.escape(host.address)}\s+{host.alias}$", done.stdout, re.M)
        # Without the key: refused (root's own keys, if any, are not authorized).
        argv = cluster.ssh(there, "true")
        at = argv.index("-i")
        refused = cluster.run(here, argv[:at] + argv[at + 2 :], timeout=60)
        assert refused.returncode == 255 and "Permission denied" in refused.stderr, refused
    assert (cluster.folder / "known_hosts").read_text() == known
    assert cluster.wait_idle() == []


HVD_SCRIPT = (
    """\
import json, os, sys, time
import torch
import tiacc_training.torch.horovod as hvd

"""
    + NIC_OF_RANK
    + """
hvd.init()
r = hvd.rank()
x = torch.arange(6, dtype=torch.float32) * (r + 1)
total = hvd.allreduce(x, op=hvd.Sum, name="x.sum")
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
g = torch.Generator().manual_seed(r)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
    opt.step()
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
every = hvd.allgather(weights.unsqueeze(0), name="weights")
# The test looks at every process's command line while the job waits here.
folder = sys.argv[1]
open(os.path.join(folder, f"ready.{r}"), "w").close()
deadline = time.monotonic() + 90
while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
print("RESULT " + json.dumps({
    "rank": r, "size": hvd.size(), "local_rank": hvd.local_rank(),
    "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
    "cross_size": hvd.cross_size(), "sum": total.tolist(),
    "same_weights": bool((every == every[0]).all()), "host": os.environ["HOROVOD_HOSTNAME"],
    "nic": nic(), "cwd": os.getcwd(), "secret": os.environ.get("TIACC_TEST_SECRET")}),
    flush=True)
hvd.shutdown()
"""
)


@pytest.mark.timeout(240)
def test_a_horovod_job_across_the_hosts_keeps_its_environment_off_command_lines(
    cluster: TwoHosts, tmp_path: Path
) -> None:
    """tiaccrun -np 4 -H hosta:2,hostb:2 from host A, nothing naming an interface:
    the ranks train together, and the variable only the environment holds
    reaches the remote ranks without showing on any process's command line."""
    script = tmp_path / "hvd_job.py"
    script.write_text(HVD_SCRIPT)
    sync = tmp_path / "sync"
    sync.mkdir()
    secret = f"tiacc-secret-{secrets.token_hex(8)}"
    env = _job_env({"TIACC_TEST_SECRET": secret})
    argv = _tiaccrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", sys.executable, str(script))
    job = _Job(cluster, cluster.a, [*argv, str(sync)], env, tmp_path)
    # Every process's command line, the whole time the job starts and waits.
    leaks: dict[int, str] = {}
    deadline = time.monotonic() + 120
    while job.running() and time.monotonic() < deadline:
        for proc in processes_with(secret):
            start = max(0, proc.cmdline.find(secret) - 60)
            where = f"{proc.cmdline[:40]} ... {proc.cmdline[start : start + 120]}"
            leaks.setdefault(proc.pid, where.replace("\n", "\\n"))
        if len(list(sync.glob("ready.*"))) == 4:
            break
        time.sleep(0.2)
    (sync / "go").touch()
    code = job.finish(60)
    problems = []
    if leaks:
        problems.append(
            f"the job's environment is on {len(leaks)} command line(s):\n"
            + "\n".join(f"  pid {pid}: {text}" for pid, text in leaks.items())
        )
    if code != 0:
        problems.append(f"tiaccrun exited with {code}:\n{job.text()}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)

    results = _results(job.stdout)
    assert sorted(results) == [0, 1, 2, 3], job.text()
    expected_sum = [float(v) * 10 for v in range(6)]  # ranks' factors 1 + 2 + 3 + 4
    for rank, got in results.items():
        host = cluster.hosts[rank // 2]
        assert (got["host"], got["nic"]) == (host.alias, [host.nic]), got
        layout = (got["size"], got["local_rank"], got["local_size"])
        assert layout == (4, rank % 2, 2), got
        assert (got["cross_rank"], got["cross_size"]) == (rank // 2, 2), got
        assert got["sum"] == expected_sum, got
        assert got["same_weights"], got
        assert got["cwd"] == str(tmp_path), got
        assert got["secret"] == secret, f"rank {rank} got TIACC_TEST_SECRET={got['secret']!r}"
    assert cluster.wait_idle() == []


DDP_SCRIPT = (
    """\
import tiacc_training.torch.distributed as tdist
tdist.init_tiacc_training()

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

"""
    + NIC_OF_RANK
    + """
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    y = x[:, :1] - 0.5 * x[:, 1:2]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    print(f"LOSS {rank}.{step} {loss.item()!r} {mean.item() / world!r}", flush=True)
print(f"WORLD {world} RANK {rank} NIC {','.join(nic())}", flush=True)
dist.destroy_process_group()
"""
)
TWO_LINES = "import tiacc_training.torch.distributed as tdist\ntdist.init_tiacc_training()\n"


def _torchrun_on_both(
    cluster: TwoHosts, script: Path, port: int, envs: tuple[dict[str, str], dict[str, str]], cwd
) -> list[str]:
    """``torchrun --nnodes 2`` on each host (static rendezvous at hosta); their outputs."""
    jobs = []
    for node, host in enumerate(cluster.hosts):
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr", "hosta",
            "--master-port", str(port), str(script),
        ]  # fmt: skip
        jobs.append(_Job(cluster, host, argv, envs[node], cwd))
    codes = []
    deadline = time.monotonic() + 150
    for job in jobs:
        try:
            codes.append(job.finish(max(1.0, deadline - time.monotonic())))
        except AssertionError:
            codes.append(None)
    outputs = [unmix("\n".join(job.lines), ("LOSS ", "WORLD ")) for job in jobs]
    report = "\n".join(
        f"--- node {n} rc={c}:\n{o[-5000:]}" for n, (c, o) in enumerate(zip(codes, outputs))
    )
    assert codes == [0, 0], f"{script}:\n{report}"
    return outputs


def _losses(outputs: list[str]) -> dict[str, tuple[float, float]]:
    found = {}
    for out in outputs:
        for m in re.finditer(r"^LOSS (\S+) (\S+) (\S+)$", out, re.M):
            found[m[1]] = (float(m[2]), float(m[3]))
    return found


@pytest.mark.timeout(400)
def test_torchrun_on_two_nodes_with_the_two_lines_needs_no_interface(
    cluster: TwoHosts, tmp_path: Path
) -> None:
    """torchrun --nnodes 2 per host with a DDP script: with the two lines and no
    interface variable, the losses of the native run that sets
    GLOO_SOCKET_IFNAME to each host's NIC (stock gloo needs it there)."""
    runs = {}
    for native, port in ((False, 29510), (True, 29530)):
        folder = tmp_path / ("native" if native else "tiacc")
        folder.mkdir()
        script = folder / "ddp_two_nodes.py"
        script.write_text(DDP_SCRIPT.replace(TWO_LINES, "") if native else DDP_SCRIPT)
        envs = []
        for host in cluster.hosts:
            env = {k: v for k, v in launcher_env().items() if k not in UNSET}
            if native:
                env["GLOO_SOCKET_IFNAME"] = host.nic
            envs.append(env)
        runs[native] = _torchrun_on_both(cluster, script, port, (envs[0], envs[1]), folder)
    ours, theirs = _losses(runs[False]), _losses(runs[True])
    assert len(theirs) == 4 * 8 and ours.keys() == theirs.keys(), (ours, theirs)
    for key in ours:
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=1e-5), (key, ours, theirs)
    for run in runs.values():
        for node, host in enumerate(cluster.hosts):
            for local in range(2):
                assert f"WORLD 4 RANK {2 * node + local} NIC {host.nic}" in run[node], run[node]
    assert STARTUP in runs[False][0], runs[False][0][-4000:]
    assert STARTUP not in runs[True][0] + runs[True][1]
    assert cluster.wait_idle() == []


KILLED_SCRIPT = """\
import os, signal, sys, time
import torch
import tiacc_training.torch.horovod as hvd

hvd.init()
hvd.allreduce(torch.ones(4), name="first.step")
with open(os.path.join(sys.argv[1], f"pid.{hvd.rank()}"), "w") as f:
    f.write(str(os.getpid()))
if hvd.rank() == 3:
    while len(os.listdir(sys.argv[1])) < 4:
        time.sleep(0.05)
    print("rank 3 kills itself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(300)
"""


@pytest.mark.timeout(240)
def test_a_killed_remote_rank_ends_the_job_at_once_and_leaves_nothing(
    cluster: TwoHosts, tmp_path: Path
) -> None:
    """Rank 3 (on host B) kills itself with SIGKILL after a first step: tiaccrun
    exits 137 within 30 s, names rank 3 and SIGKILL in one line of its own,
    shows no remote shell's report, and no process of the job is left."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SCRIPT)
    pids = tmp_path / "pids"
    pids.mkdir()
    argv = _tiaccrun(cluster, "-np", "4", "-H", "hosta:2,hostb:2", sys.executable, str(script))
    job = _Job(cluster, cluster.a, [*argv, str(pids)], _job_env(), tmp_path)
    job.wait_for(r"^\[3\]<stdout>:rank 3 kills itself$", limit=120)
    killed = time.monotonic()
    code = job.finish(60)
    seconds = time.monotonic() - killed
    err = "\n".join(job.stderr)
    assert code == 128 + signal.SIGKILL, job.text()
    assert seconds < 30, f"tiaccrun took {seconds:.1f} s after the kill:\n{job.text()}"
    named = [line for line in job.stderr if line.startswith("tiaccrun:") and "SIGKILL" in line]
    assert len(named) == 1 and "rank 3" in named[0], err
    noise = [line for line in job.stderr if "bash:" in line or " Killed " in line]
    assert noise == [], err
    # The ranks went with tiaccrun (the remote ones once their connection
    # closed), and so did every session of the job on either host.
    rank_pids = [int(p.read_text()) for p in sorted(pids.iterdir())]
    assert len(rank_pids) == 4, err
    left = cluster.wait_idle(limit=10)
    assert left == [], f"left running after tiaccrun exited: {left}\n{err}"


@pytest.mark.timeout(400)
def test_an_elastic_job_loses_a_host_and_gets_it_back(cluster: TwoHosts, tmp_path: Path) -> None:
    """Discovery lists both hosts, then host A alone, then both again; then a
    worker of host B is killed, which keeps B out for its cooldown only
    (--blacklist-cooldown-range 1 2): rounds of 4, 2, 4, 2 and 4 workers, and
    the job ends with 4 workers at the last step, all with the same parameters."""
    steps = 90
    discover, listed = _discovery(tmp_path, "hosta:2\nhostb:2\n")
    crash = tmp_path / "crash"
    argv = _tiaccrun(
        cluster,
        "-np", "2", "--min-np", "2", "--max-np", "4",
        "--host-discovery-script", str(discover), "--slots-per-host", "2",
        "--blacklist-cooldown-range", "1", "2", "--elastic-timeout", "30",
        sys.executable, str(ELASTIC_SCRIPT), "--steps", str(steps), "--step-seconds", "0.2",
        "--crash-file", str(crash), "--crash-host", "hostb",
    )  # fmt: skip
    job = _Job(cluster, cluster.a, argv, _job_env(), tmp_path, quiet=r"<stdout>:(STEP|RESET) ")

    def steps_of_size(size: int, count: int, after: int) -> int:
        line = after
        for _ in range(count):
            line = job.wait_for(rf"STEP \d+ SIZE {size} RANK 0$", line, limit=60) + 1
        return line

    line = steps_of_size(4, 3, 0)
    _set_hosts(listed, "hosta:2\n")  # host B lost
    line = steps_of_size(2, 3, line)
    _set_hosts(listed, "hosta:2\nhostb:2\n")  # and back
    line = steps_of_size(4, 3, line)
    crash.touch()  # a worker of host B kills itself: B is out for its cooldown
    line = job.wait_for(r"CRASH$", line, limit=60)
    line = job.wait_for(r"^tiaccrun: host hostb's cooldown ended", line, limit=60)
    steps_of_size(4, 3, line)  # (at step 27 to 36 of the 90, on 2 loaded cores)
    code = job.finish(120)
    out, tail = "\n".join(job.lines), job.text()
    assert code == 0, tail
    rounds = re.findall(r"^tiaccrun: round \d+: (\d+) worker\(s\) on (.*?) \(", out, re.M)
    sizes = [int(n) for n, _ in rounds]
    assert set(sizes) <= {2, 3, 4}, f"rounds {rounds}:\n{tail}"
    # A round may be formed again with the same members (a collective that
    # failed as host B left), or with 3 while a worker of B that left is
    # still exiting as B comes back: the sizes 2 and 4, each once in a row,
    # are the hosts' story.
    ends = [n for n in sizes if n != 3]
    story = [n for i, n in enumerate(ends) if i == 0 or ends[i - 1] != n]
    assert story == [4, 2, 4, 2, 4], f"rounds {rounds}:\n{tail}"
    assert rounds[-1][1] == "hosta, hostb", f"rounds {rounds}:\n{tail}"
    killed = re.findall(r"^tiaccrun: worker \d+ \(hostb:\d\) was killed by SIGKILL", out, re.M)
    assert len(killed) == 1, tail
    done = re.findall(r"DONE rank (\d+) size (\d+) step (\d+) PARAMS (\[.*\])", out)
    assert sorted(int(r) for r, _, _, _ in done) == [0, 1, 2, 3], tail
    assert {(int(n), int(s)) for _, n, s, _ in done} == {(4, steps)}, tail
    params = [json.loads(p) for _, _, _, p in done]
    for other in params[1:]:
        assert other == pytest.approx(params[0], rel=1e-6, abs=1e-7)
    assert cluster.wait_idle() == []


OWN_GROUP_SCRIPT = (
    """\
import json, os
import torch
import torch.distributed as dist

"""
    + NIC_OF_RANK
    + """
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print("RESULT " + json.dumps({"rank": rank, "size": world, "sum": t.item(), "nic": nic()}),
      flush=True)
dist.destroy_process_group()
"""
)


@pytest.mark.timeout(200)
def test_elastic_workers_with_their_own_init_process_group(
    cluster: TwoHosts, tmp_path: Path
) -> None:
    """An elastic job on both hosts whose plain torch workers call
    init_process_group("gloo") (env://) and all_reduce: they join the
    driver's store, as torchrun's workers join the agent's."""
    script = tmp_path / "own_group.py"
    script.write_text(OWN_GROUP_SCRIPT)
    discover, _ = _discovery(tmp_path, "hosta:2\nhostb:2\n")
    argv = _tiaccrun(
        cluster, "-np", "4", "--host-discovery-script", str(discover),
        "--elastic-timeout", "30", sys.executable, str(script),
    )  # fmt: skip
    job = _Job(cluster, cluster.a, argv, _job_env(), tmp_path)
    code = job.finish(120)
    assert code == 0, job.text()
    results = _results(job.stdout)
    assert sorted(results) == [0, 1, 2, 3], job.text()
    nics = sorted(got["nic"][0] for got in results.values())
    assert nics == sorted([cluster.a.nic] * 2 + [cluster.b.nic] * 2), results
    for got in results.values():
        assert (got["size"], got["sum"]) == (4, 10.0), got
    assert cluster.wait_idle() == []


IFACE_SCRIPT = (
    """\
import json, os
import torch
import tiacc_training.torch.horovod as hvd

"""
    + NIC_OF_RANK
    + """
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="t")
print("RESULT " + json.dumps({"rank": hvd.rank(), "sum": total.item(), "nic": nic(),
      "gloo": os.environ.get("GLOO_SOCKET_IFNAME"), "nccl": os.environ.get("NCCL_SOCKET_IFNAME")}),
      flush=True)
hvd.shutdown()
"""
)


@pytest.mark.timeout(200)
def test_network_interface_names_one_per_host(cluster: TwoHosts, tmp_path: Path) -> None:
    """--network-interface ensb1,etha0: each host's ranks get the first name that
    host has (the NIC names differ per host), and the job runs."""
    script = tmp_path / "iface.py"
    script.write_text(IFACE_SCRIPT)
    nics = f"{cluster.b.nic},{cluster.a.nic}"
    argv = _tiaccrun(
        cluster, "-np", "2", "-H", "hosta:1,hostb:1", "--network-interface", nics, "--verbose",
        sys.executable, str(script),
    )  # fmt: skip
    job = _Job(cluster, cluster.a, argv, _job_env(), tmp_path)
    code = job.finish(120)
    assert code == 0, job.text()
    results = _results(job.stdout)
    for rank, host in enumerate(cluster.hosts):
        got = results[rank]
        expected = (host.nic, f"={host.nic}", [host.nic])
        assert (got["gloo"], got["nccl"], got["nic"]) == expected, job.text()
        assert got["sum"] == 3.0, got
    for host in cluster.hosts:
        assert f"tiaccrun: {host.alias}: its ranks use {host.nic} ({host.address})" in job.stderr
    assert cluster.wait_idle() == []


OWN_GLOO_SCRIPT = """\
import datetime
import tiacc_training.torch.distributed as tdist
tdist.init_tiacc_training()
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
print("JOINED", flush=True)
"""


@pytest.mark.timeout(300)
def test_a_script_own_gloo_group_names_the_loopback_hostname(
    cluster: TwoHosts, tmp_path: Path
) -> None:
    """With TIACC_TRAINING_COLLECTIVES=gloo the script's gloo group is torch's: on
    hosts whose name maps to 127.0.1.1 it cannot connect across them, as
    natively, and the error says why and which variable fixes it."""
    script = tmp_path / "own_gloo.py"
    script.write_text(OWN_GLOO_SCRIPT)
    env = {k: v for k, v in launcher_env().items() if k not in UNSET}
    env["TIACC_TRAINING_COLLECTIVES"] = "gloo"
    outputs = []
    jobs = []
    for node, host in enumerate(cluster.hosts):
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "hosta",
            "--master-port", "29550", str(script),
        ]  # fmt: skip
        jobs.append(_Job(cluster, host, argv, env, tmp_path))
    for job in jobs:
        code = job.finish(200)
        outputs.append((code, "\n".join(job.lines)))
    for code, out in outputs:
        assert code != 0 and "JOINED" not in out, out[-4000:]
    both = "\n".join(out for _, out in outputs)
    hint = f"this host's name {cluster.hostname!r} resolves to 127.0.1.1"
    assert hint in both, both[-6000:]
    assert any(f"GLOO_SOCKET_IFNAME={host.nic}" in both for host in cluster.hosts), both[-6000:]
    assert cluster.wait_idle() == []
