"""One rank of the device-engine check: the CUDA path against the host engine.

The device engine (``_engine.DeviceEngine``) runs the algorithms with torch
kernels; the host engine (``_engine.CommEngine``) runs the same algorithms
with Rust kernels over TCP. Every rank feeds both the same buckets (several
dtypes and lengths, some not divisible by the ranks per node, several steps
so Top-K's residuals carry over) and compares. The configuration comes from
the environment (``LIGHT_*``, ``TIACC_TRAINING_*``).

* ``--device cpu`` (CPU CI): the device engine runs on CPU tensors over the
  TCP rings, so the results must be bitwise equal.
* ``--device cuda`` (GPU tests): the device engine runs on CUDA tensors over
  NCCL (through ``_cuda.NcclChannels``, as DDP's hook does). NCCL adds in
  its own order, so dense sums of more than two ranks agree within
  rounding; Top-K's sums (rank by rank on every rank) and exchanges of two
  must still be bitwise equal (``--exact``).

Prints ``EQUAL <buckets>`` and saves rank-local results for the
cross-rank check; ``--nan-rank`` puts a NaN into one bucket of that rank.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests._launch import exit_failed
from tiacc_training import _engine
from tiacc_training.torch.distributed import _config, _engines, _launch, _rendezvous
from tiacc_training.torch.distributed._cuda import NcclChannels
from tiacc_training.torch.distributed._kernels import TorchKernels
from tiacc_training.torch.distributed._state import state

# (length, dtype) of the buckets: lengths that do not split evenly over 2 or
# 4 ranks, one that is smaller than the group, and one that Top-K's default
# threshold would skip.
BUCKETS = [
    (40_003, torch.float32),
    (1, torch.float32),
    (3, torch.float32),
    (1001, torch.bfloat16),
    (12_288, torch.float32),
    (999, torch.float64),
    (2_050, torch.float16),
]


def bucket_data(rank: int, step: int, index: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * index + rank)
    return (torch.randn(n, generator=g) * (index + 1)).to(dtype)


WIRES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--exact", action="store_true", help="bitwise equal on CUDA too")
    args = parser.parse_args()
    try:
        config = _config.effective_config()
        launch = _launch.launch_env()
        state.launch = _launch.init_process_group("gloo", config, launch)
        rank, world = dist.get_rank(), dist.get_world_size()
        store = _rendezvous.default_store()
        host = _engines.world_engine(config)
        if args.device == "cuda":
            gpu = torch.device("cuda", torch.cuda.current_device())
            device = _engines._nccl_engine(config, gpu, rank, world)
            channels = NcclChannels(device, gpu)
        else:
            prefix = "tiacc_training/device-check"
            device = _engine.DeviceEngine(
                config,
                rank,
                world,
                TorchKernels(torch.device("cpu")),
                "tcp",
                board=_rendezvous.FailureBoard(store, prefix),
                local_size=launch["local_size"],
                intra_size=_rendezvous.node_intra_size(
                    config, launch, store, prefix, rank, world, measures=False
                ),
                host="127.0.0.1",
            )
            _rendezvous.connect_tcp(device, store, prefix, rank, world, config.timeout)
        print(f"ENGINE_2D={device.two_d_members}", flush=True)
        settings = config.to_dict()
        # NCCL's dense sums of two (flat over 2 ranks, or 2D over 2 x 2)
        # are a + b, the host engine's order too.
        pairwise = world == 2 or (device.two_d_members is not None and world == 4)
        results = {}
        checked = 0
        for step in range(args.steps):
            for index, (n, dtype) in enumerate(BUCKETS):
                data = bucket_data(rank, step, index, n, dtype)
                if rank == args.nan_rank and step == 1 and index == 2:
                    data[1] = float("nan")
                try:
                    if args.device == "cuda":
                        ours = data.to(gpu)
                        channels.allreduce(ours, index).wait()
                        torch.cuda.synchronize(gpu)
                        device.check()
                        ours = ours.cpu()
                    else:
                        ours = data.clone()
                        device.allreduce(ours.view(torch.uint8), str(dtype), index, True, 0)
                except Exception:
                    finite = all(bool(torch.isfinite(v).all()) for v in results.values())
                    print(f"RECEIVED_ONLY_FINITE={finite}", flush=True)
                    raise
                reference = data.clone()
                host.allreduce(
                    reference.data_ptr(),
                    reference.numel() * reference.element_size(),
                    str(dtype),
                    index,
                    True,
                )
                # A bucket Top-K sparsifies is summed rank by rank on every
                # rank, bitwise the host engine's sums.
                exact = args.device == "cpu" or (
                    args.exact
                    and (pairwise or config.topk_applies(str(dtype), n * data.element_size()))
                )
                if exact and not torch.equal(ours.view(torch.uint8), reference.view(torch.uint8)):
                    diff = (ours.double() - reference.double()).abs().max().item()
                    raise AssertionError(
                        f"step {step} bucket {index} ({n} x {dtype}): the device engine "
                        f"differs from the host engine by up to {diff}"
                    )
                if not exact:
                    # Sums in another order differ by the rounding of the
                    # partial sums: up to ~12 sigma with 4 ranks, rounded
                    # twice, where sigma is the bucket's scale (index + 1);
                    # 16 eps leaves some slack over the 12 eps that makes.
                    tolerance = 1e-2
                    for half in (dtype, WIRES.get(settings["compression"])):
                        if half in (torch.float16, torch.bfloat16):
                            tolerance = max(tolerance, 16 * torch.finfo(half).eps)
                    torch.testing.assert_close(
                        ours.double(),
                        reference.double(),
                        rtol=tolerance,
                        atol=tolerance * (index + 1),
                    )
                results[f"{step}/{index}"] = ours
                checked += 1
        print(f"EQUAL {checked}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(results, args.out / f"device_rank{rank}.pt")
        device.shutdown()
        host.shutdown()
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except Exception as exc:  # the tests read the WORKER_ERROR line
        exit_failed(exc, linger=3)
        return 3


if __name__ == "__main__":
    sys.exit(main())
