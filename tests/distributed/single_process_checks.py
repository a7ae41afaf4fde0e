"""Checks of init_tiacc_training and the DDP patch in a world of one.

No postponed annotations here: DDP checks a hook's annotations as objects.
Run as a script by test_init.py (a process group cannot be torn down and
rebuilt cleanly inside the pytest process). Prints CHECK <name> per check
that passed; any failure raises.
"""

import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

import tiacc_training.torch.distributed as tdist


def check(name: str) -> None:
    print(f"CHECK {name}", flush=True)


def conflicts() -> None:
    """The script's explicit choices win over ours, with one warning naming both."""
    # A launcher that says two ranks, a script that says one.
    os.environ.update({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    os.environ["TIACC_TRAINING_TIMEOUT"] = "30"
    tdist.init_tiacc_training(backend="gloo")
    assert not dist.is_initialized()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.init_process_group(
            "cpu:gloo",
            init_method="tcp://127.0.0.1:" + os.environ["PORT"],
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=45),
        )
    texts = [str(w.message) for w in caught if "tiacc_training" in str(w.message)]
    print("\n".join(texts), flush=True)
    assert len(texts) == 3, texts
    assert any("timeout=45 s" in t and "TIACC_TRAINING_TIMEOUT=30" in t for t in texts), texts
    assert any("world_size=1" in t and "torchrun launcher's world_size 2" in t for t in texts)
    assert any("backend='cpu:gloo'" in t and "backend='gloo'" in t for t in texts), texts
    assert dist.get_world_size() == 1
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    ddp(torch.randn(2, 4)).sum().backward()
    assert tdist.get_engine().timeout == 45.0, tdist.get_engine().timeout
    check("conflicts_warned")
    dist.destroy_process_group()
    assert tdist.get_engine() is None, "the engine outlived its group"
    check("destroyed_with_the_group")


def main(scenario: str) -> None:
    if scenario == "user_group":
        dist.init_process_group(
            "gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1
        )
    if scenario == "conflicts":
        conflicts()
        return
    if scenario in ("transport_nccl", "nccl_library_missing"):
        try:
            tdist.init_tiacc_training()
        except tdist.CommError as e:
            print(f"COMM_ERROR {e}", flush=True)
            assert not dist.is_initialized(), "the group was created before the check"
            check("transport_refused")
            return
        raise AssertionError("init_tiacc_training did not raise CommError")
    tdist.init_tiacc_training()
    tdist.init_tiacc_training()  # idempotent
    if scenario != "user_group":
        # The group is left for the script to create; a script that never
        # does gets it from its launcher (here: none, a world of one) on
        # first use.
        assert not dist.is_initialized(), "the group was created ahead of the script"
    assert dist.get_world_size() == 1 and dist.is_initialized()
    assert tdist.is_initialized()
    check("initialised")
    if not torch.cuda.is_available():
        assert tdist.cuda_transport() == "tcp", tdist.cuda_transport()
        check("cpu_transport_tcp")

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    expected = int(os.environ.get("TIACC_TRAINING_FUSION_THRESHOLD", 25 * 1024 * 1024))
    assert ddp.bucket_bytes_cap == expected, (ddp.bucket_bytes_cap, expected)
    check("fusion_threshold")

    explicit = nn.parallel.DistributedDataParallel(nn.Linear(4, 4), bucket_cap_mb=2)
    assert explicit.bucket_bytes_cap == 2 * 1024 * 1024
    check("explicit_bucket_cap")

    if scenario == "disabled":
        # The engine is off: torch's allreduce, timed for stats()["waiting"].
        assert ddp._tiacc_hook_state.native and tdist.get_engine() is None
        check("disabled")
        return

    ddp(torch.randn(4, 8)).sum().backward()
    assert tdist.get_engine() is not None and tdist.get_engine().connected
    check("engine_hook")

    calls = []

    def user_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(bucket.index())
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    mine = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    mine.register_comm_hook(None, user_hook)
    mine(torch.randn(4, 8)).sum().backward()
    assert calls, "the user's hook was not called"
    check("user_hook_wins")
    try:
        mine.register_comm_hook(None, user_hook)
    except RuntimeError as e:
        assert "only be called once" in str(e)
        check("second_user_hook_refused")

    builtin = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    builtin(torch.randn(4, 8)).sum().backward()
    assert builtin._tiacc_hook_state.user_hook is not None
    check("builtin_hook_wins")


if __name__ == "__main__":
    main(sys.argv[1])
    print("ALL_OK", flush=True)
