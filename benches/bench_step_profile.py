"""Where a DDP step's time goes, native against tiacc, where compute hides communication.

Two ranks on this host train a torchvision model (``--model``, ResNet-18 on
64x64 images by default) with DDP: forward, backward and an SGD step on
random inputs, one thread a rank. Rows, each a separate 2-rank job:

- ``native DDP``: stock DDP over gloo (TCP over loopback);
- ``tiacc``: the same script with the two lines, defaults (the host's
  ranks exchange buckets through shared memory);
- ``tiacc over TCP``: the same with ``TIACC_TRAINING_SHM=0``, the
  transport gloo uses;
- ``compute floor``: the same two processes with no DDP and no exchange
  (what the step costs when communication costs nothing).

Each run times ``--steps`` steps phase by phase (forward, ``backward()``
until DDP has the reduced gradients, optimizer), then profiles
``--profiled`` more on rank 0 with torch's profiler (CPU) and splits each
profiled step's time into:

- **compute**: autograd's and the forward's operators, outside DDP's and
  the engine's own work;
- **DDP's bucket copies**: DDP's reducer copying gradients into buckets
  and results back out;
- **torch's collective calls**: c10d's operators on the calling thread
  (queuing gloo's allreduce, DDP's broadcasts);
- **tiacc's hook**: the engine's comm hook on the thread that runs
  backward (its ``tiacc_training.comm_hook`` span);
- **exposed wait**: the time the thread that runs the step spends in no
  operator between the end of the last autograd function and the end of
  ``backward()``: what the step waited for communication after backward,
  as the profile sees it (tiacc's own ``stats()["waiting"]`` is kept next
  to it);
- **other**: the rest of the step's wall time (Python and the autograd
  engine between operators; the optimizer's operators are under compute).

The engine's own threads are not in the profile (torch's profiler records
the threads torch starts); their cost shows where it lands on the step's
thread: in the exposed wait, and in compute slowed by sharing the cores.

Before the jobs, the engine hook's own Python cost is measured alone
(``hook_alone``): ``--hook-calls`` buckets through the hook over a
stand-in engine that returns at once, and the completion of each bucket's
future (with its chained callbacks) timed apart.

Rounds interleave the rows (``--rounds``, the first row turning each
round); each row's figures are medians of its steps pooled over the
rounds, with the spread of its round medians. The profiled steps are
slower than the timed ones (the profiler's own cost); they say where the
time goes, the timed steps how long a step is.

    python benches/bench_step_profile.py [--rounds 3] [--steps 30] [--profiled 5]

Writes ``benches/results/bench_step_profile.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import json_lines, run_ranks  # noqa: E402
from _machine import REPO, machine_info, print_result, write_results  # noqa: E402

RESULTS = REPO / "benches" / "results" / "bench_step_profile.json"
WORLD = 2
NATIVE = "native DDP"
TIACC = "tiacc"
TIACC_TCP = "tiacc over TCP"
FLOOR = "compute floor"
# Row -> (worker mode, extra environment).
ROWS: dict[str, tuple[str, dict[str, str]]] = {
    NATIVE: ("native", {}),
    TIACC: ("tiacc", {}),
    TIACC_TCP: ("tiacc", {"TIACC_TRAINING_SHM": "0"}),
    FLOOR: ("none", {}),
}
PHASES = ("forward", "backward", "optimizer")
CATEGORIES = (
    "compute",
    "ddp_bucket_copies",
    "torch_collective_calls",
    "tiacc_hook",
    "exposed_wait",
    "other",
)
# The profiler's names of the spans the worker and the engine's hook open.
SPAN = {phase: f"bench.{phase}" for phase in PHASES}
HOOK_SPAN = "tiacc_training.comm_hook"


def _interval(event: Any) -> tuple[float, float]:
    """An event's start and end in microseconds."""
    return event.time_range.start, event.time_range.end


def _inside(event: Any, span: tuple[float, float]) -> bool:
    start, end = _interval(event)
    return span[0] <= start and end <= span[1]


def _union(spans: Any) -> float:
    """The length covered by ``spans`` (start, end pairs), overlaps once."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered


def _ddp_copy(name: str) -> bool:
    return name.startswith("torch::distributed::reducer")


def _collective(name: str) -> bool:
    return name.startswith(("c10d::", "gloo:", "record_param_comms"))


def split_step(events: list[Any], step: tuple[float, float]) -> dict[str, float]:
    """One profiled step's time per category, in ms (see the module's docstring).

    Args:
        events: the profile's events (``prof.events()``).
        step: the step's start and end (the forward span's start to the
            optimizer span's end), in microseconds.
    """
    mine = [e for e in events if _inside(e, step)]
    backward = next(e for e in mine if e.name == SPAN["backward"])
    main_thread = backward.thread
    # Top-level spans of the engine's hook and DDP's and torch's own work
    # on the thread that runs the step; everything under them is theirs.
    claimed: list[tuple[str, tuple[float, float]]] = []
    for e in mine:
        if e.thread != main_thread:
            continue
        if e.name == HOOK_SPAN:
            claimed.append(("tiacc_hook", _interval(e)))
        elif _ddp_copy(e.name):
            claimed.append(("ddp_bucket_copies", _interval(e)))
        elif _collective(e.name):
            claimed.append(("torch_collective_calls", _interval(e)))
    claimed.sort(key=lambda c: c[1])
    outer: list[tuple[str, tuple[float, float]]] = []
    for kind, span in claimed:
        if outer and span[0] >= outer[-1][1][0] and span[1] <= outer[-1][1][1]:
            continue  # nested in the span before
        outer.append((kind, span))
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for kind, (start, end) in outer:
        totals[kind] += (end - start) / 1000
    # Compute: the main thread's operators outside the claimed spans and
    # outside the worker's own phase spans (self time, so nothing twice).
    for e in mine:
        if e.thread != main_thread or e.name in SPAN.values() or e.name == HOOK_SPAN:
            continue
        if any(span[0] <= _interval(e)[0] and _interval(e)[1] <= span[1] for _, span in outer):
            continue
        totals["compute"] += e.self_cpu_time_total / 1000
    autograd_ends = [
        _interval(e)[1]
        for e in mine
        if e.thread == main_thread
        and e.name.startswith("autograd::engine::evaluate_function")
        and _inside(e, _interval(backward))
    ]
    if autograd_ends:
        window = (max(autograd_ends), _interval(backward)[1])
        busy = _union(
            _interval(e)
            for e in mine
            if e.thread == main_thread and e.name not in SPAN.values() and _inside(e, window)
        )
        totals["exposed_wait"] = (window[1] - window[0] - busy) / 1000
    wall = (step[1] - step[0]) / 1000
    accounted = sum(totals.values())
    totals["other"] = max(0.0, wall - accounted)
    totals["step"] = wall
    return {k: round(v, 3) for k, v in totals.items()}


def _top_ops(prof: Any, steps: int, limit: int = 12) -> list[dict[str, Any]]:
    """The operators with the most self time, per profiled step."""
    table = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)
    return [
        {
            "name": a.key,
            "self_ms_per_step": round(a.self_cpu_time_total / 1000 / steps, 3),
            "calls_per_step": round(a.count / steps, 2),
        }
        for a in table[:limit]
    ]


def worker(args: argparse.Namespace) -> None:
    """One rank of one run: timed steps, then profiled ones; prints ``RESULT`` JSON."""
    if args.mode == "tiacc":
        import tiacc_training.torch.distributed as tdist

        tdist.init_tiacc_training()
    import torch
    import torch.distributed as dist
    import torchvision

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model: torch.nn.Module = getattr(torchvision.models, args.model)()
    if args.mode != "none":
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    rank = int(os.environ["RANK"])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)
    record = torch.profiler.record_function

    def step() -> list[float]:
        marks = [time.perf_counter()]
        with record(SPAN["forward"]):
            loss = model(x).float().pow(2).mean()
        marks.append(time.perf_counter())
        with record(SPAN["backward"]):
            loss.backward()
        marks.append(time.perf_counter())
        with record(SPAN["optimizer"]):
            optimizer.step()
            optimizer.zero_grad()
        marks.append(time.perf_counter())
        return [b - a for a, b in zip(marks, marks[1:])]

    for _ in range(args.warmup):
        step()
    timed = [step() for _ in range(args.steps)]
    result: dict[str, Any] = {
        "rank": rank,
        "load_average_after_timed_steps": os.getloadavg(),
        "step_ms": [round(sum(t) * 1000, 3) for t in timed],
        "phase_ms": {
            phase: [round(t[i] * 1000, 3) for t in timed] for i, phase in enumerate(PHASES)
        },
    }
    if args.mode == "tiacc":
        result["waiting"] = tdist.stats()["waiting"]
    if args.profiled:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if rank == 0:
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(args.profiled):
                    step()
            events = list(prof.events())
            forwards = sorted(
                (e for e in events if e.name == SPAN["forward"]), key=lambda e: _interval(e)[0]
            )
            optimizers = sorted(
                (e for e in events if e.name == SPAN["optimizer"]), key=lambda e: _interval(e)[0]
            )
            result["profile"] = [
                split_step(events, (_interval(f)[0], _interval(o)[1]))
                for f, o in zip(forwards, optimizers)
            ]
            result["top_ops"] = _top_ops(prof, args.profiled)
        else:
            for _ in range(args.profiled):
                step()
    print_result(result)
    if args.mode != "none":
        dist.destroy_process_group()


class _StandInEngine:
    """An engine that takes a bucket and completes nothing (the caller does)."""

    nan_check = False

    def __init__(self) -> None:
        self.pending: tuple[Any, Any] | None = None

    def allreduce_async(self, tensor: Any, *args: Any) -> None:
        self.pending = (args[5], tensor)


class _Group:
    def size(self) -> int:
        return WORLD


class _Bucket:
    """What the hook reads of DDP's ``GradBucket``."""

    def __init__(self, buffer: Any, index: int, last: bool) -> None:
        self._buffer, self._index, self._last = buffer, index, last

    def buffer(self) -> Any:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def hook_cost(calls: int) -> dict[str, Any]:
    """The engine hook's own Python cost a bucket, with the engine taken out.

    The hook runs as in training (counters, the step clock, the future
    chain) over a stand-in engine that returns at once; completing the
    future (what the engine's thread does when the bucket is reduced, the
    chained callbacks included) is timed apart. One thread, nothing else
    in the process: what is left is ours alone.
    """
    # Imported here, as in the worker: this file is also the native rows'
    # worker, which must not load the package.
    import torch

    from tiacc_training.torch.distributed import _hook

    engine = _StandInEngine()
    state = _hook.HookState(engine, _Group())
    buffer = torch.zeros(1 << 20)
    buckets = [_Bucket(buffer, 0, False), _Bucket(buffer, 1, True)]
    hooked, completed = [], []
    for i in range(calls):
        start = time.perf_counter()
        future = _hook._tiacc_comm_hook(state, buckets[i % 2])
        middle = time.perf_counter()
        assert engine.pending is not None
        engine_future, tensor = engine.pending
        engine_future.set_result(tensor)
        future.wait()
        end = time.perf_counter()
        hooked.append((middle - start) * 1e6)
        completed.append((end - middle) * 1e6)
    return {
        "calls": calls,
        "hook_us_median": round(statistics.median(hooked), 2),
        "completion_us_median": round(statistics.median(completed), 2),
        "hook_us_p90": round(sorted(hooked)[int(calls * 0.9)], 2),
        "completion_us_p90": round(sorted(completed)[int(calls * 0.9)], 2),
    }


def run_row(row: str, args: argparse.Namespace) -> dict[str, Any]:
    """One 2-rank job of ``row``; rank 0's result."""
    mode, env = ROWS[row]
    command = [
        "--worker", "--mode", mode, "--model", args.model, "--batch", str(args.batch),
        "--image-size", str(args.image_size), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--profiled", str(args.profiled),
    ]  # fmt: skip
    ranks = run_ranks(WORLD, command, env=env, timeout=args.timeout, worker=Path(__file__))
    for r in ranks:
        if r.returncode != 0:
            raise SystemExit(f"{row}: rank {r.rank} exited {r.returncode}:\n{r.stderr[-3000:]}")
    results = [json_lines(r.stdout)[-1] for r in ranks]
    return next(r for r in results if r["rank"] == 0)


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's figures over its runs (one a round)."""
    steps = [s for run in runs for s in run["step_ms"]]
    round_medians = [statistics.median(run["step_ms"]) for run in runs]
    row: dict[str, Any] = {
        "median_ms": _median(steps),
        "round_medians_ms": [round(m, 3) for m in round_medians],
        "spread_pct": round((max(round_medians) / min(round_medians) - 1) * 100, 2),
        "phase_median_ms": {
            phase: _median([v for run in runs for v in run["phase_ms"][phase]]) for phase in PHASES
        },
    }
    profiles = [p for run in runs for p in run.get("profile", [])]
    if profiles:
        row["profiled_steps"] = len(profiles)
        row["profile_median_ms"] = {
            key: _median([p[key] for p in profiles]) for key in (*CATEGORIES, "step")
        }
        row["top_ops"] = runs[-1]["top_ops"]
    waits = [run["waiting"] for run in runs if "waiting" in run]
    if waits:
        row["tiacc_exposed_ms_per_step"] = _median([w["exposed_ms_per_step"] for w in waits])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("native", "tiacc", "none"), help=argparse.SUPPRESS)
    parser.add_argument("--model", default="resnet18", help="a torchvision model (resnet18)")
    parser.add_argument("--batch", type=int, default=16, help="examples a rank a step (16)")
    parser.add_argument("--image-size", type=int, default=64, help="pixels a side (64)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps a run (30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    parser.add_argument("--profiled", type=int, default=5, help="profiled steps a run (5)")
    parser.add_argument(
        "--hook-calls", type=int, default=20000, help="buckets through the hook alone (20000)"
    )
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run (900)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    started = time.monotonic()
    load_before = os.getloadavg()
    hook = hook_cost(args.hook_calls)
    print(
        f"the hook's own cost: {hook['hook_us_median']:.1f} us a bucket, its completion "
        f"{hook['completion_us_median']:.1f} us",
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in args.rows}
    for round_ in range(args.rounds):
        turn = round_ % len(args.rows)
        for row in args.rows[turn:] + args.rows[:turn]:
            result = run_row(row, args)
            runs[row].append(result)
            print(
                f"round {round_}: {row}: {statistics.median(result['step_ms']):.1f} ms a step",
                flush=True,
            )
    rows = [{"pipeline": row, **summarize(runs[row])} for row in args.rows]
    native = next((r for r in rows if r["pipeline"] == NATIVE), None)
    for row in rows:
        if native is not None:
            row["over_native"] = round(row["median_ms"] / native["median_ms"], 4)
        print(f"{row['pipeline']}: {row['median_ms']:.1f} ms (spread {row['spread_pct']:.1f}%)")
        for key, value in row.get("profile_median_ms", {}).items():
            print(f"    {key}: {value:.1f} ms")
    out = {
        "benchmark": "bench_step_profile",
        "setup": {
            "model": args.model,
            "batch_per_rank": args.batch,
            "image_size": args.image_size,
            "world": WORLD,
            "threads_per_rank": 1,
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "profiled_steps": args.profiled,
            "categories": list(CATEGORIES),
        },
        "hook_alone": hook,
        "rows": rows,
        "runs": runs,
        "seconds": round(time.monotonic() - started),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "machine": machine_info(["torchvision"]),
    }
    write_results(args.out, out)


if __name__ == "__main__":
    main()
