"""torch.compile and DDP, in both orders people write them, with torchrun.

``--order ddp-then-compile`` compiles the DDP model (DDP's own graph
splitting at bucket boundaries); ``compile-then-ddp`` wraps a compiled
module in DDP.
"""

import tiacc_training.torch.distributed as tdist

tdist.init_tiacc_training()

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--order", choices=["ddp-then-compile", "compile-then-ddp"], required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    if args.order == "ddp-then-compile":
        model = torch.compile(DDP(net), backend="aot_eager")
    else:
        model = DDP(torch.compile(net, backend="aot_eager"), bucket_cap_mb=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 16, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"LOSS {step} {total.item() / dist.get_world_size()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
