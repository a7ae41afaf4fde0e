"""One rank of test_ddp_waiting: a few DDP steps, then stats()["waiting"] as RESULT."""

import argparse
import json

import torch
from torch import nn

import tiacc_training.torch.distributed as tdist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

tdist.init_tiacc_training()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
for _ in range(args.steps):
    opt.zero_grad()
    ddp(torch.randn(16, 64)).square().mean().backward()
    opt.step()
print("RESULT " + json.dumps(tdist.stats()["waiting"]), flush=True)
