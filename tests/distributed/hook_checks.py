"""The hook never steps aside in silence: scenarios run in a world of one.

``never_ran``: DDP's register_comm_hook is made a no-op before the package
loads (as a library patching DDP could), so the engine's hook never runs;
the next forward must say so (or raise under TIACC_TRAINING_STRICT=1).
``fallback``: a bucket the engine does not carry (a complex64 buffer handed
to the hook) goes to torch's allreduce, counted and warned once (or an
error under strict). Prints CHECK <name> per check that passed.
"""

import os
import sys
import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if sys.argv[1] == "never_ran":
    DistributedDataParallel.register_comm_hook = lambda self, state, hook: None

import tiacc_training.torch.distributed as tdist  # noqa: E402
from tiacc_training.torch.distributed import _hook  # noqa: E402

STRICT = os.environ.get("TIACC_TRAINING_STRICT") == "1"


def check(name: str) -> None:
    print(f"CHECK {name}", flush=True)


class FakeBucket:
    """What the hook reads of a ``dist.GradBucket``."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def never_ran() -> None:
    model = DistributedDataParallel(nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model(torch.randn(2, 4))
        except tdist.CommError as e:
            assert STRICT and "comm hook did not run" in str(e), e
            check("never_ran_raised")
            return
    assert not STRICT, "strict mode did not raise"
    texts = [str(w.message) for w in caught]
    assert any("comm hook did not run in 1 backward pass" in t for t in texts), texts
    assert tdist.stats()["native"] == {"the comm hook never ran": 1}, tdist.stats()
    assert tdist.stats()["buckets"] == {}, tdist.stats()
    check("never_ran_reported")


def fallback() -> None:
    model = DistributedDataParallel(nn.Linear(4, 4))
    state = model._tiacc_hook_state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            try:
                future = _hook._tiacc_comm_hook(
                    state, FakeBucket(torch.arange(6.0).to(torch.complex64))
                )
            except tdist.CommError as e:
                assert STRICT and "torch.complex64" in str(e), e
                check("fallback_raised")
                return
            got = future.wait()  # torch reduces complex tensors as their real view
            got = got if got.is_complex() else torch.view_as_complex(got)
            assert torch.equal(got, torch.arange(6.0).to(torch.complex64)), got
    assert not STRICT, "strict mode did not raise"
    texts = [str(w.message) for w in caught if "tiacc_training" in str(w.message)]
    assert len(texts) == 1 and "torch.complex64" in texts[0] and "float32" in texts[0], texts
    [(reason, count)] = tdist.stats()["native"].items()
    assert count == 2 and "torch.complex64" in reason, tdist.stats()
    # A real step is counted.
    model(torch.randn(2, 4)).sum().backward()
    # (A world of one: the bucket is its own average, handed back as it is.)
    assert tdist.stats()["buckets"] == {"world of one": 1} and tdist.stats()["steps"] == 3, (
        tdist.stats()
    )
    check("fallback_warned_once")


if __name__ == "__main__":
    tdist.init_tiacc_training()
    {"never_ran": never_ran, "fallback": fallback}[sys.argv[1]]()
    print("ALL_OK", flush=True)
