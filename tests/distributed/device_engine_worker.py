"""One rank of the device-engine check: the CUDA path against the host engine.

The device engine (``_engine.DeviceEngine``) runs the algorithms with torch
kernels; the host engine (``_engine.CommEngine``) runs the same algorithms
with Rust kernels over TCP. Every rank feeds both the same buckets (several
dtypes and lengths, some not divisible by the ranks per node, several steps
so Top-K's residuals carry over) and compares. The configuration comes from
the environment (``LIGHT_*``, ``TIACC_TRAINING_*``).

* ``--device cpu`` (CPU CI): the device engine runs on CPU tensors over the
  TCP rings, so the results must be bitwise equal.
* ``--device cuda`` (GPU tests): the device engine runs on CUDA tensors over
  NCCL (through ``_cuda.NcclChannels``, as DDP's hook does). NCCL adds in
  its own order, so dense sums of more than two ranks agree within
  rounding; Top-K's sums (rank by rank on every rank) and exchanges of two
  must still be bitwise equal (``--exact``).

Prints ``EQUAL <buckets>`` and saves rank-local results for the
cross-rank check; ``--nan-rank`` puts a NaN into one bucket of that rank.

``--cases FILE`` runs many configurations in these same processes, one
after the other (a JSON list of ``{"id", "env", "exact"}``): each case's
variables replace the previous case's, both engines are built anew for it,
its results go to ``<out>/<id>/`` and every line it prints starts with
``CASE <id> ``. The ranks and the default group start once for a whole
matrix. A rank that finds a wrong result goes on with the case's
collectives and raises at its end, so a failed case costs only itself
(``tests/_cases``): the cases after it run, and the run ends with exit
code 3 naming the failed ones.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests._cases import Findings, run_cases
from tests._launch import exit_failed
from tiacc_training import _engine
from tiacc_training.torch.distributed import _config, _engines, _launch, _rendezvous, _runtime
from tiacc_training.torch.distributed._cuda import NcclChannels
from tiacc_training.torch.distributed._kernels import TorchKernels
from tiacc_training.torch.distributed._state import state

# What every line printed starts with: ``CASE <id> `` while a case of
# ``--cases`` runs.
_prefix = ""


def say(text: str) -> None:
    print(_prefix + text, flush=True)


# (length, dtype) of the buckets: lengths that do not split evenly over 2 or
# 4 ranks, one that is smaller than the group, and one that Top-K's default
# threshold would skip.
BUCKETS = [
    (40_003, torch.float32),
    (1, torch.float32),
    (3, torch.float32),
    (1001, torch.bfloat16),
    (12_288, torch.float32),
    (999, torch.float64),
    (2_050, torch.float16),
]


def bucket_data(rank: int, step: int, index: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * index + rank)
    return (torch.randn(n, generator=g) * (index + 1)).to(dtype)


WIRES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# The probe: one more float32 bucket, at an index no other bucket has (so
# Top-K's state for it starts afresh), whose result is checked against a
# reference computed here from every rank's input, not by an engine.
PROBE_INDEX = len(BUCKETS)
PROBE_LEN = 1013


def probe_input(rank: int, world: int, settings: dict, whole_bucket_wire: bool) -> torch.Tensor:
    """Rank ``rank``'s probe. With the whole (flat) bucket compressed: values
    whose share (x * scale / world) is an integer in 2..6 (either sign) off
    by less than half the wire type's spacing, so every share rounds to the
    integer and the shares sum exactly in any order. Otherwise small normal
    values (none a float16 value, none clipped by Top-K's clipping)."""
    if not whole_bucket_wire:
        g = torch.Generator().manual_seed(700 + rank)
        return torch.randn(PROBE_LEN, generator=g) * 0.01
    delta = 2.0**-12 if settings["compression"] == "fp16" else 2.0**-9
    values = []
    for i in range(PROBE_LEN):
        m = (i * 7 + rank * 3) % 10
        j = -m - 2 if m < 5 else m - 3
        sign = -1.0 if (i + rank) % 3 == 0 else 1.0
        values.append((j + sign * delta) * world / settings["compression_scale"])
    return torch.tensor(values, dtype=torch.float32)


def sparse_sum(senders: list[torch.Tensor], density: float, fp16_values: bool) -> torch.Tensor:
    """Each sender's ``ceil(density * n)`` entries of largest magnitude
    (torch.topk), added into zeros in sender order."""
    out = torch.zeros_like(senders[0])
    for v in senders:
        idx = v.abs().topk(math.ceil(v.numel() * density)).indices
        out[idx] += v[idx].half().float() if fp16_values else v[idx]
    return out


def probe_reference(
    inputs: list[torch.Tensor], settings: dict, intra: int | None
) -> tuple[torch.Tensor, bool]:
    """The probe's average over the ranks as the configuration defines it,
    with torch's roundings, and whether it is exact (bit for bit) or the
    float64 average (to within float32's rounding of the sums). ``intra``:
    ranks per node with 2D (here 2, on 1 or 2 nodes: every sum in it adds
    at most two values, so the order of additions cannot matter)."""
    world = len(inputs)
    wire = WIRES.get(settings["compression"])
    scale = settings["compression_scale"]

    def by_node(shares: list[torch.Tensor], cast: torch.dtype | None) -> list[torch.Tensor]:
        """Each node's sum of its ranks' shares, in float32, cast when asked."""
        sums = [sum(shares[n : n + intra][1:], shares[n]) for n in range(0, world, intra)]
        return [v.to(cast).float() if cast else v for v in sums]

    if settings["topk"]:
        # Fresh state: with the momentum correction the first step sends
        # the plain Top-K (u = v = g, and S - m * 0), at the warm-up's
        # first density when there is one.
        density = settings["topk_ratio"]
        if settings["topk_warmup_steps"]:
            density = max(density, 0.25)
        fp16 = settings["topk_fp16"]
        shares = [x / world for x in inputs]
        if intra is None:
            return sparse_sum(shares, density, fp16), True
        nodes = by_node(shares, None)
        chunk = math.ceil(PROBE_LEN / intra)
        starts = range(0, PROBE_LEN, chunk)
        parts = [sparse_sum([v[i : i + chunk] for v in nodes], density, fp16) for i in starts]
        return torch.cat(parts), True
    if wire is None or (settings["compression_inter_only"] and intra is None):
        return torch.stack([x.double() for x in inputs]).sum(0) / world, False
    if intra is None:
        shares = [(x * (scale / world)).to(wire).double() for x in inputs]
        assert all(torch.equal(v, v.round()) for v in shares), "the probe's shares are integers"
        return (torch.stack(shares).sum(0) / scale).float(), True
    if settings["compression_inter_only"]:
        # Node sums exact, then scaled and cast for the step across nodes.
        nodes = [(v * scale).to(wire).float() for v in by_node([x / world for x in inputs], None)]
    else:
        nodes = by_node([(x * (scale / world)).to(wire).float() for x in inputs], wire)
    total = nodes[0] if len(nodes) == 1 else (nodes[0] + nodes[1]).to(wire).float()
    return (total.double() * (1 / scale)).float(), True


def check_probe(device: object, rank: int, world: int, settings: dict, medium: str) -> None:
    """Runs the probe through the device engine and compares it with
    ``probe_reference``; prints ``PROBE <how>``. ``medium`` carries the
    world's bytes (``"tcp"`` or ``"shared memory"``)."""
    two_d = device.two_d
    intra = len(device.two_d_members[0]) if two_d else None
    whole = WIRES.get(settings["compression"]) is not None and not settings["topk"]
    whole = whole and not two_d and not settings["compression_inter_only"]
    inputs = [probe_input(r, world, settings, whole) for r in range(world)]
    ours = inputs[rank].clone()
    before = device.counters()
    device.allreduce(ours.view(torch.uint8), "torch.float32", PROBE_INDEX, True, 0)
    check_probe_counted(before, device.counters(), rank, world, settings, two_d, medium)
    want, exact = probe_reference(inputs, settings, intra)
    if exact:
        if not torch.equal(ours, want):
            diff = (ours.double() - want.double()).abs().max().item()
            raise AssertionError(f"the probe is off its reference by up to {diff}")
        mean = torch.stack([x.double() for x in inputs]).sum(0) / world
        if settings["topk"] or WIRES.get(settings["compression"]) is not None:
            # Sparse or rounded: not the exact average.
            assert int((ours.double() != mean).sum()) > PROBE_LEN // 2, (
                "the probe was not compressed"
            )
    else:
        torch.testing.assert_close(ours.double(), want, rtol=1e-6, atol=1e-8)
    say(f"PROBE {'exact' if exact else 'close'}")


def check_probe_counted(
    before: dict, after: dict, rank: int, world: int, settings: dict, two_d: bool, medium: str
) -> None:
    """The device engine's counters gained the probe's one float32 bucket,
    under the path and codec the settings call for. On the flat path, the
    bytes this rank sent: over TCP the ring's, every shard of the wire copy
    but its own in the reduce-scatter and but the next rank's in the
    allgather; in shared memory the others' parts and its own shard's sums,
    the whole wire copy once."""
    gained = {k: v for k, v in after.items() if v["buckets"] != before.get(k, {}).get("buckets")}
    sparse = settings["topk"]
    path = ("2d" if two_d else "") + ("+topk" if two_d and sparse else "topk" if sparse else "")
    path = path or "ring"
    codec = "none" if sparse else settings["compression"]
    assert list(gained) == [(path, codec)], (path, codec, gained)
    row, old = after[(path, codec)], before.get((path, codec), {"buckets": 0, "bytes_in": 0})
    assert (row["buckets"] - old["buckets"], row["bytes_in"] - old["bytes_in"]) == (
        1,
        PROBE_LEN * 4,
    ), row
    if path == "ring":
        elem = 4 if codec == "none" else 2
        chunk = -(-PROBE_LEN // world)
        shard = [
            (min(PROBE_LEN, (i + 1) * chunk) - min(PROBE_LEN, i * chunk)) * elem
            for i in range(world)
        ]
        want = 2 * PROBE_LEN * elem - shard[rank] - shard[(rank + 1) % world]
        if medium == "shared memory":
            want = PROBE_LEN * elem
        sent = (
            row["wire"]["world"]
            - before.get((path, codec), {"wire": {"world": 0}})["wire"]["world"]
        )
        assert sent == want, (sent, want)
    say("COUNTED probe")


def check_device_collectives(
    engine: object, rank: int, world: int, on: torch.device, findings: Findings
) -> int:
    """torch.distributed's collectives through the device engine
    (``DeviceEngine.collective``) against references computed here from
    every rank's input: small integers, whose sums and quarters are exact
    in every order, so the results must be equal bit for bit. Returns how
    many were equal; what differs goes to ``findings``, and every
    collective runs whatever came before."""
    block = 1027
    sync = torch.cuda.synchronize if on.type == "cuda" else (lambda: None)
    stream = torch.cuda.current_stream(on).cuda_stream if on.type == "cuda" else 0

    def data(r: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([float((i * 7 + r * 5) % 13 - 6) for i in range(world * block)]).to(
            dtype
        )

    issued = equal = 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        total = sum(data(r, dtype).double() for r in range(world))
        mine = slice(rank * block, (rank + 1) * block)
        for collective, reduce, want in (
            ("allreduce", "sum", total),
            ("allreduce", "avg", total / world),
            ("reduce_scatter", "sum", total[mine]),
            ("reduce_scatter", "avg", total[mine] / world),
        ):
            ours = data(rank, dtype).to(on)
            engine.collective(  # type: ignore[attr-defined]
                collective, ours.view(torch.uint8), str(dtype), 100 + issued, reduce, stream
            )
            sync()
            got = ours.cpu().double()
            got = got[mine] if collective == "reduce_scatter" else got
            ok = torch.equal(got, want.to(dtype).double())
            findings.expect(ok, f"{collective} {reduce} of {dtype} differs from its reference")
            issued, equal = issued + 1, equal + ok
        own = torch.zeros(world * block, dtype=dtype)
        own[mine] = data(rank, dtype)[mine]
        ours = own.to(on)
        engine.collective(  # type: ignore[attr-defined]
            "allgather", ours.view(torch.uint8), str(dtype), 100 + issued, "sum", stream
        )
        sync()
        want = torch.cat([data(r, dtype)[r * block : (r + 1) * block] for r in range(world)])
        ok = torch.equal(ours.cpu(), want)
        findings.expect(ok, f"allgather of {dtype} differs from its reference")
        issued, equal = issued + 1, equal + ok
    engine.check()  # type: ignore[attr-defined]
    return equal


def check_counters_agree(host: object, device: object) -> None:
    """Both engines counted the same buckets under the same paths and
    codecs (the bytes they sent may differ: the host engine's world of one
    host is in shared memory, the device engine's on TCP rings)."""

    def buckets(engine: object) -> dict:
        return {
            k: (v["buckets"], v["bytes_in"])
            for k, v in engine.counters().items()  # type: ignore[attr-defined]
            if k[0] != "collective"
        }

    assert buckets(host) == buckets(device), (buckets(host), buckets(device))
    say(f"COUNTED {sum(n for n, _ in buckets(device).values())}")


def run_case(args: argparse.Namespace, launch: dict, case: dict) -> None:
    """One case of ``--cases``, under its own settings and line prefix."""
    global _prefix
    _prefix = f"CASE {case['id']} "
    try:
        config = _config.effective_config()
        check_case(args, config, launch, args.out / case["id"], case["exact"], case["id"])
        say("DONE")
    finally:
        _prefix = ""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--exact", action="store_true", help="bitwise equal on CUDA too")
    parser.add_argument("--cases", type=Path, help="a JSON file of cases to run one after another")
    args = parser.parse_args()
    try:
        config = _config.effective_config()
        launch, arguments = _launch.group_arguments("gloo", config, _launch.launch_env())
        dist.init_process_group(**arguments)
        state.launch = launch
        if args.cases is None:
            check_case(args, config, launch, args.out, args.exact, "")
        else:
            cases = json.loads(args.cases.read_text())
            # A rank that failed waits for peers stuck in a collective to
            # time out and fail in turn.
            failed = run_cases(
                cases, lambda case: run_case(args, launch, case), timeout=config.timeout + 60
            )
            if failed:
                raise RuntimeError(f"cases failed: {', '.join(failed)}")
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except Exception as exc:  # the tests read the WORKER_ERROR line
        exit_failed(exc, linger=3)
        return 3


def check_case(
    args: argparse.Namespace, config: object, launch: dict, out: Path, exact_arg: bool, tag: str
) -> None:
    """One configuration: both engines built for it, every bucket compared.

    A wrong result is recorded and the case goes on with its collectives
    (its peers are in them too); the problems found are raised at the end.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _rendezvous.default_store()
    host = _runtime.world_engine(config)
    device = None
    try:
        if args.device == "cuda":
            gpu = torch.device("cuda", torch.cuda.current_device())
            prefix = _runtime.next_prefix("nccl")
            device = _engines.nccl_engine(config, gpu, rank, world, store, prefix)
        else:
            gpu = torch.device("cpu")
            prefix = f"tiacc_training/device-check/{tag}"
            device = _engine.DeviceEngine(
                config,
                rank,
                world,
                TorchKernels(gpu),
                "tcp",
                board=_rendezvous.FailureBoard(store, prefix),
                local_size=launch["local_size"],
                local_rank=launch["local_rank"],
                store=store,
                prefix=prefix,
                host="127.0.0.1",
            )
            device.connect_store(store, prefix, config.timeout)
        findings = Findings()
        compare_engines(args, config, host, device, gpu, out, exact_arg, findings)
        findings.raise_any()
    finally:
        if device is not None:
            device.shutdown()
        host.shutdown()
        state.set_engine(None)  # the next case builds its own


def compare_engines(
    args: argparse.Namespace,
    config: object,
    host: object,
    device: object,
    on: torch.device,
    out: Path,
    exact_arg: bool,
    findings: Findings,
) -> None:
    """Every bucket through both engines, then the device engine's
    collectives and (on CPU) the probe; what differs goes to ``findings``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = on.type == "cuda"
    channels = NcclChannels(device, on) if cuda else None
    say(f"ENGINE_2D={device.two_d_members}")
    # Under auto each engine measured on its own and may have chosen
    # differently: then their sums are in another order.
    same = host.two_d == device.two_d
    say(f"TWO_D host={host.two_d} device={device.two_d}")
    say(f"AUTO_CHOICE={device.auto_choice}")
    settings = config.to_dict()
    # NCCL's dense sums of two (flat over 2 ranks, or 2D over 2 x 2)
    # are a + b, the host engine's order too.
    pairwise = world == 2 or (device.two_d and world == 4)
    results = {}
    equal = 0
    # The tests make one rank's first bucket wrong with this variable, to
    # check that a failed check keeps the rank in step with its peers; a
    # case may put its own NaN in (an engine error, on every rank).
    wrong_rank = int(os.environ.get("DEVICE_CHECK_WRONG_RANK", "-1"))
    nan_rank = int(os.environ.get("DEVICE_CHECK_NAN_RANK", str(args.nan_rank)))
    for step in range(args.steps):
        for index, (n, dtype) in enumerate(BUCKETS):
            data = bucket_data(rank, step, index, n, dtype)
            if rank == nan_rank and step == 1 and index == 2:
                data[1] = float("nan")
            try:
                if cuda:
                    ours = data.to(on)
                    channels.allreduce(ours, index).wait()
                    torch.cuda.synchronize(on)
                    device.check()
                    ours = ours.cpu()
                else:
                    ours = data.clone()
                    device.allreduce(ours.view(torch.uint8), str(dtype), index, True, 0)
            except Exception:
                finite = all(bool(torch.isfinite(v).all()) for v in results.values())
                say(f"RECEIVED_ONLY_FINITE={finite}")
                raise
            if rank == wrong_rank and step == 0 and index == 0:
                ours[0] += 1  # a wrong result, on purpose
            reference = data.clone()
            host.allreduce(
                reference.data_ptr(),
                reference.numel() * reference.element_size(),
                str(dtype),
                index,
                True,
            )
            # A bucket Top-K sparsifies is summed rank by rank on every
            # rank, bitwise the host engine's sums.
            exact = (not cuda and same) or (
                exact_arg and (pairwise or config.topk_applies(str(dtype), n * data.element_size()))
            )
            found = len(findings.problems)
            if exact:
                if not torch.equal(ours.view(torch.uint8), reference.view(torch.uint8)):
                    diff = (ours.double() - reference.double()).abs().max().item()
                    findings.expect(
                        False,
                        f"step {step} bucket {index} ({n} x {dtype}): the device engine "
                        f"differs from the host engine by up to {diff}",
                    )
            else:
                # Sums in another order differ by the rounding of the
                # partial sums: up to ~12 sigma with 4 ranks, rounded
                # twice, where sigma is the bucket's scale (index + 1);
                # 16 eps leaves some slack over the 12 eps that makes.
                tolerance = 1e-2
                for half in (dtype, WIRES.get(settings["compression"])):
                    if half in (torch.float16, torch.bfloat16):
                        tolerance = max(tolerance, 16 * torch.finfo(half).eps)
                atol = tolerance * (index + 1)
                if not torch.allclose(ours.double(), reference.double(), tolerance, atol):
                    diff = (ours.double() - reference.double()).abs().max().item()
                    findings.expect(
                        False,
                        f"step {step} bucket {index} ({n} x {dtype}): the device engine is off "
                        f"the host engine by up to {diff} (rtol {tolerance:g}, atol {atol:g})",
                    )
            results[f"{step}/{index}"] = ours
            equal += len(findings.problems) == found
    say(f"EQUAL {equal}")
    if same:
        findings.call(lambda: check_counters_agree(host, device))
    say(f"COLLECTIVES {check_device_collectives(device, rank, world, on, findings)}")
    if not cuda:
        # The device engine's TCP groups move to shared memory exactly
        # where the host engine's do (the same set-up, on one host).
        findings.call(lambda: check_probe(device, rank, world, settings, host.transports["world"]))
    out.mkdir(parents=True, exist_ok=True)
    torch.save(results, out / f"device_rank{rank}.pt")


if __name__ == "__main__":
    sys.exit(main())
