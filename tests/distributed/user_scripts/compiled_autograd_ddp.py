"""DDP under compiled autograd (optimize_ddp="python_reducer"), with torchrun."""

import tiacc_training.torch.distributed as tdist

tdist.init_tiacc_training()

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    # DDP's python reducer: each gradient reduced in the compiled backward graph.
    torch._dynamo.config.optimize_ddp = "python_reducer"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(4, 8, generator=g)
        optimizer.zero_grad()
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
            loss = compiled(x).pow(2).mean()
            loss.backward()
        optimizer.step()
        print(f"LOSS {rank}.{step} {loss.item()!r}", flush=True)
    weight = model.module[0].weight.detach().clone()
    weights = [torch.zeros_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(weights, weight)
    if rank == 0:
        print(f"HALVES_SYNCED {all(torch.equal(weights[0], w) for w in weights)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
