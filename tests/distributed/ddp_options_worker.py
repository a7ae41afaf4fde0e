"""One rank of the DDP-options check: each option trained native, then through the engine.

For every DDP option in ``OPTIONS`` the same model and data train twice in
this process: with the engine off (``init_tiacc_training(enable=False)``,
torch's own allreduce) and on. The rank prints one ``RESULT`` JSON line per
option: the largest parameter difference between the two runs, the buckets
the engine carried and the buckets it had to carry (DDP's buckets of each
step).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import tiacc_training.torch.distributed as tdist
from tiacc_training.torch.distributed._hook import totals

STEPS = 6


class Branchy(nn.Module):
    """A model whose second head is used on even steps only."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU())
        self.head = nn.Linear(48, 4)
        self.extra = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + (self.extra(h) if use_extra else 0)


OPTIONS = {
    "default": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
}


def train(
    option: str, kwargs: dict, enable: bool
) -> tuple[list[torch.Tensor], int, tuple[int, int]]:
    tdist.init_tiacc_training(enable=enable)
    torch.manual_seed(0)
    # Small buckets, so the model spans several.
    model = nn.parallel.DistributedDataParallel(Branchy(), bucket_cap_mb=0.004, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    before = totals.engine_buckets
    expected = buckets = 0
    for step in range(STEPS):
        x = torch.randn(16, 24, generator=gen)
        y = torch.randint(0, 4, (16,), generator=gen)
        # Only find_unused_parameters allows a step that leaves a head unused.
        use_extra = option != "find_unused_parameters" or step % 2 == 0
        loss = nn.functional.cross_entropy(model(x, use_extra), y)
        # The buckets of this step: DDP rebuilds them in a forward pass
        # (the second, or the third with static_graph) in gradient order.
        expected += len(model.reducer._get_zeros_like_grad_buckets())
        buckets = max(buckets, len(model.reducer._get_zeros_like_grad_buckets()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    return params, totals.engine_buckets - before, (expected, buckets)


def main() -> None:
    tdist.init_tiacc_training(enable=False)
    dist.init_process_group("gloo")
    for option, kwargs in OPTIONS.items():
        native, native_carried, _ = train(option, kwargs, enable=False)
        ours, carried, (expected, buckets) = train(option, kwargs, enable=True)
        diff = max((a - b).abs().max().item() for a, b in zip(native, ours))
        engine = tdist.get_engine()
        result = {
            "option": option,
            "max_diff": diff,
            "native_carried": native_carried,
            "carried": carried,
            "expected": expected,
            "buckets": buckets,
            "transports": engine.transports if engine is not None else None,
            "shm": os.environ.get("TIACC_TRAINING_SHM"),
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.exit(0)
