"""Scripts in the shapes people write, with the two lines on top and nothing else.

Each script under ``user_scripts/`` is an ordinary training script (torchrun
with its own ``init_process_group``, ``mp.spawn``, several trials with
``destroy_process_group``, Accelerate, Lightning, DDP on a sub-group) whose
first two statements are::

    import tiacc_training.torch.distributed as tdist
    tdist.init_tiacc_training()

Every test runs the script as it is and a copy without those two lines
(native PyTorch), and compares the losses they print. That the gradients
went through the engine is read from outside the script: a
``sitecustomize`` on ``PYTHONPATH`` prints, as each process exits, how many
buckets the process handed to the engine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _launch import free_port, launcher_env, unmix

SCRIPTS = Path(__file__).resolve().parent / "user_scripts"
TWO_LINES = (
    "import tiacc_training.torch.distributed as tdist\n",
    "tdist.init_tiacc_training()\n",
)
STARTUP = "tiacc_training: DDP communication through the tiacc engine"
# What the scripts (and the exit reporter) print, one line per record.
TAGS = ("LOSS ", "RESULT ", "ACCURACY ", "HALVES_SYNCED ", "WORLD ", "ENGINE_BUCKETS ")

REPORTER = """\
import atexit
import os
import sys


def _report():
    hook = sys.modules.get("tiacc_training.torch.distributed._hook")
    if hook is not None:
        backend = sys.modules["tiacc_training.torch.distributed._backend"]
        served = sum(backend.served_in_process.values())
        # One write, so the lines of processes sharing the pipe never mix.
        line = (f"ENGINE_BUCKETS pid={os.getpid()} {hook.totals.engine_buckets} "
                f"collectives={served}\\n")
        os.write(2, line.encode())


atexit.register(_report)
"""


def _script(tmp_path: Path, name: str, native: bool) -> Path:
    """The script as shipped, or (``native``) a copy without the two lines."""
    source = (SCRIPTS / name).read_text()
    assert all(line in source for line in TWO_LINES), f"{name} lacks the two lines"
    folder = tmp_path / ("native" if native else "tiacc")
    folder.mkdir(exist_ok=True)
    if native:
        for line in TWO_LINES:
            source = source.replace(line, "", 1)
    target = folder / name
    target.write_text(source)
    return target


def _env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    reporter = tmp_path / "reporter"
    reporter.mkdir(exist_ok=True)
    (reporter / "sitecustomize.py").write_text(REPORTER)
    env = launcher_env(extra)
    env["PYTHONPATH"] = os.pathsep.join([str(reporter), env["PYTHONPATH"]])
    return env


# Stock torch 2.0's init_process_group() without a backend on a machine
# without a GPU.
NO_GPU_NCCL = "ProcessGroupNCCL is only supported with GPUs, no GPUs found!"

# Stock PyTorch's own abort at exit when a gloo group is never destroyed
# (torch's threads reach for Python during the interpreter's finalization).
TORCH_EXIT_ABORT = "terminate called without an active exception"
# How torchrun reports a worker that aborted (the same abort, seen from the
# launcher: its own stderr line may not reach the output).
TORCHRUN_ABORT = "Signal 6 (SIGABRT) received by PID"


def _aborted(out: str) -> bool:
    """Whether a run ended in stock torch's abort (as the worker or torchrun said)."""
    return TORCH_EXIT_ABORT in out or TORCHRUN_ABORT in out


def _run(command: list[str], env: dict[str, str], cwd: Path, timeout: float = 240) -> str:
    native = any("/native/" in part for part in command)

    def once() -> tuple[int, str]:
        proc = subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # the launcher and its workers, stopped together
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            if native:
                # Our run passed first; stock torch's own run hung (torch
                # 2.0's gloo joins its threads forever when a sub-group is
                # destroyed): there is no reference to compare with.
                pytest.skip(
                    f"the reference run on stock torch {torch.__version__} hung for "
                    f"{timeout:.0f} s: {(stdout + stderr)[-300:]!r}"
                )
            raise
        return proc.returncode, unmix(stdout, TAGS) + unmix(stderr, TAGS)

    code, out = once()
    for _ in range(2):
        if code == 0 or not native or not _aborted(out):
            break
        # The reference run without our lines hit stock torch's exit abort
        # (seen in CI with Accelerate's launcher, and with Lightning on
        # torch 2.11): run the reference again, twice at most.
        code, out = once()
    if code != 0 and native and _aborted(out) and not _losses(out):
        # Our run passed first; stock torch's own aborted three times before
        # printing a step: there is no reference to compare with.
        pytest.skip(
            f"the reference run on stock torch {torch.__version__} aborted three times "
            f"before its first step: {out[-300:]!r}"
        )
    if code != 0 and native and _aborted(out) and _losses(out):
        # Three reference runs in a row ended in stock torch's exit abort
        # (seen in CI with FSDP2 on gloo under load). The abort comes after
        # the script printed its losses: a run cut short earlier prints
        # fewer steps, and the comparison with ours fails on the missing
        # keys.
        warnings.warn(
            f"the reference run on stock torch {torch.__version__} ended in its exit "
            "abort three times; its printed losses are the reference",
            stacklevel=2,
        )
        return out
    assert code == 0, f"{' '.join(command)} failed:\n{out[-6000:]}"
    return out


def _torchrun(script: Path, *args: str, nproc: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        str(script),
        *args,
    ]


def _losses(out: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^LOSS (\S+) (\S+)$", out, re.M)}


def _engine_buckets(out: str) -> list[int]:
    return [int(m) for m in re.findall(r"^ENGINE_BUCKETS pid=\d+ (\d+) ", out, re.M)]


def _collectives(out: str) -> list[int]:
    """Per process: the script's CPU collectives the "tiacc" backend served."""
    return [int(m) for m in re.findall(r"^ENGINE_BUCKETS .* collectives=(\d+)$", out, re.M)]


def _same_losses(tiacc: str, native: str) -> None:
    ours, theirs = _losses(tiacc), _losses(native)
    assert ours and ours.keys() == theirs.keys(), (ours, theirs)
    for key in ours:
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=1e-5), (key, ours, theirs)


def _through_engine(out: str, processes: int) -> None:
    """Every training process handed buckets to the engine; one start-up report."""
    counts = _engine_buckets(out)
    training = [c for c in counts if c > 0]
    assert len(training) == processes, f"buckets per process {counts}:\n{out[-4000:]}"
    assert out.count(STARTUP) == 1, out[-4000:]
    # The script's (or its library's) own CPU collectives: DDP's start-up
    # broadcast at least, through the engine's "tiacc" backend.
    served = [c for c in _collectives(out) if c > 0]
    assert len(served) == processes, f"collectives per process {_collectives(out)}"
    assert "CPU collectives: tiacc" in out, out[-4000:]


def _both_ways(
    tmp_path: Path, name: str, command, env: dict[str, str] | None = None
) -> tuple[str, str]:
    """The script's output with the two lines, then without them (``command(script)``)."""
    runs = {}
    for native in (False, True):
        script = _script(tmp_path, name, native)
        runs[native] = _run(command(script), _env(tmp_path, env), tmp_path)
    return runs[False], runs[True]


def _compare(tmp_path: Path, name: str, command, processes: int, env=None) -> tuple[str, str]:
    """Runs the script with the two lines and without; checks both ways."""
    tiacc, native = _both_ways(tmp_path, name, command, env)
    _same_losses(tiacc, native)
    _through_engine(tiacc, processes)
    assert STARTUP not in native and not any(_engine_buckets(native))
    return tiacc, native


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        "none",
        pytest.param(
            "cpu:gloo,cuda:nccl",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available(),
                    reason="NCCL for CUDA tensors needs a CUDA device",
                ),
            ],
        ),
    ],
)
def test_a_torchrun_script_with_its_own_init_process_group(tmp_path: Path, backend: str) -> None:
    try:
        tiacc, _ = _compare(
            tmp_path, "torchrun_ddp.py", lambda s: _torchrun(s, "--backend", backend), 2
        )
    except AssertionError as error:
        if backend == "none" and "/native/" in str(error) and NO_GPU_NCCL in str(error):
            # Our run passed first; stock torch 2.0's default builds NCCL for
            # CUDA tensors even without a GPU, so its own run cannot start.
            pytest.skip(f"the reference run on stock torch {torch.__version__}: {NO_GPU_NCCL}")
        raise
    assert "WORLD 2 LOCAL_RANK 0" in tiacc
    assert "launcher=torchrun" in tiacc
    assert "default process group twice" not in tiacc
    # The form this torch constructs serves the CPU collectives, or gloo
    # with the reason: never a crash.
    assert re.search(
        r"CPU collectives: tiacc \(the engine over .*, as a (c10d Backend|ProcessGroup)", tiacc
    ), tiacc[-4000:]


def _has_fsdp2() -> bool:
    for module in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            if hasattr(importlib.import_module(module), "fully_shard"):
                return True
        except ImportError:
            continue
    return False


@pytest.mark.skipif(not _has_fsdp2(), reason="this torch has no FSDP2 (fully_shard)")
def test_an_fsdp2_script_has_every_cpu_collective_served(tmp_path: Path) -> None:
    tiacc, native = _both_ways(tmp_path, "fsdp2_train.py", _torchrun)
    _same_losses(tiacc, native)
    # FSDP2's all-gathers and its averaging reduce-scatters (and the
    # script's all_reduce) all went through the engine, nothing to gloo:
    # the exit summary of a script without a DDP model says so.
    found = re.search(
        r"CPU collectives: (\d+) served by the engine \((.*)\), (\d+) forwarded", tiacc
    )
    assert found, tiacc[-4000:]
    assert int(found[3]) == 0, tiacc[-4000:]
    served = dict(part.rsplit(" ", 1) for part in found[2].split(", "))
    assert int(served.get("reduce_scatter", 0)) >= 10 and int(served.get("allgather", 0)) >= 10
    assert STARTUP not in native


def _torchrun_two_nodes(script: Path) -> list[str]:
    """Two torchrun agents on this host, one per node of a 2 x 2 job.

    Each agent starts its node's 2 ranks (``LOCAL_RANK`` 0 and 1,
    ``LOCAL_WORLD_SIZE`` 2), as on two machines; a small launcher waits for
    both and exits with the worse code. When one agent fails, the other is
    stopped, as a cluster scheduler would stop the job: an agent left alone
    waits for its lost peers until its rendezvous times out.
    """
    port = free_port()
    agents = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(script),
        ]
        for node in (0, 1)
    ]
    launcher = (
        "import json, subprocess, sys, time\n"
        "procs = [subprocess.Popen(a) for a in json.loads(sys.argv[1])]\n"
        "while any(p.poll() is None for p in procs):\n"
        "    if any(p.poll() not in (None, 0) for p in procs):\n"
        "        for p in procs:\n"
        "            if p.poll() is None:\n"
        "                p.terminate()\n"
        "    time.sleep(0.2)\n"
        "sys.exit(max(abs(p.returncode) for p in procs))\n"
    )
    return [sys.executable, "-c", launcher, json.dumps(agents)]


@pytest.mark.skipif(not _has_fsdp2(), reason="this torch has no FSDP2 (fully_shard)")
@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_an_fsdp2_script_on_two_nodes_of_two_ranks_goes_2d(
    tmp_path: Path, compression: str
) -> None:
    """FSDP2's sharded collectives over the 2D groups, native's losses.

    Exact without compression (the losses agree as the 2-rank job's do);
    with the reduce-scatters' inter-node step in bfloat16, within 1%.
    """
    env = {"TIACC_TRAINING_ALGORITHM": "2d"}
    if compression != "none":
        env["TIACC_TRAINING_REDUCE_SCATTER_COMPRESSION"] = compression
        env["TIACC_TRAINING_COMPRESSION_SCOPE"] = "inter"
    tiacc, native = _both_ways(tmp_path, "fsdp2_train.py", _torchrun_two_nodes, env)
    if compression == "none":
        _same_losses(tiacc, native)
    else:
        ours, theirs = _losses(tiacc), _losses(native)
        assert ours.keys() == theirs.keys() and ours, (ours, theirs)
        for key in ours:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-2), (key, ours, theirs)
    found = re.search(r"CPU collectives: \d+ served by the engine .*, (\d+) forwarded", tiacc)
    assert found and int(found[1]) == 0, tiacc[-4000:]
    # The engines' counters: the sharded collectives crossed nodes over the
    # 2D groups (with their compressed reduce-scatters when asked).
    assert "collective-2d/none: " in tiacc, tiacc[-4000:]
    if compression != "none":
        assert f"collective-2d/{compression}: " in tiacc, tiacc[-4000:]


def test_an_mp_spawn_script(tmp_path: Path) -> None:
    port = str(free_port())
    _compare(tmp_path, "spawn_ddp.py", lambda s: [sys.executable, str(s), port], 2)


def test_trials_with_destroy_and_a_new_group_by_file_and_by_store(tmp_path: Path) -> None:
    port = str(free_port())

    def command(script: Path) -> list[str]:
        folder = script.parent / "rendezvous"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        return _torchrun(script, str(folder), port)

    tiacc, _ = _compare(tmp_path, "trials_ddp.py", command, 2)
    # The script's timeout=120 s is the engine's too: the report says so.
    assert "timeout=120s" in tiacc


def test_a_world_of_one_started_with_plain_python(tmp_path: Path) -> None:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }

    def command(script: Path) -> list[str]:
        return [sys.executable, str(script), "--epochs", "1"]

    tiacc, native = _both_ways(tmp_path, "torchrun_ddp.py", command, env)
    _same_losses(tiacc, native)
    _through_engine(tiacc, 1)


def test_ddp_on_a_sub_group_stays_native_with_one_warning_per_group(tmp_path: Path) -> None:
    tiacc, native = _both_ways(tmp_path, "subgroup_ddp.py", lambda s: _torchrun(s, nproc=4))
    _same_losses(tiacc, native)
    assert "HALVES_SYNCED True" in tiacc and "HALVES_SYNCED True" in native
    assert tiacc.count("on a sub-group of 2 of the 4 ranks") == 2, tiacc[-4000:]
    assert not any(_engine_buckets(tiacc))


def _compile_events(out: str) -> dict[str, int]:
    """Graph breaks and recompilations dynamo logged (``TORCH_LOGS``), over every rank."""
    return {
        "graph breaks": len(re.findall(r"\bGraph break\b", out)),
        "recompilations": len(re.findall(r"\bRecompiling function\b", out)),
    }


@pytest.mark.skipif(
    importlib.util.find_spec("torch._logging") is None
    or not hasattr(getattr(torch, "compiler", None), "disable"),
    reason="this torch has no torch.compile logging (torch._logging, torch.compiler.disable)",
)
@pytest.mark.parametrize("order", ["ddp-then-compile", "compile-then-ddp"])
def test_torch_compile_gets_no_graph_break_and_no_recompilation_from_us(
    tmp_path: Path, order: str
) -> None:
    # DDP's reducer calls the "tiacc" backend's collectives (Python) while a
    # compiled frame is active, and a compiled DDP model's forward traces the
    # forward hooks on it: both once added graph breaks and recompilations.
    env = {"TORCH_LOGS": "graph_breaks,recompiles"}
    tiacc, native = _compare(
        tmp_path, "compile_ddp.py", lambda s: _torchrun(s, "--order", order), 2, env
    )
    ours, theirs = _compile_events(tiacc), _compile_events(native)
    assert ours == theirs, (ours, theirs, tiacc[-6000:])
    # The start-up report gives the bucket cap of the model built, the
    # script's own where it gave one.
    cap = "1 MiB (the script's bucket_cap_mb)" if order == "compile-then-ddp" else "25 MiB ("
    assert f"buckets of at most {cap}" in tiacc, tiacc[-6000:]


@pytest.mark.skipif(
    not hasattr(getattr(torch, "_dynamo", None), "compiled_autograd"),
    reason="this torch has no compiled autograd",
)
def test_compiled_autograd_with_the_python_reducer_stays_native_with_one_line(
    tmp_path: Path,
) -> None:
    # In that mode DDP hands each comm hook (grad, param) per gradient; the
    # hook steps aside at DDP's construction, the model is counted as left to
    # torch, and the losses are native's.
    tiacc, native = _both_ways(tmp_path, "compiled_autograd_ddp.py", _torchrun)
    _same_losses(tiacc, native)
    assert "HALVES_SYNCED True" in tiacc and "HALVES_SYNCED True" in native
    assert tiacc.count("optimize_ddp='python_reducer'") == 2, tiacc[-4000:]  # warning, summary
    assert "left to torch: 1 (a DDP model built under" in tiacc, tiacc[-4000:]
    assert not any(_engine_buckets(tiacc)) and "AttributeError" not in tiacc


def test_an_mpirun_script_that_reads_ompi_variables(tmp_path: Path) -> None:
    if shutil.which("mpirun") is None:
        if os.environ.get("TIACC_TEST_REQUIRE_MPIRUN") == "1":
            pytest.fail("mpirun is required here (install openmpi-bin: make setup)")
        pytest.skip("mpirun not installed (make setup installs openmpi-bin)")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMPI_MCA_plm_rsh_agent": ""}  # fmt: skip

    def command(script: Path) -> list[str]:
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                "-np", "2", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "PYTHONPATH",
                "-x", "OMP_NUM_THREADS", sys.executable, str(script)]  # fmt: skip

    tiacc, _ = _compare(tmp_path, "mpirun_ddp.py", command, 2, env)
    assert "launcher=mpirun" in tiacc


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (make setup installs it)",
)
def test_hugging_face_trainer_with_a_tiny_gpt2_under_torchrun(tmp_path: Path) -> None:
    output = tmp_path / "trainer"
    tiacc, _ = _compare(
        tmp_path, "hf_trainer.py", lambda s: _torchrun(s, "--output", str(output)), 2
    )
    assert len(_losses(tiacc)) == 8, tiacc[-4000:]
    assert (
        "process group: made by init_process_group (called by the script or a framework)" in tiacc
    )
    assert "DDP model: " in tiacc and "CPU collectives: tiacc (the engine" in tiacc
    assert all(n > 0 for n in _collectives(tiacc)), tiacc[-4000:]


needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed (make setup installs it)"
)


def _ray(tmp_path: Path, *args: str):
    return lambda script: [sys.executable, str(script), "--storage", str(tmp_path / "ray"), *args]


def _summary_line(out: str) -> str:
    found = re.search(r"tiacc_training: summary: .*", out)
    assert found, out[-6000:]
    return found[0]


@needs_ray
def test_ray_train_with_the_two_lines_at_the_top_of_train_func(tmp_path: Path) -> None:
    # Ray makes the group before train_func runs: DDP goes through the engine,
    # the CPU collectives stay on the group's gloo and the start-up report
    # says why in plain words; every line keeps its prefix; the summary comes
    # when Ray destroys the group (its workers never run exit handlers).
    tiacc, native = _both_ways(tmp_path, "ray_train.py", _ray(tmp_path))
    _same_losses(tiacc, native)
    assert STARTUP in tiacc and "launcher=ray " in tiacc, tiacc[-6000:]
    assert "process group: made by Ray Train before init_tiacc_training()" in tiacc
    assert "CPU collectives: gloo (the group was made before init_tiacc_training()" in tiacc
    assert "worker_process_setup_hook" in tiacc
    assert re.search(r"tiacc_training:   DDP model: .* MiB of gradients", tiacc), tiacc[-6000:]
    summary = _summary_line(tiacc)
    assert re.search(r"summary: [1-9]\d* backward pass\(es\); through the engine: [1-9]", summary)
    assert "tiacc_training" not in native


@needs_ray
def test_ray_train_with_the_two_lines_as_worker_process_setup_hook(tmp_path: Path) -> None:
    # Run before Ray makes the group, the two lines put its CPU collectives
    # on the engine too.
    out = _run(_ray(tmp_path, "--setup-hook")(_script(tmp_path, "ray_train.py", False)),
               _env(tmp_path), tmp_path)  # fmt: skip
    assert "process group: made by init_process_group (called by Ray Train)" in out, out[-6000:]
    assert "CPU collectives: tiacc (the engine" in out
    served = re.search(r"CPU collectives: (\d+) served by the engine", _summary_line(out))
    assert served and int(served[1]) > 0, out[-6000:]


needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed"
)
needs_lightning = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None,
    reason="pytorch_lightning is not installed",
)


@needs_accelerate
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate launch"])
def test_an_accelerate_loop(tmp_path: Path, launcher: str) -> None:
    def command(script: Path) -> list[str]:
        if launcher == "torchrun":
            return _torchrun(script)
        return [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            # Accelerate's multi-process launcher (torchrun underneath); the
            # script's Accelerator(cpu=True) keeps the model on the CPU.
            "--multi_gpu",
            "--num_processes=2",
            "--num_machines=1",
            "--mixed_precision=no",
            "--dynamo_backend=no",
            f"--main_process_port={free_port()}",
            str(script),
        ]

    tiacc, _ = _compare(tmp_path, "accelerate_loop.py", command, 2)
    assert "WORLD 2" in tiacc


@needs_lightning
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_a_lightning_trainer(tmp_path: Path, launcher: str) -> None:
    def command(script: Path) -> list[str]:
        if launcher == "torchrun":
            return _torchrun(script)
        return [sys.executable, str(script)]

    env = {"MASTER_PORT": str(free_port())} if launcher == "python" else None
    tiacc, _ = _compare(tmp_path, "lightning_ddp.py", command, 2, env)
    assert "WORLD 2" in tiacc
