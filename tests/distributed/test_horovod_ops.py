"""Horovod's collectives (``tiacc_training.torch.horovod``) in real jobs.

``horovod_ops_worker.py`` runs on 2 and 4 ranks on loopback and checks,
on every rank, each operation against a reference it computes from every
rank's input: allreduce of float and integer types with every reduction and
scale factors, async handles, grouped ops, uneven allgather and alltoall,
reducescatter, broadcast, sparse allreduce, objects, join, autograd, Adasum
against its definition (also on a set of 3 ranks), process sets and bad
input; the 2-rank job runs on a group the script made itself. Other jobs
start from Horovod's variables only (then a peer leaves), under mpirun and
alone. The CPU
collectives must have been served by the "tiacc" backend.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import (
    base_env,
    describe,
    free_port,
    json_lines,
    results_of,
    run_ranks,
    tiacc_class,
    unmix,
    wait_ranks,
)

from tiacc_training.errors import ConfigError

WORKER = Path(__file__).resolve().parent / "horovod_ops_worker.py"
TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
# Other launchers' rank variables (Open MPI's, Slurm's, MPICH's, PMIx's),
# cleared so the engine's launch_env() sees only the ones a test sets.
LAUNCHER_RANKS = ("OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK", "PMIX_RANK")


def engine_served(result: dict, names: tuple[str, ...]) -> None:
    assert result["cpu_backend"] == tiacc_class(), result
    for name in names:
        assert result["served"].get(name, 0) > 0, (name, result)


@pytest.mark.parametrize("world", [2, 4])
def test_every_operation(world: int) -> None:
    # With 2 ranks the script makes the group itself (the two lines, then its
    # own init_process_group) and hvd.init() takes it; with 4, hvd.init()
    # makes it from the launcher.
    args = ["--suite", "full", *(["--preinit"] if world == 2 else [])]
    results = results_of(run_ranks(world, args, worker=WORKER, timeout=240.0))
    for result in results:
        # Hundreds of checks per rank; the set checks add to the 4-rank job.
        assert result["checks"] > (220 if world == 4 else 200), result
        engine_served(
            result, ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "barrier")
        )
        if world == 2:
            assert result["group_kept"] is True, result  # shutdown leaves the script's group


def test_duplicate_name_in_flight() -> None:
    """A name still in flight: ValueError on the rank that reuses it, in step after.

    Every operation that takes a name (the grouped forms and alltoall too),
    in Horovod's duplicate-name tests' two orders: every rank submitting
    twice, and rank 0 twice before a barrier, the others after it (rank 0's
    first operation is matched by name with the others' after the barrier,
    the second call raises on its rank only); names agreed before included,
    and an in-place allreduce that went ahead and cannot run again.
    """
    args = ["--suite", "duplicate-names"]
    env = {"TIACC_TRAINING_TIMEOUT": "20"}  # out of step: an error, not a hang
    results = results_of(run_ranks(2, args, worker=WORKER, timeout=120.0, env=env))
    for result in results:
        assert result["checks"] > 40, result


def test_synchronize_step_warning() -> None:
    """Horovod's test_synchronize_step_warning: step() after synchronize() warns once."""
    results = results_of(run_ranks(2, ["--suite", "step-warning"], worker=WORKER, timeout=120.0))
    for result in results:
        assert result["checks"] >= 5, result


def launch_env_only(world: int, variables: dict[int, dict[str, str]], args: list[str]) -> list:
    """Starts ``world`` workers with only ``variables[rank]`` describing the job."""
    procs = []
    for rank in range(world):
        env = {k: v for k, v in base_env().items() if k not in TORCHRUN_VARIABLES}
        env.update(variables[rank])
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return wait_ranks(procs, timeout=180)


def test_horovodrun_variables_only() -> None:
    """Horovod's variables only; shutdown, init again; then a peer that leaves."""
    port = str(free_port())
    variables = {
        r: {
            "HOROVOD_RANK": str(r),
            "HOROVOD_SIZE": "2",
            "HOROVOD_LOCAL_RANK": str(r),
            "HOROVOD_LOCAL_SIZE": "2",
            "HOROVOD_CROSS_RANK": "0",
            "HOROVOD_CROSS_SIZE": "1",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
            "TIACC_TRAINING_TIMEOUT": "20",
        }
        for r in range(2)
    }
    ranks = launch_env_only(2, variables, ["--suite", "basics", "--peer-exit"])
    assert [r.returncode for r in ranks] == [0, 0], describe(ranks)
    lines = json_lines(ranks[0].stdout)
    assert lines, describe(ranks)
    result = lines[-1]
    engine_served(result, ("allreduce",))
    # torchrun's names are set for the code that reads them.
    assert result["env_rank"] == "0", result
    # The peer's exit surfaces as Horovod's error, the engine's as its cause.
    assert result["error"] == "HorovodInternalError", describe(ranks)
    assert result["runtime"] is True, result
    assert result["cause"] in ("CommError", "CommTimeoutError", "DistBackendError"), result


def test_alone_is_a_world_of_one() -> None:
    results = results_of(launch_env_only(1, {0: {}}, ["--suite", "basics"]))
    assert results[0]["checks"] > 10, results


def test_under_mpirun() -> None:
    if shutil.which("mpirun") is None:
        if os.environ.get("TIACC_TEST_REQUIRE_MPIRUN") == "1":
            pytest.fail("mpirun is required here (install openmpi-bin: make setup)")
        pytest.skip("mpirun not installed (make setup installs openmpi-bin)")
    env = {k: v for k, v in base_env().items() if k not in TORCHRUN_VARIABLES}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "OMPI_MCA_plm_rsh_agent": ""})  # fmt: skip
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "-np", "2", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "PYTHONPATH",
               "-x", "OMP_NUM_THREADS", sys.executable, str(WORKER),
               "--suite", "basics"]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # mpirun forwards both ranks' output into one pipe, where one rank's
    # line can land before the other's newline: each RESULT on its own line.
    results = json_lines(unmix(proc.stdout, ("RESULT ",)))
    assert len(results) == 2, proc.stdout[-3000:]
    # Open MPI's variables gave the ranks (0 and 1, RANK set from them).
    assert sorted(r["env_rank"] for r in results) == ["0", "1"], results
    for result in results:
        engine_served(result, ("allreduce",))


def _unset(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Removes ``names`` from the environment until the test ends.

    ``export_launcher_env`` writes torchrun's variables into ``os.environ``
    itself; each name is recorded here first (``delenv`` alone records
    nothing for a name that is not set), so the test's values do not leak
    into later tests' subprocesses (an mpirun job would see a torchrun one).
    """
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        (
            {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
            ("mpich", "1", "4", "1", "2"),
        ),
        ({"PMIX_RANK": "3", "PMI_SIZE": "4"}, ("pmix", "3", "4", "0", None)),
        (
            {
                "HOROVOD_RANK": "2",
                "HOROVOD_SIZE": "3",
                "HOROVOD_LOCAL_RANK": "0",
                "HOROVOD_LOCAL_SIZE": "1",
            },
            ("horovodrun", "2", "3", "0", "1"),
        ),
    ],
)
def test_launcher_variables_become_torchrun_ones(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], expected: tuple
) -> None:
    from tiacc_training.torch.horovod import _init

    _unset(monkeypatch, *TORCHRUN_VARIABLES, *LAUNCHER_RANKS, "HOROVOD_RANK")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    launcher = _init.export_launcher_env()
    got = (
        launcher,
        *(os.environ.get(n) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")),
    )
    assert got == expected


def test_launcher_variables_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiacc_training.torch.horovod import _init

    _unset(monkeypatch, *TORCHRUN_VARIABLES, *LAUNCHER_RANKS)
    monkeypatch.setenv("HOROVOD_RANK", "4")
    monkeypatch.setenv("HOROVOD_SIZE", "4")
    with pytest.raises(ConfigError, match="HOROVOD_RANK.*a rank below the world size 4"):
        _init.export_launcher_env()
    monkeypatch.delenv("HOROVOD_SIZE")
    with pytest.raises(ConfigError, match="HOROVOD_SIZE.*since HOROVOD_RANK=4 is set"):
        _init.export_launcher_env()
