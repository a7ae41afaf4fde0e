"""Jobs that torchrun restarts, and ranks lost during start-up.

The script (``user_scripts/restart_ddp.py``) checkpoints every step and
resumes from its checkpoint, as restartable jobs do; a rank kills itself
(SIGKILL) or raises in one attempt or two, and ``torchrun --max-restarts 2``
starts the job again. Each attempt must rendezvous on keys of its own: the
agent's store outlives a dead attempt, and on some torch releases the
workers' keys carry nothing of the attempt.

The reference is the same script without the two lines, run without a
fault: a job that resumes from its checkpoint after every fault must print
the uninterrupted run's losses. (Stock torch's own run in the faulty
scenario is no reference on every release: on torch 2.15 a restarted gloo
group reads the dead attempt's peer addresses and fails or hangs; see
docs/reliability.md.)

On the emulated two-node cluster, a node is lost and started again, with a
fixed number of nodes and with ``--nnodes=1:2`` (the world shrinks to one
node and grows back); the latter's reference is the stock script through
the same membership changes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _launch import free_port, launcher_env, unmix

SCRIPT = Path(__file__).resolve().parent / "user_scripts" / "restart_ddp.py"
TAGS = ("LOSS ", "ATTEMPT ", "DONE ", "RANK_FAILED ", "STOPPING ", "tiacc_training:")
STEPS = 10


def _torchrun(*extra: str, nproc: int = 2, restarts: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--monitor-interval=0.2",
        str(SCRIPT),
        "--steps",
        str(STEPS),
        *extra,
    ]


def _run(argv: list[str], env: dict[str, str] | None = None, limit: float = 240) -> str:
    done = subprocess.run(
        argv,
        env=launcher_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=limit,
    )
    out = unmix(done.stdout, TAGS)
    return f"rc={done.returncode}\n{out}"


def _losses(out: str) -> dict[int, str]:
    """Every step's loss as rank 0 printed it (a step trained twice must agree)."""
    losses: dict[int, str] = {}
    for step, value in re.findall(r"^LOSS (\d+) (\S+)", out, re.M):
        assert losses.setdefault(int(step), value) == value, (step, out[-3000:])
    return losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The stock script's losses, trained straight through on 2 ranks."""
    ckpt = tmp_path_factory.mktemp("native") / "ckpt.pt"
    out = _run(_torchrun("--ckpt", str(ckpt), restarts=0))
    assert out.startswith("rc=0"), out[-3000:]
    losses = _losses(out)
    assert sorted(losses) == list(range(STEPS)), out[-3000:]
    return losses


@pytest.mark.parametrize("backend", ["gloo", "none"])
def test_restarts_after_sigkill_resume_as_the_uninterrupted_run(
    tmp_path: Path, backend: str, uninterrupted: dict[int, str]
) -> None:
    """Rank 1 is killed after step 3 of attempt 1 and after step 6 of attempt 2."""
    ckpt = tmp_path / "ckpt.pt"
    args = ("--tiacc", "--ckpt", str(ckpt), "--backend", backend)
    out = _run(_torchrun(*args, "--kill-rank", "1", "--faults", "0:3,1:6"))
    assert out.startswith("rc=0"), out[-4000:]
    assert "ATTEMPT 1 RESUMED 4" in out and "ATTEMPT 2 RESUMED 7" in out, out[-4000:]
    assert "DONE attempt 2" in out, out[-4000:]
    assert _losses(out) == uninterrupted, out[-4000:]
    # Each attempt agreed on a generation of keys of its own, and its
    # start-up line and exit summary name the attempt.
    named = r"torchrun attempt (\d) of at most 3 \(its keys: generation (\d+)\)"
    generations = re.findall(named, out)
    attempts = sorted({int(a) for a, _ in generations})
    assert attempts == [1, 2, 3], out[-4000:]
    by_attempt = {}
    for attempt, generation in generations:
        by_attempt.setdefault(attempt, set()).add(generation)
    assert all(len(g) == 1 for g in by_attempt.values()), by_attempt
    assert len({next(iter(g)) for g in by_attempt.values()}) == 3, by_attempt
    assert re.search(r"summary: .*; torchrun attempt 3 of at most 3 \(", out), out[-4000:]
    # The engine carried the gradients in every attempt.
    assert out.count("CPU buckets connected") == 3, out[-4000:]


def test_a_rank_that_raises_and_a_group_made_twice_in_one_process(
    tmp_path: Path, uninterrupted: dict[int, str]
) -> None:
    """Rank 0 raises after step 5; each attempt also destroys its first group
    and makes a second one in the same process, as mp.spawn-style trials do."""
    ckpt = tmp_path / "ckpt.pt"
    args = ("--tiacc", "--ckpt", str(ckpt), "--reinit", "--fault", "raise")
    out = _run(_torchrun(*args, "--kill-rank", "0", "--faults", "0:5"))
    assert out.startswith("rc=0"), out[-4000:]
    assert "planted fault on rank 0 after step 5" in out, out[-4000:]
    assert "ATTEMPT 1 RESUMED 6" in out, out[-4000:]
    assert _losses(out) == uninterrupted, out[-4000:]
    # Two groups in each attempt, each on a generation of its own.
    generations = set(re.findall(r"\(its keys: generation (\d+)\)", out))
    assert len(generations) >= 2, out[-4000:]


@pytest.mark.parametrize("where", ["before-init", "before-ddp"])
def test_a_rank_stopped_during_start_up_fails_the_others_naming_it(
    tmp_path: Path, where: str
) -> None:
    """SIGSTOP on rank 1 before its init_process_group, or before its DDP
    model: rank 0 raises within the engine's timeout (5 s here) naming rank
    1, where stock torch waits in the store for its own (30 min) timeout."""
    timeout = 5.0
    args = ("--tiacc", "--ckpt", str(tmp_path / "ckpt.pt"), "--stop-rank", "1")
    argv = _torchrun(*args, "--stop-at", where, "--stop-seconds", str(timeout + 3), restarts=0)
    out = _run(argv, {"TIACC_TRAINING_TIMEOUT": str(timeout)}, limit=120)
    assert not out.startswith("rc=0"), out[-4000:]
    stopped = re.search(r"^STOPPING rank 1 \S+ at (\S+)$", out, re.M)
    failed = re.search(r"^RANK_FAILED 0 at ([\d.]+): (.*)$", out, re.M)
    assert stopped and failed, out[-4000:]
    assert "CommTimeoutError" in failed[2] and "rank 1" in failed[2], failed[2]
    waited = float(failed[1]) - float(stopped[1])
    assert waited < timeout + 10, (waited, failed[2])


def test_a_rank_stopped_before_init_under_a_plain_env_launch(tmp_path: Path) -> None:
    """The same without torchrun: two processes given RANK, WORLD_SIZE and
    MASTER_ADDR/PORT, as mp.spawn and cluster launchers do (rank 0 hosts
    the store). Stock torch waits in the store's constructor for the group
    timeout."""
    timeout = 5.0
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = launcher_env(
            {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "TIACC_TRAINING_TIMEOUT": str(timeout),
            }
        )
        argv = [sys.executable, str(SCRIPT), "--tiacc", "--ckpt", str(tmp_path / "c.pt")]
        argv += ["--stop-rank", "1", "--stop-seconds", str(timeout + 3)]
        procs.append(
            subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    out = "\n".join(outs)
    assert procs[0].returncode != 0, out[-4000:]
    stopped = re.search(r"^STOPPING rank 1 \S+ at (\S+)$", out, re.M)
    failed = re.search(r"^RANK_FAILED 0 at ([\d.]+): (.*)$", out, re.M)
    assert stopped and failed, out[-4000:]
    assert "CommTimeoutError" in failed[2] and "rank 1" in failed[2], failed[2]
    assert float(failed[1]) - float(stopped[1]) < timeout + 10, failed[2]


def _netns_cluster():
    """``netns_cluster.cluster``, or a skip where network namespaces cannot be made."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root and iproute2 (ip, tc) for network namespaces")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from netns_cluster import cluster

    return cluster


def _four_rank_reference(tmp_path: Path) -> dict[int, str]:
    """The stock script's losses on 4 ranks of this host, without a fault."""
    reference = _run(_torchrun("--ckpt", str(tmp_path / "native.pt"), nproc=4, restarts=0))
    assert reference.startswith("rc=0"), reference[-3000:]
    return _losses(reference)


def _same_losses_within_rounding(out: str, expected: dict[int, str]) -> None:
    """Every step's loss, within float rounding of ``expected`` (2D sums in another order)."""
    losses = _losses(out)
    assert sorted(losses) == sorted(expected), out[-5000:]
    for step, value in expected.items():
        assert float(losses[step]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), step


def _two_node_agents(
    nodes: tuple,
    port: int,
    extra: tuple[str, ...],
    only: int | None = None,
    elastic: str = "",
    more_env: dict[str, str] | None = None,
    steps: int = STEPS,
) -> list[subprocess.Popen[str]]:
    """One torchrun agent per node: a static rendezvous of 2 nodes on node
    0's ``port``, or with ``elastic`` (``--rdzv-conf`` keys) a c10d
    rendezvous of 1 to 2 nodes that node 0's agent hosts there, each agent
    on its node's address."""
    procs = []
    for node_rank, node in enumerate(nodes):
        if only is not None and node_rank != only:
            continue
        if elastic:
            rdzv = [
                "--nnodes=1:2",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={nodes[0].address}:{port}",
                f"--rdzv-conf={elastic},is_host={int(node_rank == 0)}",
                f"--local-addr={node.address}",
            ]
        else:
            rdzv = ["--nnodes=2", f"--node-rank={node_rank}"]
            rdzv += [f"--master-addr={nodes[0].address}", f"--master-port={port}"]
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *rdzv,
            "--nproc-per-node=2",
            "--max-restarts=2",
            "--monitor-interval=0.2",
            str(SCRIPT),
            "--steps",
            str(steps),
            *extra,
        ]
        env = launcher_env(
            {
                "GLOO_SOCKET_IFNAME": node.veth,
                "TIACC_TRAINING_TIMEOUT": "60",
                **node.env(),
                **(more_env or {}),
            }
        )
        procs.append(
            subprocess.Popen(
                node.command(argv),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def test_restarts_of_two_nodes_over_an_emulated_link(tmp_path: Path) -> None:
    """2 nodes x 2 ranks in two network namespaces (1 Gbit/s): rank 3 on
    node 1 is killed after step 3; both agents restart their ranks and the
    job resumes from the checkpoint, with the uninterrupted run's losses
    (within float rounding: 2D sums in another order than the native ring)."""
    cluster = _netns_cluster()
    expected = _four_rank_reference(tmp_path)
    ckpt = tmp_path / "ckpt.pt"
    with cluster(rate_mbit=1000) as nodes:
        extra = ("--tiacc", "--ckpt", str(ckpt), "--kill-rank", "3", "--faults", "0:3")
        procs = _two_node_agents(nodes, free_port(), extra)
        out = _finish(procs, 240)
    assert all(p.returncode == 0 for p in procs), out[-5000:]
    assert "ATTEMPT 1 RESUMED 4" in out and "DONE attempt 1" in out, out[-5000:]
    _same_losses_within_rounding(out, expected)
    assert "inter-node over tcp" in out, out[-5000:]


def _kill_agent_and_its_ranks(agent: subprocess.Popen[str]) -> None:
    """SIGKILL to a torchrun agent and the ranks it started, as when a node is lost."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children")
    ranks = [int(pid) for pid in children.read_text().split()] if children.exists() else []
    agent.kill()
    for pid in ranks:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def _wait_for_step(ckpt: Path, step: int, agents: list[subprocess.Popen[str]]) -> int:
    """Waits until the checkpoint holds ``step`` or a later one; returns its step."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        saved = torch.load(ckpt)["step"] if ckpt.exists() else -1
        if saved >= step:
            return saved
        if any(agent.poll() is not None for agent in agents):
            break
        time.sleep(0.1)
    out = _finish(agents, 5)
    raise AssertionError(f"no checkpoint of step {step}, or an agent ended early\n{out[-4000:]}")


def _finish(procs: list[subprocess.Popen[str]], limit: float) -> str:
    deadline = time.monotonic() + limit
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(timed out)")
    return unmix("\n".join(outs), TAGS)


def test_a_node_lost_and_started_again_over_an_emulated_link(tmp_path: Path) -> None:
    """2 nodes x 2 ranks over the emulated link: node 1's agent and its ranks
    are killed after step 2 (a lost machine); the scheduler starts a new
    agent there. Node 0's agent restarts its ranks (its count is 1, the new
    agent's 0: the attempt handshake does not need them to agree), and the
    job resumes from the checkpoint with the uninterrupted run's losses."""
    cluster = _netns_cluster()
    expected = _four_rank_reference(tmp_path)
    ckpt = tmp_path / "ckpt.pt"
    port = free_port()
    with cluster(rate_mbit=1000) as nodes:
        extra = ("--tiacc", "--ckpt", str(ckpt), "--step-seconds", "0.3")
        node0, lost = _two_node_agents(nodes, port, extra)
        _wait_for_step(ckpt, 2, [node0, lost])
        _kill_agent_and_its_ranks(lost)
        lost_out = lost.communicate()[0]
        time.sleep(1.0)
        (again,) = _two_node_agents(nodes, port, extra, only=1)
        out = _finish([node0, again], 240)
    out = f"{unmix(lost_out, TAGS)}\n{out}"
    assert node0.returncode == 0 and again.returncode == 0, out[-5000:]
    assert re.search(r"^ATTEMPT 1 RESUMED [3-9]", out, re.M), out[-5000:]
    assert "DONE attempt 1" in out, out[-5000:]
    _same_losses_within_rounding(out, expected)


# Dead nodes leave the c10d rendezvous after 3 missed heartbeats of 1 s, and
# a round completes 2 s after its first node joined (torch: 15 s and 30 s).
MEMBERSHIP_RDZV = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2"
MEMBERSHIP_STEPS = 24


def _membership_changes(tmp_path: Path, *tiacc: str) -> str:
    """2 nodes x 2 ranks under ``torchrun --nnodes=1:2`` (c10d rendezvous
    hosted by node 0's agent): node 1's agent and ranks are killed after
    step 2; once node 0 has trained 3 steps alone, a new agent starts on
    node 1 and the job grows back to 4 ranks.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the agent's store shared
    (torch's default), torch 2.15's rendezvous cannot grow back (node 0's
    agent, rank 0 again, does not publish the new round's MASTER_ADDR that
    the new agent waits for; see docs/reliability.md)."""
    ckpt = tmp_path / ("tiacc.pt" if tiacc else "native.pt")
    extra = (*tiacc, "--ckpt", str(ckpt), "--step-seconds", "0.5", "--global-batch", "64")
    options = {
        "elastic": MEMBERSHIP_RDZV,
        "more_env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        "steps": MEMBERSHIP_STEPS,
    }
    port = free_port()
    with _netns_cluster()(rate_mbit=1000) as nodes:
        node0, lost = _two_node_agents(nodes, port, extra, **options)
        lost_at = _wait_for_step(ckpt, 2, [node0, lost])
        _kill_agent_and_its_ranks(lost)
        lost_out = lost.communicate()[0]
        _wait_for_step(ckpt, lost_at + 3, [node0])
        (again,) = _two_node_agents(nodes, port, extra, only=1, **options)
        out = _finish([node0, again], 180)
    out = f"{unmix(lost_out, TAGS)}\n{out}"
    assert node0.returncode == 0 and again.returncode == 0, out[-5000:]
    assert "DONE attempt 1" in out, out[-5000:]
    return out


def _worlds_and_losses(out: str) -> tuple[list[int], dict[int, list[float]]]:
    """The world sizes in the order rank 0 trained in them, and each step's
    losses (a step cut off by a membership change is trained again)."""
    worlds: list[int] = []
    losses: dict[int, list[float]] = {}
    for step, loss, world in re.findall(r"^LOSS (\d+) (\S+) WORLD (\d+)$", out, re.M):
        if not worlds or worlds[-1] != int(world):
            worlds.append(int(world))
        losses.setdefault(int(step), []).append(float(loss))
    return worlds, losses


def test_membership_changes_over_an_emulated_link(tmp_path: Path) -> None:
    """A world that shrinks and grows again: 4 ranks on 2 nodes, 2 on node 0
    when node 1 is lost, 4 when a new agent starts there.

    The engine is rebuilt for each world: flat on one node (its start-up
    line says why), 2D groups between the two nodes. The script takes each
    rank's share of one fixed batch of 64 samples per step, so a step's loss
    and gradient do not depend on the world it ran in, nor on which steps
    ran before the shrink or the growth (those depend on timing). The
    reference is the stock script through the same scenario: each step's
    loss within float rounding (the engine sums in another order)."""
    native = _membership_changes(tmp_path)
    out = _membership_changes(tmp_path, "--tiacc")
    for run in (native, out):
        worlds, losses = _worlds_and_losses(run)
        assert worlds == [4, 2, 4], (worlds, run[-5000:])
        assert sorted(losses) == list(range(MEMBERSHIP_STEPS)), run[-5000:]
    expected = _worlds_and_losses(native)[1]
    for step, values in _worlds_and_losses(out)[1].items():
        for value in values + expected[step]:
            assert value == pytest.approx(expected[step][0], rel=1e-5, abs=1e-6), step
    # The start-up lines: 2D groups at 4 ranks, flat on node 0 alone, 2D again.
    engines = re.findall(r"tiacc_training: DDP communication .* world_size=(\d+) ", out)
    algorithms = re.findall(r"^tiacc_training:   CPU buckets: .* algorithm=(.*)$", out, re.M)
    connected = re.findall(r"^tiacc_training:   CPU buckets connected: (.*)$", out, re.M)
    assert engines == ["4", "2", "4"], (engines, out[-5000:])
    assert [a.split(" (")[0] for a in algorithms] == ["auto", "flat ring", "auto"], algorithms
    assert "auto: no whole nodes of several ranks to go 2d over" in algorithms[1], algorithms
    two_d = "inter-node over tcp, intra-node over shared memory"
    assert [two_d in c for c in connected] == [True, False, True], connected
