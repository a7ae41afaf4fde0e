"""One rank of test_ddp_waiting: a few DDP steps, then stats()["waiting"] as RESULT.

One more step runs under torch's profiler: RESULT's ``hook_spans`` counts
the engine hook's spans it recorded, ``buckets`` the buckets that step
handed to the engine.
"""

import argparse
import json

import torch
from torch import nn

import tiacc_training.torch.distributed as tdist
from tiacc_training.torch.distributed._hook import PROFILE_HOOK

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
result = dict(tdist.stats()["waiting"])
carried = sum(tdist.stats()["buckets"].values())
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    opt.zero_grad()
    ddp(torch.randn(16, 64)).square().mean().backward()
    opt.step()
result["hook_spans"] = sum(1 for e in prof.events() if e.name == PROFILE_HOOK)
result["buckets"] = sum(tdist.stats()["buckets"].values()) - carried
print("RESULT " + json.dumps(result), flush=True)
