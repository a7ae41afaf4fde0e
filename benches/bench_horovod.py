"""Horovod-style synthetic benchmark: images/s of ResNet-50 on the CPU.

The shape of a Horovod synthetic benchmark (random images and labels, a
torchvision ResNet-50, SGD, images/s), run three ways with the same model,
batch and optimizer:

- ``native DDP (gloo)``: stock ``DistributedDataParallel`` on gloo;
- ``tiacc DDP``: the same script with ``tdist.init_tiacc_training()`` (our
  DDP path, the engine's defaults);
- ``hvd.DistributedOptimizer``: a Horovod script on
  ``tiacc_training.torch.horovod`` (``hvd.init``, ``broadcast_parameters``,
  ``broadcast_optimizer_state``, ``DistributedOptimizer``), the engine's
  defaults.

Layouts (``--layouts``): ``loopback2`` and ``loopback4`` (2 or 4 ranks in
one network namespace, nothing crosses a shaped link) and ``link2x2`` (the
emulated two-node cluster of ``bench_ddp.py``, ``tools/netns_cluster.py``:
2 nodes x 2 ranks joined by a veth link shaped to ``--rate-mbit`` each way).
Every layout runs its three rows once per round, rounds one after the
other, so a slow spell of the machine lands on every row; a row's figure is
the median over all its timed steps, pooled over the rounds, and images/s
= ranks x batch / median step. Ratios: hvd over our DDP path and over
native DDP, each layout. To fit a small CPU machine the images are
``--image`` pixels square (default 32) and the batch ``--batch`` per rank
(default 4); the gradients are ResNet-50's whole 102 MB of float32 either
way. Needs root for ``link2x2`` (network namespaces and tc).

    python benches/bench_horovod.py [--rounds 2] [--layouts loopback2,loopback4,link2x2]

Writes benches/results/bench_horovod.json (with the machine, its load
average before and after, and the commit).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import REPO, load_average, machine_info, print_result, write_results  # noqa: E402

RESULTS = REPO / "benches" / "results" / "bench_horovod.json"
MODES = {
    "native": "native DDP (gloo)",
    "tiacc": "tiacc DDP",
    "hvd": "hvd.DistributedOptimizer",
}
LAYOUTS = {
    # name: (nodes, ranks per node)
    "loopback2": (1, 2),
    "loopback4": (1, 4),
    "link2x2": (2, 2),
}


def worker(args: argparse.Namespace) -> None:
    """One rank: trains ResNet-50 on random data, prints rank 0's ``RESULT`` JSON."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812
    from torchvision.models import resnet50

    torch.set_num_threads(1)
    hvd = None
    if args.mode == "hvd":
        import tiacc_training.torch.horovod as hvd

        hvd.init()
    elif args.mode == "tiacc":
        import tiacc_training.torch.distributed as tdist

        tdist.init_tiacc_training()
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = resnet50()
    data = torch.randn(args.batch, 3, args.image, args.image)
    target = torch.randint(0, 1000, (args.batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if hvd is not None:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        net: torch.nn.Module = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
    times = []
    cpu_start = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu_start = usage.ru_utime + usage.ru_stime
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(net(data), target).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "step_s": times[args.warmup :],
        "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "rank0_cpu_s_per_step": (usage.ru_utime + usage.ru_stime - cpu_start) / args.steps,
        "checksum": float(sum(p.double().sum() for p in model.parameters())),
    }
    if args.mode != "native":
        import tiacc_training.torch.distributed as tdist

        stats = tdist.stats()
        result["engine_buckets"] = stats["buckets"]
        result["left_to_torch"] = stats["native"]
    if dist.get_rank() == 0:
        print_result(result)
    dist.barrier()
    if hvd is not None:
        hvd.shutdown()
    elif dist.is_initialized():
        dist.destroy_process_group()


def run_row(nodes: list, layout: str, mode: str, args: argparse.Namespace) -> dict:
    """One job of one row; rank 0's result."""
    from _cluster_jobs import run_job

    n_nodes, per_node = LAYOUTS[layout]
    steps, warmup = (args.link_steps, 1) if n_nodes > 1 else (args.steps, args.warmup)
    worker_args = ["--worker", "--mode", mode, "--batch", str(args.batch)]
    worker_args += ["--image", str(args.image), "--steps", str(steps), "--warmup", str(warmup)]
    started = time.monotonic()
    result = run_job(
        nodes[:n_nodes], Path(__file__).resolve(), worker_args, {}, ranks_per_node=per_node
    )
    result["job_s"] = round(time.monotonic() - started, 1)
    median = statistics.median(result["step_s"])
    print(
        f"  {layout}: {MODES[mode]}: {median * 1000:.0f} ms/step, "
        f"{n_nodes * per_node * args.batch / median:.1f} images/s",
        flush=True,
    )
    return result


def summarize(layout: str, parts: dict[str, list[dict]], batch: int) -> dict:
    """One layout's rows: pooled steps, median, images/s, ratios."""
    n_nodes, per_node = LAYOUTS[layout]
    ranks = n_nodes * per_node
    rows = {}
    for mode, results in parts.items():
        steps = [t for r in results for t in r["step_s"]]
        median = statistics.median(steps)
        rows[mode] = {
            "pipeline": MODES[mode],
            "median_step_ms": round(median * 1000, 1),
            "images_per_s": round(ranks * batch / median, 2),
            "round_medians_ms": [round(statistics.median(r["step_s"]) * 1000, 1) for r in results],
            "steps_pooled": len(steps),
            "rank0_cpu_s_per_step": round(
                statistics.fmean(r["rank0_cpu_s_per_step"] for r in results), 3
            ),
            "link_sent_bytes": sum(r["link_sent_bytes"] for r in results),
            "link_dropped_packets": sum(r["link_dropped_packets"] for r in results),
            "engine_buckets": results[-1].get("engine_buckets"),
            "left_to_torch": results[-1].get("left_to_torch"),
            "grad_bytes": results[-1]["grad_bytes"],
        }

    def speed(a: str, b: str) -> float:
        return round(rows[a]["images_per_s"] / rows[b]["images_per_s"], 3)

    return {
        "nodes": n_nodes,
        "ranks_per_node": per_node,
        "ranks": ranks,
        "rows": list(rows.values()),
        "hvd_over_tiacc_ddp": speed("hvd", "tiacc"),
        "hvd_over_native_ddp": speed("hvd", "native"),
        "tiacc_ddp_over_native_ddp": speed("tiacc", "native"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--layouts", default="loopback2,loopback4,link2x2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="images per rank per step")
    parser.add_argument("--image", type=int, default=32, help="image side in pixels")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per job (loopback)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (loopback)")
    parser.add_argument(
        "--link-steps", type=int, default=2, help="timed steps per job on the shaped link"
    )
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown or not layouts:
        parser.error(f"--layouts: unknown {unknown}; expected some of {', '.join(LAYOUTS)}")
    if os.geteuid() != 0:
        sys.exit("bench_horovod.py needs root (network namespaces and tc)")
    from netns_cluster import cluster

    load_before = load_average()
    started = time.monotonic()
    parts: dict[str, dict[str, list[dict]]] = {x: {m: [] for m in MODES} for x in layouts}
    with cluster(args.rate_mbit) as nodes:
        for round_ in range(args.rounds):
            print(f"round {round_ + 1} of {args.rounds}", flush=True)
            for layout in layouts:
                # Which row goes first turns each round.
                modes = list(MODES)
                shift = round_ % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    parts[layout][mode].append(run_row(nodes, layout, mode, args))
    results = {x: summarize(x, parts[x], args.batch) for x in layouts}
    for layout, res in results.items():
        print(f"\n{layout} ({res['nodes']} node(s) x {res['ranks_per_node']} ranks)")
        for row in res["rows"]:
            print(
                f"  {row['pipeline']:<26} {row['median_step_ms']:>9.1f} ms "
                f"{row['images_per_s']:>8.2f} images/s"
            )
        print(
            f"  hvd / tiacc DDP {res['hvd_over_tiacc_ddp']:.2f}x, hvd / native "
            f"{res['hvd_over_native_ddp']:.2f}x, tiacc DDP / native "
            f"{res['tiacc_ddp_over_native_ddp']:.2f}x"
        )
    machine = machine_info(["torch", "torchvision", "tiacc-training"])
    machine["load_average_before_1_5_15"] = load_before
    out = {
        "benchmark": "bench_horovod",
        "setup": {
            "model": "torchvision resnet50 (25.6 M parameters, 102 MB of float32 gradients)",
            "data": f"random {args.image}x{args.image} RGB images and labels (1000 classes)",
            "batch_per_rank": args.batch,
            "optimizer": "SGD lr 0.01 momentum 0.9, cross-entropy loss",
            "threads_per_rank": 1,
            "steps": args.steps,
            "warmup": args.warmup,
            "link_steps": args.link_steps,
            "link_warmup": 1,
            "rounds": args.rounds,
            "rate_mbit_each_way": args.rate_mbit,
            "rows": MODES,
            "figure": "median step over every timed step of the rounds; "
            "images/s = ranks x batch / median step",
            "settings": "none: the engine's defaults for both tiacc rows",
            "wall_s": round(time.monotonic() - started, 1),
        },
        "layouts": results,
        "machine": machine,
    }
    write_results(args.out, out)


if __name__ == "__main__":
    main()
