"""An FSDP2 (fully_shard) training script on the CPU, as people write it for torchrun.

Its own init_process_group("gloo"), each Linear sharded and then the whole
model, SGD; FSDP2 all-gathers the parameters and reduce-scatters the
gradients (with the average) through the group's CPU backend.
"""

import tiacc_training.torch.distributed as tdist

tdist.init_tiacc_training()

import torch
import torch.distributed as dist
import torch.nn as nn

try:  # where this torch keeps FSDP2
    from torch.distributed.fsdp import fully_shard
except ImportError:
    from torch.distributed._composable.fsdp import fully_shard


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 32, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"LOSS {step} {total.item() / dist.get_world_size():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
