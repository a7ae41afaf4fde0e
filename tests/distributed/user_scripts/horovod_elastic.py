"""A Horovod elastic training script, as Horovod's documentation shapes one.

With stock Horovod its first line would be ``import horovod.torch as hvd``;
nothing else differs. Every step trains on the same global batch of 12
samples, whatever the number of workers: each worker takes its share and
the gradients are summed, so the parameters after N steps are the same
for any sequence of worlds (within float rounding) when no committed step
is lost or done twice.

Prints ``STEP step SIZE n RANK r`` after each committed step, ``RESET size
n step s`` after each new round, ``CRASH`` before killing itself (when
``--crash-file`` exists on host ``--crash-host``) and ``DONE rank r size n
step s PARAMS [...]`` at the end.
"""

import argparse
import json
import os
import signal
import time

import torch

import tiacc_training.torch.horovod as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--step-seconds", type=float, default=0.0)
parser.add_argument("--crash-file", default="")
parser.add_argument("--crash-host", default="")
args = parser.parse_args()

GLOBAL_BATCH = 12

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), op=hvd.Sum
)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(GLOBAL_BATCH, 1, generator=g)
    return x, y


def maybe_crash():
    if not args.crash_file or os.environ.get("HOROVOD_HOSTNAME") != args.crash_host:
        return
    if os.path.exists(args.crash_file):
        os.remove(args.crash_file)
        print("CRASH", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        x, y = batch(state.step)
        mine = slice(hvd.rank(), GLOBAL_BATCH, hvd.size())
        optimizer.zero_grad()
        loss = ((model(x[mine]) - y[mine]) ** 2).sum() / GLOBAL_BATCH
        maybe_crash()
        loss.backward()
        optimizer.step()
        state.step += 1
        print(f"STEP {state.step} SIZE {hvd.size()} RANK {hvd.rank()}", flush=True)
        state.commit()
        time.sleep(args.step_seconds)


state = hvd.elastic.TorchState(model, optimizer, step=0)
state.register_reset_callbacks(
    [lambda: print(f"RESET size {hvd.size()} step {state.step}", flush=True)]
)
train(state)
params = [round(float(v), 7) for p in model.parameters() for v in p.detach().flatten()]
print(
    f"DONE rank {hvd.rank()} size {hvd.size()} step {state.step} PARAMS {json.dumps(params)}",
    flush=True,
)
