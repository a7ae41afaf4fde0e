"""Ray Train: a TorchTrainer with 2 CPU workers, the two lines at the top of train_func.

Ray makes the process group before ``train_func`` runs. With
``--setup-hook`` the same two lines run as Ray's
``worker_process_setup_hook`` instead, before Ray makes the group.
"""

import argparse

import ray
import torch
import torch.distributed as dist
import torch.nn as nn
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model


def train_func():
    import tiacc_training.torch.distributed as tdist

    tdist.init_tiacc_training()

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = prepare_model(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(5):
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


def setup_hook():
    """The two lines as Ray's worker_process_setup_hook (run in every worker)."""
    import tiacc_training.torch.distributed as tdist

    tdist.init_tiacc_training()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--setup-hook", action="store_true")
    args = parser.parse_args()
    runtime_env = {"worker_process_setup_hook": setup_hook} if args.setup_hook else None
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env)
    trainer = TorchTrainer(
        train_func,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=args.storage, name="ray_train"),
    )
    trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
