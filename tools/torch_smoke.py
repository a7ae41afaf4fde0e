"""Smoke test of the "tiacc" CPU collectives on the torch release installed here.

Run by ``tools/torch_smoke.sh`` inside a virtual environment that holds one
torch release and tiacc-training::

    python tools/torch_smoke.py 2.0.1

It starts two ranks on this host (subprocesses of this file, rendezvous on
a free loopback port). Each rank runs a script in the drop-in's shape: the
two lines (``import tiacc_training.torch.distributed as tdist``,
``tdist.init_tiacc_training()``), then its own
``dist.init_process_group("gloo")``. The checks, every one on every rank:

- ``torch``: the torch imported is the release asked for.
- ``init``: the two lines and ``init_process_group`` return.
- ``backend``: the default group's CPU collectives are served by the
  "tiacc" backend (its start-up line names it, and the engine counted the
  ``all_reduce`` below in ``tdist.stats()["collectives"]``).
- ``all_reduce``: one ``dist.all_reduce`` gives the exact sum.
- ``ddp``: one DDP step of a small CPU model gives exactly the average of
  the ranks' own gradients, through the engine (``tdist.stats()["steps"]``
  at least 1, no bucket left to torch's own allreduce).

It prints one JSON line (the torch version, the path the backend took,
why where it is unavailable, each check's result with its error text, the
seconds it took) and exits non-zero when a check failed. Whatever goes
wrong, the line is printed.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

# The tests' port allocator (a launch of two ranks, like theirs).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from _launch import free_port  # noqa: E402

# The checks, in the order they are reported.
CHECKS = ("torch", "init", "backend", "all_reduce", "ddp")
# A rank's result line on its stdout starts with this.
MARK = "TORCH_SMOKE_RANK "
# The most characters of an error text kept in the JSON line.
ERROR_CHARS = 600
# Seconds before the job's deadline a rank still running dumps its stacks.
STACK_MARGIN = 8.0
# The innermost frames of a hung rank's stack that are reported.
STACK_FRAMES = 4


def _short(text: str) -> str:
    """An error text cut to its last ``ERROR_CHARS`` characters, one line."""
    text = " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    return text if len(text) <= ERROR_CHARS else "..." + text[-ERROR_CHARS:]


def _error(error: BaseException) -> str:
    """``Type: message`` of an exception, shortened."""
    return _short(f"{type(error).__name__}: {error}")


def _check(result: str, error: str | None = None) -> dict[str, Any]:
    """One check's entry: ``pass``, ``fail`` or ``skip``, and its error text."""
    return {"result": result, "error": error}


# -- one rank ---------------------------------------------------------------


def _ddp_inputs(rank: int) -> tuple[Any, Any]:
    """Rank ``rank``'s batch and loss weights: small integers, so sums are exact."""
    import torch

    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(-3, 4, (6, 8), generator=generator).float()
    weight = torch.randint(-2, 3, (6, 4), generator=generator).float()
    return x, weight


def _ddp_model() -> Any:
    """The same small model on every rank, with small integer parameters."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randint(-2, 3, parameter.shape, generator=generator).float())
    return model


def _expected_grads(world: int) -> list[Any]:
    """The average over ranks of each rank's own gradients, computed here."""
    total: list[Any] | None = None
    for rank in range(world):
        model = _ddp_model()
        x, weight = _ddp_inputs(rank)
        (model(x) * weight).sum().backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    assert total is not None
    return [g / world for g in total]


def _served(stats: dict[str, Any], name: str) -> int:
    """How many ``name`` collectives the "tiacc" backend served in this process."""
    return int(stats.get("collectives", {}).get(name, 0))


def run_rank(
    rank: int, world: int, timeout: float, report: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """One rank: the drop-in's two lines, the script's own group, the checks.

    Args:
        rank: this process's rank.
        world: the number of ranks.
        timeout: seconds a collective may wait (the group's timeout).
        report: called with the result so far before each step (its
            ``running`` names the step), so that a rank that hangs still
            says how far it got.

    Returns:
        ``checks`` (each check's result), ``path`` and ``reason`` (what the
        backend took, and why it is unavailable), ``line`` (the start-up
        line on CPU collectives), ``backend_type`` and ``stats`` (the
        engine's counts, without its own counters).
    """
    out: dict[str, Any] = {"checks": {name: _check("skip") for name in CHECKS}}
    checks = out["checks"]
    checks["torch"] = _check("pass")

    def step(name: str | None) -> None:
        out["running"] = name
        report(out)

    step("init")
    try:
        import torch
        import torch.distributed as dist

        import tiacc_training.torch.distributed as tdist

        tdist.init_tiacc_training()
        _describe(out)  # the path is known before the group exists
        step("init")
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
        )
    except Exception as error:
        checks["init"] = _check("fail", _error(error))
        _describe(out)
        return out
    checks["init"] = _check("pass")
    _describe(out)

    from tiacc_training.torch.distributed import _backend

    # all_reduce: rank r holds (r + 1) * [0, 1, ..., n-1]; the sum is exact.
    step("all_reduce")
    served_before = _served(tdist.stats(), "allreduce")
    try:
        n = 1000
        tensor = torch.arange(n, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(tensor)
        want = torch.arange(n, dtype=torch.float32) * (world * (world + 1) // 2)
        if not torch.equal(tensor, want):
            wrong = (tensor != want).nonzero().flatten()
            first = int(wrong[0])
            raise AssertionError(
                f"{len(wrong)} of {n} elements differ; element {first}: "
                f"got {float(tensor[first])}, want {float(want[first])}"
            )
        checks["all_reduce"] = _check("pass")
    except Exception as error:
        checks["all_reduce"] = _check("fail", _error(error))
    served = _served(tdist.stats(), "allreduce") - served_before

    # backend: constructed, and it served the all_reduce.
    problems = []
    line = out.get("line") or ""
    if not line.startswith(f"CPU collectives: {_backend.NAME} "):
        problems.append(f"start-up line: {line!r}")
    if served != 1:
        problems.append(f"tdist.stats()['collectives'] counted {served} allreduce, not 1")
    if "form" in out and out["form"] != out.get("path"):
        problems.append(f"path() says {out.get('path')!r}, the group's form is {out['form']!r}")
    checks["backend"] = _check("fail" if problems else "pass", "; ".join(problems) or None)

    # ddp: one step; gradients are the exact average, through the engine.
    step("ddp")
    try:
        expected = _expected_grads(world)
        model = torch.nn.parallel.DistributedDataParallel(_ddp_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, weight = _ddp_inputs(rank)
        optimizer.zero_grad()
        (model(x) * weight).sum().backward()
        problems = []
        for (name, parameter), want in zip(model.module.named_parameters(), expected):
            if parameter.grad is None or not torch.equal(parameter.grad, want):
                got = None if parameter.grad is None else parameter.grad.flatten()[:4].tolist()
                problems.append(
                    f"gradient of {name}: got {got}..., want {want.flatten()[:4].tolist()}..."
                )
        optimizer.step()
        stats = tdist.stats()
        if stats["steps"] < 1:
            problems.append(
                f"tdist.stats()['steps'] is {stats['steps']}: no bucket reached the engine"
            )
        if stats["native"]:
            problems.append(f"buckets left to torch's own allreduce: {stats['native']}")
        checks["ddp"] = _check("fail" if problems else "pass", "; ".join(problems) or None)
    except Exception as error:
        checks["ddp"] = _check("fail", _error(error))

    stats = tdist.stats()
    out["stats"] = {key: stats[key] for key in ("steps", "buckets", "native", "collectives")}
    step("destroy_process_group")
    try:
        dist.destroy_process_group()
    except Exception as error:  # reported, not a check
        out["destroy_error"] = _error(error)
    out["running"] = None
    return out


def _describe(out: dict[str, Any]) -> None:
    """Adds what the backend took: ``path``, ``reason``, ``line``, ``backend_type``."""
    try:
        from tiacc_training.torch.distributed import _backend

        out["path"] = getattr(_backend, "path", lambda: "unknown")()
        out["reason"] = _backend.unavailable_reason()
        out["line"] = _backend.describe_cpu_collectives()
        # Where the probe exists: why each form can or cannot be built, and
        # the form the default group got.
        if hasattr(_backend, "forms"):
            out["forms"] = _backend.forms()
        if hasattr(_backend, "form_of"):
            out["form"] = _backend.form_of()
        backend = _backend.cpu_backend_of()
        out["backend_type"] = None if backend is None else type(backend).__name__
    except Exception as error:
        out.setdefault("path", "unknown")
        out["describe_error"] = _error(error)


def _print_result(out: dict[str, Any]) -> None:
    """Prints a rank's result (so far) as one line on its stdout."""
    print(MARK + json.dumps(out, default=str), flush=True)


def rank_main(rank: int, world: int, timeout: float) -> int:
    """A rank's process: runs the checks and prints its result lines.

    A rank still running shortly before the job's deadline writes every
    thread's stack to its stderr (``faulthandler``): the job reports where
    it hung.
    """
    faulthandler.dump_traceback_later(max(1.0, timeout - STACK_MARGIN), exit=False)
    try:
        out = run_rank(rank, world, timeout, _print_result)
    except BaseException as error:  # the line is printed whatever happens
        out = {"checks": {"init": _check("fail", _error(error))}, "trace": traceback.format_exc()}
    faulthandler.cancel_dump_traceback_later()
    _print_result(out)
    return 0


def hung_at(stderr: str) -> str:
    """Where a rank hung: the innermost frames of its main thread's stack.

    Args:
        stderr: the rank's stderr, holding ``faulthandler``'s dump.

    Returns:
        ``"func (file:line) < caller (file:line) < ..."``, or ``""``.
    """
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stderr)
    main = [b for b in blocks if "in run_rank" in b]
    if not main:
        return ""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', main[-1])
    return " < ".join(
        f"{func} ({os.path.basename(path)}:{line})" for path, line, func in frames[:STACK_FRAMES]
    )


# -- the job ------------------------------------------------------------------


def launch(world: int, timeout: float) -> list[dict[str, Any]]:
    """Starts ``world`` ranks of this file and collects their results.

    Args:
        world: the number of ranks.
        timeout: seconds the whole job may take; ranks still running then
            are killed.

    Returns:
        Each rank's result (``run_rank``'s dict), or for a rank that printed
        none, its exit code and the end of its output as the ``init`` error.
    """
    port = free_port()
    procs = []
    # Files, not pipes: a rank that writes much while this waits on another
    # must not block on a full pipe.
    outputs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(world)]
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
        )
        command = [sys.executable, os.path.abspath(__file__), "--rank", str(rank)]
        command += ["--world-size", str(world), "--timeout", str(timeout)]
        stdout_file, stderr_file = outputs[rank]
        procs.append(subprocess.Popen(command, env=env, stdout=stdout_file, stderr=stderr_file))
    deadline = time.monotonic() + timeout
    results = []
    for rank, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out = True
        stdout, stderr = (_read(f) for f in outputs[rank])
        lines = [line for line in stdout.splitlines() if line.startswith(MARK)]
        if lines:
            result = json.loads(lines[-1][len(MARK) :])
            running = result.get("running")
            if timed_out:
                where = hung_at(stderr or "")
                hang = f"timed out after {timeout:.0f} s in {running or 'the end'}" + (
                    f", hung in {where}" if where else ""
                )
                result["timed_out"] = f"rank {rank}: {hang}"
                if running in CHECKS:
                    result["checks"][running] = _check("fail", hang)
        else:
            why = (
                f"timed out after {timeout:.0f} s" if timed_out else f"exit code {proc.returncode}"
            )
            tail = _short((stderr or "") + (stdout or ""))
            result = {
                "checks": {"init": _check("fail", f"rank {rank} printed no result ({why}): {tail}")}
            }
        results.append(result)
    return results


def _read(file: Any) -> str:
    """All of a rank's output file, which it closes."""
    with file:
        file.seek(0)
        return str(file.read())


def combine(release: str, version: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' results as one record: a check passes where it passed on every rank.

    Args:
        release: the torch release asked for.
        version: ``torch.__version__``.
        results: each rank's result.

    Returns:
        The record printed as the JSON line.
    """
    checks = {}
    for name in CHECKS:
        entries = [r.get("checks", {}).get(name, _check("skip")) for r in results]
        if name == "torch":
            ok = version.split("+")[0] == release or release == "any"
            checks[name] = _check(
                "pass" if ok else "fail", None if ok else f"asked for {release}, found {version}"
            )
            continue
        failed = [(rank, e) for rank, e in enumerate(entries) if e["result"] == "fail"]
        if failed:
            rank, entry = failed[0]
            checks[name] = _check("fail", f"rank {rank}: {entry['error']}")
        elif all(e["result"] == "pass" for e in entries):
            checks[name] = _check("pass")
        else:
            checks[name] = _check("skip")
    first = results[0] if results else {}
    record: dict[str, Any] = {
        "release": release,
        "torch": version,
        "path": first.get("path", "unknown"),
        "reason": first.get("reason"),
        "line": first.get("line"),
        "backend_type": first.get("backend_type"),
        "checks": checks,
        "ok": all(c["result"] == "pass" for c in checks.values()),
    }
    hung = [r["timed_out"] for r in results if r.get("timed_out")]
    if hung:
        # A rank that hung after its checks (destroying the group) fails too.
        record["timed_out"] = "; ".join(hung)
        record["ok"] = False
    if "stats" in first:
        record["stats"] = first["stats"]
    for key in ("forms", "form", "describe_error", "destroy_error"):
        if key in first:
            record[key] = first[key]
    return record


def main(argv: list[str] | None = None) -> int:
    """Runs the smoke test (or, with ``--rank``, one of its ranks).

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        0 when every check passed, 1 otherwise.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("release", nargs="?", default="any", help="the torch release expected")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds the job may take (default 300)"
    )
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        return rank_main(args.rank, args.world_size, args.timeout)

    start = time.monotonic()
    record: dict[str, Any] = {"release": args.release, "torch": None, "path": "unknown"}
    try:
        import torch

        import tiacc_training

        record["torch"] = torch.__version__
        record["package"] = repo_relative(os.path.dirname(tiacc_training.__file__))
        record = {
            **record,
            **combine(args.release, torch.__version__, launch(args.world_size, args.timeout)),
        }
    except BaseException as error:  # the line is printed whatever happens
        record["checks"] = {"torch": _check("fail", _error(error))}
        record["ok"] = False
    record["python"] = sys.version.split()[0]
    record["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(record, default=str), flush=True)
    return 0 if record.get("ok") else 1


def repo_relative(path: str) -> str:
    """``path`` relative to the repository root where it lies inside it.

    The results file is committed: a path inside the checkout says where
    the package came from without the build machine's own folders. A path
    outside the checkout is kept as it is.
    """
    full = os.path.realpath(path)
    root = os.path.realpath(REPO)
    return os.path.relpath(full, root) if full.startswith(root + os.sep) else path


if __name__ == "__main__":
    sys.exit(main())
