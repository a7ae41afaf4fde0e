"""tiaccrun, the horovodrun-style launcher: parsing, environment, ranks, ssh.

The remote path runs with a fake ``ssh`` first on ``PATH``: it records its
arguments and runs the remote command with ``sh`` on this machine, so the
launcher's ssh code (the connection check, the remote command, its
environment and working directory, termination through the connection) is
exercised without a second host. ``127.0.0.2`` is not an address of any
interface here, so the launcher treats it as another host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from _launch import base_env, free_port

from tiacc_training.tools import tiaccrun

LAUNCH = [sys.executable, "-m", "tiacc_training.tools.tiaccrun"]

FAKE_SSH = f"""\
#!{sys.executable}
# Records its arguments (a JSON line) and runs the last one, the remote
# command, with sh on this machine.
import json, os, sys
with open(os.environ["FAKE_SSH_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
os.execvp("sh", ["sh", "-c", sys.argv[-1]])
"""

ENV_SCRIPT = """\
import json, os, sys
names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
         "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
         "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "JOB_NOTE",
         "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HOROVOD_FUSION_THRESHOLD",
         "TORCHELASTIC_USE_AGENT_STORE"]
seen = {n: os.environ.get(n) for n in names}
seen["cwd"] = os.getcwd()
print("ENV " + json.dumps(seen), flush=True)
"""


def _run(args, env=None, timeout=120, cwd=None):
    return subprocess.run(
        [*LAUNCH, *args],
        env=env or base_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def _tagged(stdout: str, tag: str) -> dict[int, dict]:
    """Each rank's JSON from its ``[rank]<stdout>:<tag>...`` lines (the last
    one a rank printed), by rank."""
    out = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("<stdout>:")
        if rest.startswith(tag):
            out[int(prefix.strip("[]"))] = json.loads(rest[len(tag) :])
    return out


@pytest.fixture
def fake_ssh(tmp_path):
    folder = tmp_path / "fakebin"
    folder.mkdir()
    ssh = folder / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    log = tmp_path / "ssh.log"
    env = base_env({"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}", "FAKE_SSH_LOG": str(log)})
    return env, log


def _ssh_calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


# -- parsing (no process started) -------------------------------------------


def test_host_list():
    assert tiaccrun.parse_hosts("a:2,b:1,c") == [
        tiaccrun.Host("a", 2),
        tiaccrun.Host("b", 1),
        tiaccrun.Host("c", 1),
    ]
    assert tiaccrun.parse_hosts("[fe80::1]:4") == [tiaccrun.Host("fe80::1", 4)]
    for bad, words in [
        ("a:0", "positive"),
        ("a:x", "'x'"),
        ("a:2,,b:1", "empty"),
        ("a:1,a:2", "listed twice"),
        (":3", "no host name"),
    ]:
        with pytest.raises(tiaccrun.UsageError, match=words):
            tiaccrun.parse_hosts(bad)


def test_hostfile(tmp_path):
    good = tmp_path / "hosts"
    good.write_text(
        "# the cluster\nnode1 slots=4\n\nnode2 slots=2  # spare\nnode3\nfd00::7 slots=2\n"
    )
    assert tiaccrun.parse_hostfile(str(good)) == [
        tiaccrun.Host("node1", 4),
        tiaccrun.Host("node2", 2),
        tiaccrun.Host("node3", 1),
        tiaccrun.Host("fd00::7", 2),
    ]
    cases = {
        "node1 slots=4\nnode2 slots=zero\n": f"{tmp_path / 'bad'}:2",
        "node1 slots=4\n\nnode2 cpus=2\n": f"{tmp_path / 'bad'}:3.*cpus=2",
        "node1:4\n": f"{tmp_path / 'bad'}:1.*host slots=N",
        "# nothing\n": "no hosts",
        "n slots=1\nn slots=2\n": "listed twice",
    }
    for text, words in cases.items():
        (tmp_path / "bad").write_text(text)
        with pytest.raises(tiaccrun.UsageError, match=words):
            tiaccrun.parse_hostfile(str(tmp_path / "bad"))
    with pytest.raises(tiaccrun.UsageError, match="missing"):
        tiaccrun.parse_hostfile(str(tmp_path / "missing"))


def test_placement_and_environment():
    hosts = [tiaccrun.Host("a", 2), tiaccrun.Host("b", 2), tiaccrun.Host("c", 4)]
    placement = tiaccrun.assign_ranks(hosts, 5)
    assert placement == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    with pytest.raises(tiaccrun.UsageError, match="-np 9 is more than the 8 slots"):
        tiaccrun.assign_ranks(hosts, 9)
    envs = tiaccrun.rank_environments(hosts, placement, "10.0.0.1", 1234, {"X": "1"})
    # Reference: Horovod's definitions, written out for this placement.
    local_size = {"a": 2, "b": 2, "c": 1}
    for rank, env in enumerate(envs):
        host_index, local_rank = placement[rank]
        host = hosts[host_index].name
        having = [h for h in ("a", "b", "c") if local_size[h] > local_rank]
        assert env["RANK"] == env["HOROVOD_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["HOROVOD_SIZE"] == "5"
        assert env["LOCAL_RANK"] == env["HOROVOD_LOCAL_RANK"] == str(local_rank)
        assert env["LOCAL_WORLD_SIZE"] == env["HOROVOD_LOCAL_SIZE"] == str(local_size[host])
        assert env["GROUP_RANK"] == str(host_index)
        assert env["GROUP_WORLD_SIZE"] == "3"
        assert env["HOROVOD_CROSS_RANK"] == str(having.index(host))
        assert env["HOROVOD_CROSS_SIZE"] == str(len(having))
        assert env["HOROVOD_HOSTNAME"] == host
        assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["X"]) == ("10.0.0.1", "1234", "1")


def test_flags_and_their_variables(monkeypatch):
    monkeypatch.delenv("HOROVOD_START_TIMEOUT", raising=False)
    args = tiaccrun.parse_args(
        [
            "-np", "2", "--network-interface", "eth1,eth0", "--network-interface", "ib0",
            "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
            "--timeline-filename", "tl.json", "--timeline-mark-cycles",
            "--hierarchical-allreduce", "--start-timeout", "45", "python", "train.py", "--lr", "1",
        ]
    )  # fmt: skip
    assert args.command == ["python", "train.py", "--lr", "1"]
    env = tiaccrun.settings_environment(args)
    assert env == {
        "GLOO_SOCKET_IFNAME": "eth1",
        "NCCL_SOCKET_IFNAME": "eth1,eth0,ib0",
        "HOROVOD_START_TIMEOUT": "45.0",
        "HOROVOD_TIMELINE": os.path.abspath("tl.json"),
        "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024),
        "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
    }
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "12")
    assert tiaccrun.parse_args(["-np", "1", "true"]).start_timeout == 12.0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["python", "x.py"], "-np"),
        (["-np", "2"], "no command"),
        (["-np", "0", "true"], "at least 1"),
        (["-np", "2", "-H", "a:1", "--hostfile", "h", "true"], "not allowed with"),
        (["-np", "2", "--bogus", "true"], "--bogus"),
        (["-np", "2", "-p", "70000", "true"], "70000"),
    ],
)
def test_bad_command_lines(argv, words):
    result = _run(argv, timeout=60)
    assert result.returncode == 2
    assert words in result.stderr


def test_bad_hosts_and_interface_name_the_problem(tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=1\nlocalhost slots=two\n")
    result = _run(["-np", "2", "--hostfile", str(tmp_path / "hosts"), "true"], timeout=60)
    assert result.returncode == 2 and f"{tmp_path / 'hosts'}:2" in result.stderr
    result = _run(["-np", "3", "-H", "localhost:2", "true"], timeout=60)
    assert result.returncode == 2 and "-np 3 is more than the 2 slots" in result.stderr
    result = _run(
        ["-np", "2", "-H", "localhost:1,127.0.0.2:1", "--network-interface", "nosuch0", "true"],
        timeout=60,
    )
    assert result.returncode == 2 and "nosuch0" in result.stderr


def _run_remote(text: str, env: dict[str, str]) -> tuple[int, str, str]:
    """Runs a remote command's text as sshd would, ``env`` on its stdin, held open."""
    proc = subprocess.Popen(
        ["sh", "-c", text],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdin.write(tiaccrun.environment_block(env).decode())
    proc.stdin.flush()
    try:
        out = proc.stdout.read()
        err = proc.stderr.read()
        return proc.wait(timeout=60), out, err
    finally:
        proc.stdin.close()
        if proc.poll() is None:
            proc.kill()


def test_remote_command_runs_in_cwd_with_env(tmp_path):
    env = {"A": 'it\'s "quoted" $HOME', "B": "line1\nline2"}
    code = "import os; print(repr((os.getcwd(), os.environ['A'], os.environ['B'])))"
    text = tiaccrun.remote_command([sys.executable, "-c", code], str(tmp_path))
    # The variables travel on stdin, never in the command's text.
    assert "quoted" not in text and "line1" not in text
    rc, out, err = _run_remote(text, env)
    assert rc == 0, err
    assert out.strip() == repr((str(tmp_path), env["A"], env["B"]))
    failing = tiaccrun.remote_command([sys.executable, "-c", "raise SystemExit(9)"], "/")
    assert _run_remote(failing, {})[0] == 9


def test_a_rank_killed_remotely_leaves_no_shell_noise():
    # The remote shell reports the signal only as its exit status (128 + N).
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    rc, out, err = _run_remote(tiaccrun.remote_command([sys.executable, "-c", code], "/"), {})
    assert rc == 128 + signal.SIGKILL and err == "" and out == ""
    assert tiaccrun.describe_exit(rc, over_ssh=True) == "was killed by SIGKILL (exit code 137)"
    assert tiaccrun.describe_exit(-signal.SIGTERM) == "was killed by SIGTERM"
    assert tiaccrun.describe_exit(3) == "exited with code 3"


def test_remote_rank_ends_when_the_connection_closes(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
    text = tiaccrun.remote_command([sys.executable, "-c", code], "/")
    proc = subprocess.Popen(["sh", "-c", text], stdin=subprocess.PIPE)
    proc.stdin.write(tiaccrun.environment_block({}))
    proc.stdin.flush()
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.stdin.close()  # what sshd does when the ssh client goes away
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not _alive(int(pid_file.read_text()))


# -- jobs --------------------------------------------------------------------

TRAIN_SCRIPT = """\
import tiacc_training.torch.distributed as tdist
tdist.init_tiacc_training()

import json, os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(0)
x = torch.randn(32, 6, generator=g)
y = torch.randn(32, 2, generator=g)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(6, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
shard = slice(rank * 16, (rank + 1) * 16)
for _ in range(5):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
    opt.step()
weights = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
print("RESULT " + json.dumps({"rank": rank, "world": world, "weights": weights,
      "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
      "LOCAL_WORLD_SIZE", "HOROVOD_RANK", "HOROVOD_LOCAL_SIZE")}}), flush=True)
dist.destroy_process_group()
"""


def _reference_weights() -> list[float]:
    # Full-batch SGD on both shards: DDP with equal shards averages their
    # gradients, which is the gradient of the mean loss over the whole batch.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 6, generator=g)
    y = torch.randn(32, 2, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def test_two_ranks_train_a_torch_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    result = _run(["-np", "2", sys.executable, str(script)], timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    # The two lines found the job through torchrun's variables.
    assert (
        "[0]<stderr>:tiacc_training: DDP communication through the tiacc engine: "
        "world_size=2 launcher=torchrun" in result.stderr
    )
    results = _tagged(result.stdout, "RESULT ")
    assert sorted(results) == [0, 1]
    reference = _reference_weights()
    for rank, got in results.items():
        assert got["rank"] == rank and got["world"] == 2
        assert got["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "HOROVOD_RANK": str(rank),
            "HOROVOD_LOCAL_SIZE": "2",
        }
        assert got["weights"] == pytest.approx(reference, rel=1e-5, abs=1e-6)


def test_a_failing_rank_ends_the_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        textwrap.dedent(
            """\
            import os, sys, time
            if os.environ["RANK"] == "1":
                print("rank 1 gives up", flush=True)
                sys.exit(7)
            time.sleep(300)
            """
        )
    )
    start = time.monotonic()
    result = _run(["-np", "2", sys.executable, str(script)], timeout=120)
    assert result.returncode == 7
    assert "[1]<stdout>:rank 1 gives up" in result.stdout
    assert "rank 1 on localhost" in result.stderr and "exited with code 7" in result.stderr
    assert time.monotonic() - start < 100  # rank 0's 300 s sleep was cut short


def test_a_killed_rank_is_named_with_its_signal(tmp_path, fake_ssh):
    script = tmp_path / "killed.py"
    script.write_text(
        "import os, signal, time\n"
        "if os.environ['RANK'] == os.environ['VICTIM']:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(300)\n"
    )
    env = base_env({"VICTIM": "0"})
    result = _run(["-np", "2", sys.executable, str(script)], env=env, timeout=120)
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 0 on localhost (this host) was killed by SIGKILL" in result.stderr
    # Over ssh the remote shell reports the signal as 128 + its number.
    env, _ = fake_ssh
    env["VICTIM"] = "1"
    hosts = ["-H", "localhost:1,127.0.0.2:1"]
    result = _run(["-np", "2", *hosts, sys.executable, str(script)], env=env, timeout=120)
    assert result.returncode == 128 + signal.SIGKILL
    lines = [line for line in result.stderr.splitlines() if "SIGKILL" in line]
    assert lines == [
        "tiaccrun: rank 1 on 127.0.0.2 (over ssh) was killed by SIGKILL (exit code 137); "
        "the other ranks were terminated"
    ], result.stderr
    assert "bash:" not in result.stderr and " Killed " not in result.stderr


def test_remote_ranks_over_ssh(tmp_path, fake_ssh):
    env, log = fake_ssh
    env["JOB_NOTE"] = "spaces and 'quotes' $NOT_EXPANDED"
    (tmp_path / "env.py").write_text(ENV_SCRIPT)
    workdir = tmp_path / "work"
    workdir.mkdir()
    key = tmp_path / "id_test"
    result = _run(
        [
            "-np", "3", "-H", "localhost:2,127.0.0.2:1", "-p", "2222", "-i", str(key),
            "--fusion-threshold-mb", "1", "--output-filename", str(tmp_path / "out"),
            sys.executable, str(tmp_path / "env.py"),
        ],
        env=env,
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    envs = _tagged(result.stdout, "ENV ")
    assert sorted(envs) == [0, 1, 2]
    port = envs[0]["MASTER_PORT"]
    for rank, seen in envs.items():
        remote = rank == 2
        assert seen["RANK"] == seen["HOROVOD_RANK"] == str(rank)
        assert seen["WORLD_SIZE"] == "3"
        assert seen["LOCAL_RANK"] == ("0" if remote else str(rank))
        assert seen["LOCAL_WORLD_SIZE"] == ("1" if remote else "2")
        assert seen["GROUP_RANK"] == ("1" if remote else "0")
        assert seen["HOROVOD_CROSS_SIZE"] == ("2" if rank != 1 else "1")
        assert seen["HOROVOD_CROSS_RANK"] == ("1" if remote else "0")
        assert seen["HOROVOD_HOSTNAME"] == ("127.0.0.2" if remote else "localhost")
        assert seen["JOB_NOTE"] == env["JOB_NOTE"]
        assert seen["HOROVOD_FUSION_THRESHOLD"] == str(1024 * 1024)
        assert seen["cwd"] == str(workdir)
        # The first host is this one: MASTER_ADDR is the address routing to the other.
        assert seen["MASTER_ADDR"] == tiaccrun.route_address("127.0.0.2")
        assert seen["MASTER_PORT"] == port
        # Rank 0 is on this machine: tiaccrun hosts the store, every rank joins it.
        assert seen["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    calls = _ssh_calls(log)
    # The connection check (which lists the host's interfaces), then rank
    # 2's command; nothing else went over ssh, and no variable of the job
    # is on a command line.
    assert tiaccrun.PROBE_MODULE in calls[0][-1] and len(calls) == 2
    for call in calls:
        assert env["JOB_NOTE"] not in " ".join(call)
        assert call[call.index("-p") + 1] == "2222"
        assert call[call.index("-i") + 1] == str(key)
        assert "BatchMode=yes" in call
        assert call[-2] == "127.0.0.2"
    # --output-filename: each rank's stdout in its own folder as well.
    for rank in range(3):
        text = (tmp_path / "out" / f"rank.{rank}" / "stdout").read_text()
        assert json.loads(text.split("ENV ", 1)[1])["RANK"] == str(rank)


def test_rank_0_on_another_host_hosts_the_store_there(tmp_path, fake_ssh):
    # tiaccrun cannot host the store on rank 0's host: MASTER_ADDR is that
    # host and rank 0 hosts the store on MASTER_PORT (the given one here).
    env, _ = fake_ssh
    env["MASTER_PORT"] = str(free_port())
    (tmp_path / "env.py").write_text(ENV_SCRIPT)
    result = _run(
        ["-np", "2", "-H", "127.0.0.2:1,localhost:1", sys.executable, str(tmp_path / "env.py")],
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    envs = _tagged(result.stdout, "ENV ")
    assert sorted(envs) == [0, 1]
    for seen in envs.values():
        assert seen["MASTER_ADDR"] == "127.0.0.2"
        assert seen["MASTER_PORT"] == env["MASTER_PORT"]
        assert seen["TORCHELASTIC_USE_AGENT_STORE"] == "False"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signals_reach_local_and_remote_ranks(tmp_path, fake_ssh, sig):
    env, _ = fake_ssh
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, time\n"
        f"open(os.path.join({str(pids)!r}, os.environ['RANK']), 'w').write(str(os.getpid()))\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen(
        [*LAUNCH, "-np", "2", "-H", "localhost:1,127.0.0.2:1", sys.executable, str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        rank_pids = [int(p.read_text()) for p in pids.iterdir()]
        assert len(rank_pids) == 2
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig
    assert f"{sig.name}: terminating every rank" in err
    deadline = time.monotonic() + 30
    alive = rank_pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    assert alive == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_start_timeout_bounds_the_rendezvous(tmp_path):
    # Without MASTER_PORT tiaccrun hosts the store: a rank must join it.
    script = tmp_path / "late.py"
    script.write_text("import time\ntime.sleep(300)\n")
    start = time.monotonic()
    result = _run(["-np", "2", "--start-timeout", "2", sys.executable, str(script)], timeout=120)
    assert result.returncode == 1
    assert "no rank joined the rendezvous (the store tiaccrun hosts on port" in result.stderr
    assert "start timeout of 2 s" in result.stderr
    assert time.monotonic() - start < 100
    # A rank that joins the store in time may run past the timeout: it
    # sleeps the whole timeout after joining, so the job ends after the
    # deadline whatever the machine's load. The timeout leaves room for
    # importing torch.distributed first (7.7 s measured at load 10 on 2
    # cores).
    script = tmp_path / "joins.py"
    script.write_text(
        "import datetime, os, time\n"
        "import torch.distributed as dist\n"
        "assert os.environ['TORCHELASTIC_USE_AGENT_STORE'] == 'True'\n"
        "if os.environ['RANK'] == '0':\n"
        "    store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']),\n"
        "                          is_master=False, timeout=datetime.timedelta(seconds=30))\n"
        "    store.set('here', '1')\n"
        "time.sleep(float(os.environ['HOROVOD_START_TIMEOUT']) + 0.5)\n"
    )
    result = _run(["-np", "2", "--start-timeout", "15", sys.executable, str(script)], timeout=120)
    assert result.returncode == 0, result.stderr
    # With MASTER_PORT rank 0 hosts the store: it must listen on the port.
    port = str(free_port())
    env = base_env({"MASTER_PORT": port})
    script = tmp_path / "late.py"
    result = _run(
        ["-np", "2", "--start-timeout", "2", sys.executable, str(script)], env=env, timeout=120
    )
    assert result.returncode == 1
    assert f"rank 0 did not open the rendezvous (port {port})" in result.stderr
    script = tmp_path / "listens.py"
    script.write_text(
        "import os, socket, time\n"
        "assert os.environ['TORCHELASTIC_USE_AGENT_STORE'] == 'False'\n"
        "if os.environ['RANK'] == '0':\n"
        "    s = socket.socket()\n"
        "    s.bind(('127.0.0.1', int(os.environ['MASTER_PORT'])))\n"
        "    s.listen()\n"
        "time.sleep(float(os.environ['HOROVOD_START_TIMEOUT']) + 0.5)\n"
    )
    result = _run(
        ["-np", "2", "--start-timeout", "4", sys.executable, str(script)], env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_unreachable_host_fails_before_any_rank_starts(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "ssh").write_text("#!/bin/sh\necho 'Permission denied (publickey).' >&2\nexit 255\n")
    (folder / "ssh").chmod(0o755)
    marker = tmp_path / "started"
    env = base_env({"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"})
    result = _run(
        ["-np", "2", "-H", "localhost:1,127.0.0.2:1", "touch", str(marker)], env=env, timeout=60
    )
    assert result.returncode == 1
    assert "127.0.0.2: ssh exited with 255: Permission denied (publickey)." in result.stderr
    assert not marker.exists()


HVD_SCRIPT = """\
import json
import torch
import tiacc_training.torch.horovod as hvd

hvd.init()
r = hvd.rank()
x = torch.arange(6, dtype=torch.float32) * (r + 1)
total = hvd.allreduce(x, op=hvd.Sum, name="grad.sum")
mean = hvd.allreduce(x, name="grad.mean")
gathered = hvd.allgather(torch.full((r + 1, 2), r, dtype=torch.int64), name="rows")
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
model(torch.ones(3, 4)).sum().backward()
opt.step()  # its bucket goes straight to the engine
print("RESULT " + json.dumps({
    "rank": r, "size": hvd.size(), "local_rank": hvd.local_rank(),
    "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
    "cross_size": hvd.cross_size(), "sum": total.tolist(), "mean": mean.tolist(),
    "gathered": gathered.tolist()}), flush=True)
hvd.shutdown()
"""


def test_horovod_script_and_its_timeline(tmp_path, fake_ssh):
    # Rank 0 here, rank 1 over (fake) ssh: both launch paths in one job (a
    # local-only job runs the same code path as the torch script's test).
    env, log = fake_ssh
    script = tmp_path / "hvd_job.py"
    script.write_text(HVD_SCRIPT)
    timeline = tmp_path / "timeline.json"
    hosts = ["-H", "localhost:1,127.0.0.2:1"]
    result = _run(
        ["-np", "2", *hosts, "--timeline-filename", str(timeline), sys.executable, str(script)],
        env=env,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    results = _tagged(result.stdout, "RESULT ")
    assert sorted(results) == [0, 1]
    inputs = [torch.arange(6, dtype=torch.float32) * (r + 1) for r in range(2)]
    expected_sum = torch.stack(inputs).sum(0)
    expected_rows = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int64) for r in range(2)])
    for rank, got in results.items():
        assert (got["rank"], got["size"]) == (rank, 2)
        # One rank per host: local rank 0 of 1, cross rank = rank of 2.
        layout = (got["local_rank"], got["local_size"], got["cross_rank"], got["cross_size"])
        assert layout == (0, 1, rank, 2)
        assert got["sum"] == expected_sum.tolist()
        assert got["mean"] == pytest.approx((expected_sum / 2).tolist())
        assert got["gathered"] == expected_rows.tolist()
    assert [call[-2] for call in _ssh_calls(log)] == ["127.0.0.2", "127.0.0.2"]
    # Rank 0 wrote the timeline: a row per tensor name, its phases in order.
    with open(timeline) as f:
        events = json.load(f)
    rows = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert {"grad.sum", "grad.mean", "rows"} <= set(rows.values())
    named = [("grad.sum", "ALLREDUCE"), ("grad.mean", "ALLREDUCE"), ("rows", "ALLGATHER")]
    # DistributedOptimizer's bucket, handed straight to the engine, is on it too.
    named.append(("DistributedOptimizer.bucket.0", "ALLREDUCE"))
    for name, op in named:
        pid = next(p for p, n in rows.items() if n == name)
        spans = sorted((e for e in events if e["pid"] == pid and e["ph"] == "X"),
                       key=lambda e: e["ts"])  # fmt: skip
        assert [e["name"] for e in spans] == [f"NEGOTIATE_{op}", "QUEUE", op]
        assert all(e["dur"] >= 0 for e in spans)
