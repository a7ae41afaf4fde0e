"""DDP on CUDA through the NCCL transport: overhead, codecs, and a 2-node cluster.

Part ``one``: ResNet-50 (torchvision, random weights) on synthetic 224x224
ImageNet-shaped batches, DDP with a world of one: native DDP (NCCL) against
the tiacc hook over the NCCL transport with 1 and 4 channels. Reports the
median step time and the tiacc overhead relative to native. With one rank
native's allreduce is a copy and the hook hands each bucket back as it is
(its own average), so this measures what the hook still adds per bucket
(its checks and counts), not bandwidth.

Part ``codecs``: the casts and selections the CUDA path runs on the
channel stream, on 25M float32 elements: the fp16 cast (bytes read +
written per second) and Top-K of 1% (|x| top-k plus the gather of the
values; input bytes per second).

Part ``cluster``: 2 emulated nodes x 2 ranks, all four ranks on GPU 0
(NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1), the nodes being network
namespaces joined by a veth link shaped to ``--rate-mbit`` each way
(``tools/netns_cluster.py``; iproute2 or pyroute2) with an NCCL_HOSTID
each, so NCCL crosses the shaped link between them. The model is 8 x
Linear(2048, 2048) (134 MB of float32 gradients). Rows: native NCCL DDP
(ring, and NCCL's own choice), torch's bf16 hook and PowerSGD, and tiacc's
flat ring, fp16, bf16, 2D, 2D + fp16, Top-K 1%. Columns: median step,
the faster native's time over this one, link bytes per step per rank, and
the link's bound for dense pipelines. Needs root; ``--cluster-device cpu``
runs the same harness on CPU (gloo instead of NCCL) to check it without a
GPU, writing nothing unless ``--out`` is given.

Needs a CUDA device for every part; each part that cannot run says why.
Writes benches/results/bench_nccl.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster_jobs import AUTO_PREFIXES, cuda_env, cuda_unavailable, run_job  # noqa: E402
from _launch import free_port  # noqa: E402
from _machine import REPO, machine_info, write_json  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_ddp_bench_worker.py"
PARTS = ("one", "codecs", "cluster")


def _step_times(ddp: Any, opt: Any, batch: int, steps: int, warmup: int) -> list[float]:
    import torch
    from torch import nn

    device = next(ddp.parameters()).device
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, device=device, generator=gen)
    y = torch.randint(0, 1000, (batch,), device=device, generator=gen)
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def bench_ddp(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    runs = [("native", None), ("tiacc nccl", 1), ("tiacc nccl", 4)]
    # Interleaved rounds: every row once per round, the first row turning
    # each round, so a slow spell of the GPU lands on every row.
    steps: dict[int, list[float]] = {i: [] for i in range(len(runs))}
    medians: dict[int, list[float]] = {i: [] for i in range(len(runs))}
    for round_index in range(args.one_rounds):
        shift = round_index % len(runs)
        for index in [*range(shift, len(runs)), *range(shift)]:
            times = _one_row(args, device, *runs[index])
            steps[index] += times
            medians[index].append(round(statistics.median(times) * 1000, 2))
    rows = []
    for index, (name, channels) in enumerate(runs):
        times, round_ms = steps[index], medians[index]
        rows.append(
            {
                "pipeline": name,
                "channels": channels,
                "median_ms": round(statistics.median(times) * 1000, 2),
                "min_ms": round(min(times) * 1000, 2),
                "round_medians_ms": round_ms,
                "spread_pct": round((max(round_ms) - min(round_ms)) / min(round_ms) * 100, 2),
                "steps": len(times),
            }
        )
    native = rows[0]["median_ms"]
    for row in rows:
        row["overhead_vs_native"] = round(row["median_ms"] / native - 1.0, 4)
    return rows


def _one_row(args: argparse.Namespace, device: Any, name: str, channels: int | None) -> list[float]:
    """One world-of-one row's timed steps (a fresh model and DDP)."""
    import torch
    import torchvision
    from torch import nn

    import tiacc_training.torch.distributed as tdist

    tdist.init_tiacc_training(
        backend="nccl",
        enable=channels is not None,
        num_streams=channels,
        transport="nccl",
    )
    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    hook_state = getattr(ddp, "_tiacc_hook_state", None)
    if channels is not None and (hook_state is None or hook_state.native):
        raise RuntimeError("the tiacc hook was not attached")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    times = _step_times(ddp, opt, args.batch, args.steps, args.warmup)
    del ddp, model, opt
    torch.cuda.empty_cache()
    return times


def _gpu_seconds(fn: Any, repeats: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1000.0)
    return statistics.median(samples)


def bench_codecs(elements: int, repeats: int) -> list[dict[str, Any]]:
    import torch

    x = torch.randn(elements, device="cuda")
    k = max(1, elements // 100)

    def fp16_cast() -> None:
        x.to(torch.float16)

    def topk() -> None:
        _, idx = torch.topk(x.abs(), k, sorted=False)
        x.gather(0, idx)

    rows = []
    cast_s = _gpu_seconds(fp16_cast, repeats)
    rows.append(
        {
            "codec": "fp16 cast",
            "elements": elements,
            "median_ms": round(cast_s * 1000, 3),
            "gb_per_s": round(elements * (4 + 2) / cast_s / 1e9, 1),
            "bytes_counted": "read float32 + write float16",
        }
    )
    topk_s = _gpu_seconds(topk, repeats)
    rows.append(
        {
            "codec": "top-k 1%",
            "elements": elements,
            "median_ms": round(topk_s * 1000, 3),
            "gb_per_s": round(elements * 4 / topk_s / 1e9, 1),
            "bytes_counted": "float32 input",
        }
    )
    return rows


# (label, mode, torch hook, environment, link crossings per gradient byte
# for dense pipelines: 1.5 for a ring over 2 x 2 ranks, 1.0 for 2D, halved
# by half precision; None where the traffic depends on the data).
FP16 = ("TIACC_TRAINING_COMPRESSION", "fp16")
TWO_D = ("LIGHT_2D_ALLREDUCE", "1")
# Under the default (auto) the engine times flat against 2D at start-up:
# the fixed rows force their algorithm, the auto row shows what it picks.
FLAT = ("TIACC_TRAINING_ALGORITHM", "flat")
TOPK = (("LIGHT_TOPK_ALLREDUCE", "1"), ("LIGHT_TOPK_RATIO", "0.01"))
CLUSTER_ROWS: list[tuple[str, str, str, tuple[tuple[str, str], ...], float | None]] = [
    ("native NCCL (ring)", "native", "none", (("NCCL_ALGO", "Ring"),), 1.5),
    ("native NCCL (auto)", "native", "none", (), 1.5),
    ("torch bf16_compress_hook", "native", "bf16", (), 0.75),
    ("torch PowerSGD rank 4", "native", "powersgd", (), None),
    ("tiacc auto", "tiacc", "none", (), None),
    ("tiacc flat", "tiacc", "none", (FLAT,), 1.5),
    ("tiacc fp16", "tiacc", "none", (FLAT, FP16), 0.75),
    ("tiacc bf16", "tiacc", "none", (FLAT, ("TIACC_TRAINING_COMPRESSION", "bf16")), 0.75),
    ("tiacc 2D", "tiacc", "none", (TWO_D,), 1.0),
    ("tiacc 2D + fp16", "tiacc", "none", (TWO_D, FP16), 0.5),
    (
        "tiacc 2D + fp16 between nodes",
        "tiacc",
        "none",
        (TWO_D, FP16, ("TIACC_TRAINING_COMPRESSION_SCOPE", "inter")),
        0.5,
    ),
    ("tiacc Top-K 1%", "tiacc", "none", (FLAT, *TOPK), None),
    ("tiacc 2D + Top-K 1%", "tiacc", "none", (TWO_D, *TOPK), None),
]


def cluster_unavailable(device: str) -> str | None:
    """Why the cluster part cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    return None if device == "cpu" else cuda_unavailable()


def bench_cluster(
    args: argparse.Namespace, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """The emulated 2 x 2 cluster (see the module docstring).

    ``save(part)`` gets the part as it stands after each row (``"complete":
    False`` until the last), so a run stopped midway keeps its rows.
    """
    from netns_cluster import cluster

    common = cuda_env()
    worker_args = ["--device", args.cluster_device, "--layers", str(args.layers)]
    worker_args += ["--width", str(args.width), "--batch", "16"]
    worker_args += ["--steps", str(args.cluster_steps), "--warmup", str(args.cluster_warmup)]
    rows = []
    with cluster(args.rate_mbit) as nodes:
        for label, mode, hook, env, bound_factor in selected_rows(args.only):
            row_env = {**common, **dict(env)}
            result = run_job(
                nodes,
                WORKER,
                [*worker_args, "--mode", mode, "--hook", hook],
                row_env,
                stderr_prefixes=AUTO_PREFIXES if mode == "tiacc" else (),
            )
            auto_lines = result.pop("rank0_stderr_lines", [])
            median = statistics.median(result["step_s"])
            rows.append(
                {
                    "pipeline": label,
                    "env": dict(env),
                    "median_ms": round(median * 1000, 1),
                    "bound_factor": bound_factor,
                    **result,
                }
            )
            if auto_lines:
                rows[-1]["auto_choice"] = "; ".join(auto_lines)
            print(f"  {label}: {median * 1000:.0f} ms", flush=True)
            if save is not None:
                save(cluster_part(args, rows, complete=False))
    part = cluster_part(args, rows, complete=True)
    print(
        f"\n2 nodes x 2 ranks on "
        f"{'one GPU' if args.cluster_device == 'cuda' else 'CPU (harness check)'}, "
        f"{part['grad_bytes'] / 1e6:.0f} MB of gradients, link {args.rate_mbit:g} Mbit/s each way"
    )
    print(
        f"{'pipeline':<30} {'median ms':>10} {'native/this':>12} {'MB/step/rank':>13} "
        f"{'bound ms':>9} {'drops':>6}"
    )
    for row in part["rows"]:
        bound = "-" if row["bound_ms"] is None else f"{row['bound_ms']:.0f}"
        print(
            f"{row['pipeline']:<30} {row['median_ms']:>10.1f} {row['native_over_this']:>11.2f}x "
            f"{row['link_bytes_per_step_per_rank'] / 1e6:>13.2f} {bound:>9} "
            f"{row['link_dropped_packets']:>6}"
        )
    return part


def selected_rows(
    only: str,
) -> list[tuple[str, str, str, tuple[tuple[str, str], ...], float | None]]:
    """The cluster rows ``--only`` names, in its order after native NCCL's ring; else all."""
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    if not wanted:
        return list(CLUSTER_ROWS)
    by_label = {row[0]: row for row in CLUSTER_ROWS}
    labels = ["native NCCL (ring)", *(w for w in wanted if w != "native NCCL (ring)")]
    return [by_label[label] for label in dict.fromkeys(labels)]


def cluster_part(args: argparse.Namespace, measured: list[dict], complete: bool) -> dict[str, Any]:
    """The cluster part's result from the rows measured so far (native's first)."""
    grad_bytes = measured[0]["grad_bytes"]
    native = min(r["median_ms"] for r in measured if r["pipeline"].startswith("native"))
    link = args.rate_mbit * 1e6 / 8
    world = 4
    rows = []
    for row in measured:
        row = dict(row)
        row["native_over_this"] = round(native / row["median_ms"], 3)
        row["link_bytes_per_step_per_rank"] = round(row["link_bytes_per_step"] / world)
        factor = row.pop("bound_factor")
        row["bound_ms"] = None if factor is None else round(factor * grad_bytes / link * 1000, 1)
        rows.append(row)
    cuda = args.cluster_device == "cuda"
    return {
        "setup": {
            "nodes": 2,
            "ranks_per_node": 2,
            "device": "all ranks on GPU 0" if cuda else "cpu (harness check)",
            "rate_mbit_each_way": args.rate_mbit,
            "model": f"{args.layers} x Linear({args.width}, {args.width}) + ReLU, batch 16, SGD",
            "steps": args.cluster_steps,
            "warmup": args.cluster_warmup,
            "native_reference": "the faster of the native NCCL rows",
        },
        "complete": complete,
        "grad_bytes": grad_bytes,
        "rows": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (argparse exits with status 2 on an error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="one,codecs,cluster", help="which parts to run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--one-rounds", type=int, default=3, help="world of one: interleaved rounds of every row"
    )
    parser.add_argument("--elements", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--cluster-steps", type=int, default=10)
    parser.add_argument("--cluster-warmup", type=int, default=3)
    parser.add_argument("--cluster-device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--only",
        default="",
        help="the cluster rows to run, by label, in this order (comma-separated; native NCCL's "
        "ring runs first always)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    labels = {row[0] for row in CLUSTER_ROWS}
    rows = {w.strip() for w in args.only.split(",") if w.strip()} - labels
    if rows:
        parser.error(
            f"unknown --only rows {', '.join(sorted(rows))}: labels are {', '.join(labels)}"
        )
    unknown = {p.strip() for p in args.parts.split(",") if p.strip()} - set(PARTS)
    if unknown:
        parser.error(
            f"unknown --parts {', '.join(sorted(unknown))}: choose from {', '.join(PARTS)}"
        )
    return args


def main() -> None:
    args = parse_args()
    parts = {p.strip() for p in args.parts.split(",")}

    import torch

    result: dict[str, Any] = {"benchmark": "bench_nccl"}
    harness_check = args.cluster_device == "cpu" and args.out is None
    out = None if harness_check else args.out or REPO / "benches/results/bench_nccl.json"

    def save(part: dict[str, Any]) -> None:  # the rows so far, kept if the run is stopped
        if out is not None:
            write(out, {**result, "cluster": part})

    if "cluster" in parts:
        why = cluster_unavailable(args.cluster_device)
        if why is None:
            result["cluster"] = bench_cluster(args, save)
        else:
            print(f"cluster part skipped: {why}")
            result["cluster"] = {"skipped": why}
    if parts & {"one", "codecs"} and not torch.cuda.is_available():
        print("parts one and codecs skipped: torch.cuda.is_available() is False")
        parts -= {"one", "codecs"}
    if parts & {"one", "codecs"}:
        run_single_gpu_parts(args, parts, result)
    if out is None:
        print("harness check on CPU: no results written (give --out to keep them)")
        return
    write(out, result)
    print(f"wrote {out}")


def write(out: Path, result: dict[str, Any]) -> None:
    """Writes ``result`` with the machine's description, whole or not at all."""
    write_json(out, {**result, "machine": machine_info(["torch", "torchvision", "tiacc-training"])})


def run_single_gpu_parts(args: argparse.Namespace, parts: set[str], result: dict) -> None:
    """The world-of-one overhead and the codecs, in this process."""
    import torch

    for var, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        os.environ.setdefault(var, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())

    import tiacc_training.torch.distributed as tdist

    if "one" in parts:
        rows = bench_ddp(args)
        print(f"ResNet-50, batch {args.batch}, DDP world of 1, median of {args.steps} steps")
        print(f"{'pipeline':<12} {'channels':>8} {'median ms':>10} {'overhead':>9}")
        for row in rows:
            ch = "-" if row["channels"] is None else str(row["channels"])
            print(
                f"{row['pipeline']:<12} {ch:>8} {row['median_ms']:>10.2f} "
                f"{row['overhead_vs_native'] * 100:>8.1f}%"
            )
        result["setup"] = {
            "model": "torchvision resnet50, random weights, synthetic 224x224 batches, SGD",
            "batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.one_rounds,
            "world_size": 1,
            "gpu": torch.cuda.get_device_name(0),
            "nccl_version": ".".join(map(str, tdist.nccl_version())),
        }
        result["ddp"] = rows
    if "codecs" in parts:
        codecs = bench_codecs(args.elements, args.repeats)
        print(f"\nGPU codecs on {args.elements} float32 elements")
        for row in codecs:
            print(f"{row['codec']:<10} {row['median_ms']:>9.3f} ms {row['gb_per_s']:>8.1f} GB/s")
        result["codecs"] = codecs
    tdist.shutdown()


if __name__ == "__main__":
    main()
