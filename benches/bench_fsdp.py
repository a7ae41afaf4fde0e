"""FSDP2 (``fully_shard``) training step: the engine against gloo, or NCCL on a GPU.

Two models (``--model``):

- ``mlp`` (default): ``--layers`` square ``Linear`` layers (default 8 of
  1792: 25.7 M parameters, 103 MB of float32);
- ``decoder``: a GPT-2-small-shaped decoder stack: ``--layers`` pre-norm
  transformer blocks of width 768, 12 heads, a 3072-wide GELU MLP and a
  causal mask (7.1 M parameters a block), on ``--seq`` random token
  embeddings per sample (no vocabulary layer, and no final LayerNorm: the
  loss, the mean square of the output, would be 1 after one).

Each layer (block) and then the whole model is sharded with
``fully_shard``, SGD, random inputs. Every step FSDP2
all-gathers every layer's parameters twice (forward, and again in the
backward pass after resharding) and reduce-scatters every gradient with
the average: three times the model's bytes in sharded collectives, issued
by torch itself on the default group's backend. The rows, each the same
script and seed:

- ``native``: stock torch, ``init_process_group("gloo")`` (``"nccl"`` with
  ``--device cuda``);
- ``tiacc``: the same script with the two lines, the engine's defaults
  (``TIACC_TRAINING_ALGORITHM=auto`` picks flat or 2D at start-up); with
  ``--device cuda`` also ``TIACC_TRAINING_CUDA_COLLECTIVES=tiacc``, so
  the script's ``"nccl"`` group runs its CUDA collectives on the engine;
- ``tiacc flat`` / ``tiacc 2d``: the algorithm forced;
- ``tiacc 2d + bf16``: 2D with
  ``TIACC_TRAINING_REDUCE_SCATTER_COMPRESSION=bf16`` and
  ``TIACC_TRAINING_COMPRESSION_SCOPE=inter`` (only the reduce-scatter's
  inter-node step in bfloat16).

Layouts (``--layouts``): ``link2x2`` (the emulated two-node cluster of
``tools/netns_cluster.py``: 2 nodes x 2 ranks, a veth link shaped to
``--rate-mbit`` each way) and ``loopback4`` (4 ranks on one node, native
and the defaults only). Rows of a layout alternate within each round (the
first row turns each round); a row's figure is the median of every timed
step, pooled over the rounds. Every row prints its losses; the exact rows'
largest relative difference from native's is reported. Needs root
(network namespaces and tc).

``--device cuda`` puts every rank on GPU 0 (NCCL >= 2.30 with
``NCCL_MULTI_RANK_GPU_ENABLE=1``, as ``bench_nccl.py``'s cluster part;
the default link is then 1000 Mbit/s). NCCL's sums over four ranks are
in another order than the engine's 2D sums, so there the losses agree
within rounding rather than bit for bit.

    python benches/bench_fsdp.py [--rounds 2] [--layouts link2x2,loopback4] [--device cuda]
    python benches/bench_fsdp.py --model decoder --layers 4 --rate-mbit 1000 --out FILE

``make bench-fsdp-rates`` runs the decoder at each rate of ``RATES=`` (one
results file per rate, ``bench_fsdp_decoder_<rate>.json``).

Writes benches/results/bench_fsdp.json (``bench_fsdp_cuda.json`` with
``--device cuda``), with the machine, its load average before and after,
and the commit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import REPO, load_average, machine_info, print_result, write_json  # noqa: E402

RESULTS = {
    "cpu": REPO / "benches" / "results" / "bench_fsdp.json",
    "cuda": REPO / "benches" / "results" / "bench_fsdp_cuda.json",
}
# The link's default rate per device (Mbit/s each way).
RATES = {"cpu": 200.0, "cuda": 1000.0}
# Row name: (uses the two lines, settings).
ROWS: dict[str, tuple[bool, dict[str, str]]] = {
    "native": (False, {}),
    "tiacc": (True, {}),
    "tiacc flat": (True, {"TIACC_TRAINING_ALGORITHM": "flat"}),
    "tiacc 2d": (True, {"TIACC_TRAINING_ALGORITHM": "2d"}),
    "tiacc 2d + bf16": (
        True,
        {
            "TIACC_TRAINING_ALGORITHM": "2d",
            "TIACC_TRAINING_REDUCE_SCATTER_COMPRESSION": "bf16",
            "TIACC_TRAINING_COMPRESSION_SCOPE": "inter",
        },
    ),
}
LAYOUTS = {
    # name: (nodes, ranks per node, rows)
    "link2x2": (2, 2, list(ROWS)),
    "loopback4": (1, 4, ["native", "tiacc"]),
}
EXACT_ROWS = ("tiacc", "tiacc flat", "tiacc 2d")


# The decoder's shape: GPT-2 small's width, heads and MLP.
DECODER_WIDTH, DECODER_HEADS, DECODER_MLP = 768, 12, 3072


class CausalStack(torch.nn.Module):
    """Pre-norm decoder blocks with a causal mask."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                DECODER_WIDTH,
                DECODER_HEADS,
                DECODER_MLP,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return x


def build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """``--model``'s module and the parts sharded one by one (layers, blocks)."""
    if args.model == "decoder":
        model = CausalStack(args.layers)
        return model, list(model.blocks)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    return model, [x for x in model if isinstance(x, torch.nn.Linear)]


def input_shape(args: argparse.Namespace) -> tuple[int, ...]:
    """One rank's batch: samples x width, or samples x tokens x width."""
    if args.model == "decoder":
        return (args.batch, args.seq, DECODER_WIDTH)
    return (args.batch, args.width)


def describe_model(args: argparse.Namespace) -> str:
    """The model, as the results name it."""
    if args.model == "decoder":
        return (
            f"{args.layers} pre-norm decoder blocks (width {DECODER_WIDTH}, {DECODER_HEADS} "
            f"heads, MLP {DECODER_MLP}, GELU, causal mask) on {args.seq} random "
            "token embeddings a sample, each block and the whole model fully_shard-ed "
            "(FSDP2), SGD lr 0.01"
        )
    return (
        f"{args.layers} x (Linear({args.width}, {args.width}) + Tanh), "
        "each Linear and the whole model fully_shard-ed (FSDP2), SGD lr 0.01"
    )


def worker(args: argparse.Namespace) -> None:
    """One rank: FSDP2 training steps; rank 0 prints its ``RESULT`` JSON."""
    if args.two_lines:
        import tiacc_training.torch.distributed as tdist

        tdist.init_tiacc_training()

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard

    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    # The mesh says where the shards live (fully_shard's default follows
    # whichever accelerator the machine has).
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(0)
    model, blocks = build_model(args)
    model = model.to(device)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(*input_shape(args), generator=g).to(device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    dist.barrier()
    result = {"step_s": times[args.warmup :], "losses": losses, "param_bytes": params}
    if args.two_lines:
        from tiacc_training.torch.distributed import _collectives

        stats = tdist.stats()
        prefix = "cuda_" if cuda else ""
        result["served"] = stats[f"{prefix}collectives"]
        result["forwarded"] = sum(sum(why.values()) for why in stats[f"{prefix}forwarded"].values())
        result["paths"] = {
            f"{path}/{codec}": {"calls": row["buckets"], "wire_bytes": row["wire"]}
            for (path, codec), row in _collectives.counters_in_process(device.type).items()
        }
    if rank == 0:
        print_result(result)
    dist.destroy_process_group()


def run_row(nodes: list, layout: str, row: str, args: argparse.Namespace) -> dict:
    """One job of one row; rank 0's result."""
    from _cluster_jobs import AUTO_PREFIXES, cuda_env, run_job

    n_nodes, per_node, _ = LAYOUTS[layout]
    two_lines, env = ROWS[row]
    if args.device == "cuda":
        # The script's "nccl" group: its CUDA collectives on the engine.
        opt_in = {"TIACC_TRAINING_CUDA_COLLECTIVES": "tiacc"} if two_lines else {}
        env = {**cuda_env(), **opt_in, **env}
    worker_args = ["--worker", "--device", args.device]
    worker_args += ["--model", args.model, "--seq", str(args.seq)]
    worker_args += ["--layers", str(args.layers), "--width", str(args.width)]
    worker_args += ["--batch", str(args.batch), "--steps", str(args.steps)]
    worker_args += ["--warmup", str(args.warmup)] + (["--two-lines"] if two_lines else [])
    started = time.monotonic()
    result = run_job(
        nodes[:n_nodes],
        Path(__file__).resolve(),
        worker_args,
        env,
        ranks_per_node=per_node,
        timeout=1800,
        stderr_prefixes=AUTO_PREFIXES,
    )
    result["job_s"] = round(time.monotonic() - started, 1)
    median = statistics.median(result["step_s"])
    print(f"  {layout}: {row}: {median * 1000:.0f} ms/step", flush=True)
    return result


def summarize(layout: str, parts: dict[str, list[dict]]) -> dict:
    """One layout's rows: pooled steps, median, ratios, loss agreement."""
    n_nodes, per_node, _ = LAYOUTS[layout]
    native_losses = parts["native"][0]["losses"]
    rows = {}
    for row, results in parts.items():
        steps = [t for r in results for t in r["step_s"]]
        losses = results[0]["losses"]
        rows[row] = {
            "row": row,
            "settings": ROWS[row][1],
            "median_step_ms": round(statistics.median(steps) * 1000, 1),
            "round_medians_ms": [round(statistics.median(r["step_s"]) * 1000, 1) for r in results],
            "steps_pooled": len(steps),
            "losses": losses,
            "largest_relative_loss_difference_from_native": max(
                abs(a - b) / abs(b) for a, b in zip(losses, native_losses)
            ),
            "link_sent_bytes_per_job": round(
                statistics.fmean(r["link_sent_bytes"] for r in results)
            ),
            "link_dropped_packets": sum(r["link_dropped_packets"] for r in results),
            "served": results[-1].get("served"),
            "forwarded": results[-1].get("forwarded"),
            "engine_paths": results[-1].get("paths"),
            "auto_lines": results[-1].get("rank0_stderr_lines"),
        }
    native = rows["native"]["median_step_ms"]
    return {
        "nodes": n_nodes,
        "ranks_per_node": per_node,
        "param_bytes": parts["native"][0]["param_bytes"],
        "rows": list(rows.values()),
        "speedup_over_native": {
            row: round(native / r["median_step_ms"], 3)
            for row, r in rows.items()
            if row != "native"
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: ``layouts`` and ``wanted`` (the rows) as lists."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--two-lines", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", default="link2x2,loopback4")
    parser.add_argument(
        "--rows", default="", help="comma-separated rows to run (native always runs); default all"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", choices=["mlp", "decoder"], default="mlp")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers, or decoder blocks")
    parser.add_argument("--width", type=int, default=1792, help="the mlp's width")
    parser.add_argument("--seq", type=int, default=128, help="the decoder's tokens a sample")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument(
        "--device", choices=list(RESULTS), default="cpu", help="cuda: every rank on GPU 0, NCCL"
    )
    parser.add_argument(
        "--rate-mbit",
        type=float,
        help=f"default: {RATES['cpu']:g} on cpu, {RATES['cuda']:g} on cuda",
    )
    parser.add_argument("--out", type=Path, help="default: benches/results/bench_fsdp[_cuda].json")
    args = parser.parse_args(argv)
    args.rate_mbit = args.rate_mbit or RATES[args.device]
    args.out = args.out or RESULTS[args.device]
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = [x for x in args.layouts if x not in LAYOUTS]
    if unknown or not args.layouts:
        parser.error(f"--layouts: unknown {unknown}; expected some of {', '.join(LAYOUTS)}")
    args.wanted = [x.strip() for x in args.rows.split(",") if x.strip()]
    unknown = [x for x in args.wanted if x not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; expected some of {', '.join(ROWS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    layouts, wanted = args.layouts, args.wanted
    if os.geteuid() != 0:
        sys.exit("bench_fsdp.py needs root (network namespaces and tc)")
    if args.device == "cuda":
        from _cluster_jobs import cuda_unavailable

        why = cuda_unavailable()
        if why:
            sys.exit(f"bench_fsdp.py --device cuda {why}")
    from netns_cluster import cluster

    load_before = load_average()
    started = time.monotonic()
    parts = {
        x: {row: [] for row in LAYOUTS[x][2] if row == "native" or not wanted or row in wanted}
        for x in layouts
    }
    with cluster(args.rate_mbit) as nodes:
        for round_ in range(args.rounds):
            print(f"round {round_ + 1} of {args.rounds}", flush=True)
            for layout in layouts:
                rows = list(parts[layout])
                shift = round_ % len(rows)
                for row in rows[shift:] + rows[:shift]:
                    parts[layout][row].append(run_row(nodes, layout, row, args))
                    # What is measured so far, kept if the run is stopped.
                    write(args, parts, load_before, started, complete=False)
    results = write(args, parts, load_before, started, complete=True)
    for layout, res in results.items():
        print(f"\n{layout} ({res['nodes']} node(s) x {res['ranks_per_node']} ranks)")
        for row in res["rows"]:
            ratio = res["speedup_over_native"].get(row["row"])
            print(
                f"  {row['row']:<18} {row['median_step_ms']:>9.1f} ms"
                + (f"  {ratio:.2f}x native" if ratio else "")
                + f"  losses within {row['largest_relative_loss_difference_from_native']:.1e}"
            )
    print(f"wrote {args.out}")


def write(
    args: argparse.Namespace,
    parts: dict[str, dict[str, list[dict]]],
    load_before: list[float],
    started: float,
    complete: bool,
) -> dict[str, dict]:
    """Writes ``--out`` from the rows measured so far; returns the layouts' results.

    A layout appears once its native row has run (the reference of its
    ratios), with the rows measured by then.
    """
    results = {
        layout: summarize(layout, {row: done for row, done in rows.items() if done})
        for layout, rows in parts.items()
        if rows["native"]
    }
    machine = machine_info(["torch", "tiacc-training"])
    machine["load_average_before_1_5_15"] = load_before
    out = {
        "benchmark": "bench_fsdp",
        "setup": {
            "model": describe_model(args),
            "model_kind": args.model,
            "device": "every rank on GPU 0, NCCL" if args.device == "cuda" else "cpu, gloo",
            "batch_per_rank": args.batch,
            "threads_per_rank": 1,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "rate_mbit_each_way": args.rate_mbit,
            "exact_rows": EXACT_ROWS,
            "figure": "median step over every timed step of the rounds",
            "wall_s": round(time.monotonic() - started, 1),
        },
        "complete": complete,
        "layouts": results,
        "machine": machine,
    }
    write_json(args.out, out)
    return results


if __name__ == "__main__":
    main()
