"""Adaptive mixed precision on a real model: throughput and held-out accuracy per run kind.

A torchvision model (``resnet18``, 10 classes, 32x32 images by default) is
trained with SGD (momentum 0.9, cosine learning rate per epoch) on a
generated image-classification task that can be learned: each class is a
fixed smooth colour pattern, and every image is its class's pattern,
shifted, with a random contrast, a weaker pattern of another class on top
and Gaussian noise. The training and held-out sets are fixed by
``--data-seed``; ``--seeds`` varies the weights and the batch order.

Run kinds (each run its own process, one thread; within each seed every
kind runs once, in an order turned by the seed, so a slow spell of the
machine lands on all kinds):

- ``fp32``: no autocast, no GradScaler;
- ``amp_<dtype>``: autocast always on, with a GradScaler (the loop of the
  docs without the policy);
- ``policy<N>_<dtype>``: ``MixedPrecision_TrainingPolicy(N)`` at the
  documented defaults (schedule 1 needs ``hold_time``: 20, the documents'
  example), asked once per epoch exactly as docs/mixed_precision.md shows:
  ``enable_mixed_precision(epoch, lr, loss, scaler=scaler, model=model)``
  with the previous epoch's mean training loss, its answer passed to
  ``torch.autocast(enabled=...)``; before each epoch's evaluation
  ``policy.repair_buffers(model)`` (the per-epoch caller's buffer check),
  and an epoch whose buffers it found non-finite is evaluated in fp32.

On the CPU the dtype is bfloat16 (whether the CPU has native bf16
instructions, ``avx512_bf16`` or ``amx_bf16``, is recorded; without them
autocast emulates bf16 and is slow); with ``--device cuda`` both float16
and bfloat16.

Per run: training images/s over the run (the training loops only), and per
epoch the wall time (training and held-out evaluation), the training time,
the held-out accuracy and loss, whether autocast was on, the GradScaler's
scale and skipped steps; for the policy, every epoch's decision with its
reason from ``policy.stats()``.

``--stress`` adds the stress case: float16 autocast with a GradScaler (on
the CPU ``torch.amp.GradScaler("cpu")``, where this torch has it: probed) on
settings that make float16 overflow, with a smaller torchvision model
(``shufflenet_v2_x0_5``, channels-last: float16 convolutions on a CPU
without native float16 take torch's slow reference path). Candidate
settings are tried first (fp32 and plain fp16 AMP, one seed,
``--stress-probe-epochs``); the first where fp16 AMP fails and fp32 learns
is run in full: fp32, plain fp16 AMP, the policy with each schedule
(float16, the same defaults) and plain bf16 AMP, each seed. Every probe is
kept, and every run records which of the model's buffers (BatchNorm's
running statistics) ended non-finite, and the policy runs how often the
policy restored them. ``--skip-main`` runs the stress case
alone and keeps the main runs of the existing results file (and the other
way: a run without ``--stress`` keeps the file's stress section).

Goals, computed from the runs: the policy's training throughput at least
95% of plain AMP's (mean over seeds); its final held-out accuracy within
0.3 points of fp32's (mean over seeds); in the stress case the policy
finishes on fp32's course where fp16 AMP fails.

    python benches/bench_amp.py [--seeds 3] [--epochs 12] [--stress]
    python benches/plot_amp.py

Writes benches/results/bench_amp.json (every run, the machine, its load).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import REPO, last_result, machine_info, print_result, write_json  # noqa: E402

from tiacc_training.torch.tiacc_torch_warp import MixedPrecision_TrainingPolicy  # noqa: E402

RESULTS = REPO / "benches" / "results" / "bench_amp.json"
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# The documented defaults, per schedule; hold_time has none (required): the
# documents' example value.
POLICY_ARGS: dict[int, dict[str, int]] = {0: {}, 1: {"hold_time": 20}, 2: {}}
ACCURACY_POINTS = 0.3
THROUGHPUT_SHARE = 0.95
# The stress case: "fails" is a mean final accuracy this many points below
# fp32's (or a non-finite held-out loss); "on fp32's course" is within it.
STRESS_MARGIN_POINTS = 5.0

POLICY_CALLED = (
    "once per epoch: enable_mixed_precision(epoch, lr, previous epoch's mean training loss, "
    "scaler=scaler, model=model); repair_buffers(model) before each epoch's evaluation, "
    "which runs in fp32 when it found non-finite buffers"
)

# The task and model of each part; --tiny shrinks both for the unit test.
MAIN = {
    "model": "resnet18",
    "classes": 10,
    "image_size": 32,
    "train_images": 640,
    "heldout_images": 1000,
    "batch": 64,
    "lr": 0.05,
    "noise": 2.2,
    "input_scale": 1.0,
    "channels_last": False,
}
TINY = {"image_size": 16, "train_images": 128, "heldout_images": 128, "batch": 32}
# float16 convolutions on a CPU without native float16 take torch's slow
# reference path (resnet18 trains about 20x slower than in float32), so the
# stress case trains a smaller torchvision model, channels-last (faster there),
# for 12 epochs by default: schedules 0 and 1 start at epoch 10.
STRESS = dict(
    MAIN, model="shufflenet_v2_x0_5", train_images=512, heldout_images=512, channels_last=True
)
STRESS_TINY = {"image_size": 16, "train_images": 64, "heldout_images": 64, "batch": 32}
# What the stress case tries, in order: a learning rate ten times the
# recipe's from the first step, and unnormalised inputs of a large range (the
# first convolution's outputs overflow float16, whose largest value is 65504).
STRESS_CANDIDATES: list[dict[str, Any]] = [
    {"name": "lr_0.5", "lr": 0.5},
    {"name": "input_scale_3e4", "input_scale": 3e4},
]


def cpu_bf16_flags() -> list[str]:
    """The bf16 instruction flags of this CPU (``avx512_bf16``, ``amx_bf16``) in /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    return [f for f in BF16_FLAGS if f in flags]


def make_scaler(device: str) -> Optional[Any]:
    """A GradScaler for ``device``, or None where this torch has none for it (probed)."""
    try:
        return torch.amp.GradScaler(device)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None


def fp16_autocast_works(device: str) -> bool:
    """Whether float16 autocast runs a convolution on ``device`` (probed)."""
    try:
        with torch.autocast(device, dtype=torch.float16):
            out = F.conv2d(
                torch.ones(1, 1, 3, 3, device=device), torch.ones(1, 1, 2, 2, device=device)
            )
    except (RuntimeError, ValueError):
        return False
    return out.dtype == torch.float16


def make_data(
    task: dict[str, Any], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training and held-out sets of ``task``, fixed by ``seed``.

    Each class is a smooth pattern (a 4x4 colour grid drawn up to the image
    size). An image is its class's pattern rolled by up to an eighth of the
    image each way, times a contrast in [0.5, 1.5], plus another class's
    pattern at 0.6 times the weight and noise of standard deviation
    ``task["noise"]``; all times ``task["input_scale"]``.

    Returns:
        Training images and labels, held-out images and labels.
    """
    g = torch.Generator().manual_seed(seed)
    size, classes = task["image_size"], task["classes"]
    grid = torch.randn(classes, 3, 4, 4, generator=g)
    patterns = F.interpolate(grid, size=(size, size), mode="bicubic", align_corners=False)
    patterns = patterns / patterns.flatten(1).std(dim=1).view(-1, 1, 1, 1)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, classes, (n,), generator=g)
        other = (labels + torch.randint(1, classes, (n,), generator=g)) % classes
        contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=g)
        images = contrast * patterns[labels] + 0.6 * contrast * patterns[other]
        shift = max(1, size // 8)
        moves = torch.randint(-shift, shift + 1, (n, 2), generator=g)
        for i in range(n):
            images[i] = torch.roll(images[i], (int(moves[i, 0]), int(moves[i, 1])), dims=(1, 2))
        images = images + task["noise"] * torch.randn(images.shape, generator=g)
        return images * task["input_scale"], labels

    train = draw(task["train_images"])
    heldout = draw(task["heldout_images"])
    return train[0], train[1], heldout[0], heldout[1]


def _num(value: float, digits: int = 5) -> Any:
    """A finite float rounded, else its name (``"nan"``, ``"inf"``): strict JSON."""
    return round(value, digits) if math.isfinite(value) else str(value)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def evaluate(
    model: torch.nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    batch: int,
    device: str,
    dtype: torch.dtype,
    autocast: bool,
) -> tuple[float, float]:
    """Held-out accuracy and mean loss, under autocast when the epoch trained under it."""
    model.eval()
    correct, total_loss = 0, 0.0
    with torch.no_grad():
        for start in range(0, len(images), batch):
            x, y = images[start : start + batch], labels[start : start + batch]
            with torch.autocast(device, dtype=dtype, enabled=autocast):
                out = model(x)
            total_loss += float(F.cross_entropy(out.float(), y, reduction="sum"))
            correct += int((out.argmax(dim=1) == y).sum())
    model.train()
    return correct / len(images), total_loss / len(images)


def train_run(spec: dict[str, Any]) -> dict[str, Any]:
    """One run of ``spec`` (kind, seed, task, epochs, device) in this process.

    Returns:
        The run's record: per-epoch figures, throughput and, for the
        policy, its decisions from ``stats()``.
    """
    task, device, kind = spec["task"], spec["device"], spec["kind"]
    torch.set_num_threads(spec["threads"])
    train_x, train_y, test_x, test_y = make_data(task, spec["data_seed"])
    memory = torch.channels_last if task["channels_last"] else torch.contiguous_format
    train_x, test_x = (t.to(device).contiguous(memory_format=memory) for t in (train_x, test_x))
    train_y, test_y = train_y.to(device), test_y.to(device)
    torch.manual_seed(spec["seed"])
    order_gen = torch.Generator().manual_seed(spec["seed"])
    model = getattr(torchvision.models, task["model"])(num_classes=task["classes"])
    model = model.to(device, memory_format=memory)
    optimizer = torch.optim.SGD(model.parameters(), lr=task["lr"], momentum=0.9, weight_decay=5e-4)
    epochs = spec["epochs"]
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)

    mixed = kind != "fp32"
    dtype = DTYPES[spec["dtype"]] if mixed else torch.float32
    scaler = make_scaler(device) if mixed else None
    policy = None
    if kind.startswith("policy"):
        number = int(kind[len("policy")])
        policy = MixedPrecision_TrainingPolicy(number, **POLICY_ARGS[number])

    record: dict[str, Any] = {
        "kind": kind,
        "seed": spec["seed"],
        "dtype": spec["dtype"] if mixed else "fp32",
        "grad_scaler": scaler is not None,
        "load_1min_at_start": round(os.getloadavg()[0], 2),
        "epochs": [],
    }
    count_skips = device == "cpu"
    loss = None  # the previous epoch's mean training loss, as the policy's docs ask
    train_seconds = 0.0
    run_start = time.perf_counter()
    for epoch in range(epochs):
        epoch_start = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        if policy is not None:
            on = policy.enable_mixed_precision(epoch, lr, loss, scaler=scaler, model=model)
        else:
            on = mixed
        order = torch.randperm(len(train_x), generator=order_gen).to(device)
        sum_loss, steps, skipped = torch.zeros((), device=device), 0, 0
        for start in range(0, len(train_x) - task["batch"] + 1, task["batch"]):
            index = order[start : start + task["batch"]]
            x, y = train_x[index], train_y[index]
            optimizer.zero_grad()
            with torch.autocast(device, dtype=dtype, enabled=on):
                step_loss = F.cross_entropy(model(x), y)
            if scaler is not None:
                # A skipped (overflowed) step lowers the scale; reading it is a
                # synchronisation on CUDA, so only the CPU counts them.
                before = scaler.get_scale() if count_skips else 0.0
                scaler.scale(step_loss).backward()
                scaler.step(optimizer)
                scaler.update()
                skipped += count_skips and scaler.get_scale() < before
            else:
                step_loss.backward()
                optimizer.step()
            sum_loss += step_loss.detach().float()
            steps += 1
        _sync(device)
        train_s = time.perf_counter() - epoch_start
        train_seconds += train_s
        loss = float(sum_loss) / steps
        schedule.step()
        # Called once per epoch, the policy checks the buffers here, before
        # the evaluation reads them; an epoch that overflowed is evaluated in
        # fp32 (under autocast its evaluation would overflow too).
        restored = policy.repair_buffers(model) if policy is not None else []
        eval_autocast = on and not restored
        accuracy, heldout_loss = evaluate(
            model, test_x, test_y, task["batch"] * 4, device, dtype, eval_autocast
        )
        _sync(device)
        record["epochs"].append(
            {
                "epoch": epoch,
                "autocast": bool(on),
                "eval_autocast": bool(eval_autocast),
                "nonfinite_buffers_repaired": len(restored),
                "lr": _num(lr, 6),
                "train_loss": _num(loss),
                "heldout_accuracy": round(accuracy, 5),
                "heldout_loss": _num(heldout_loss),
                "train_s": round(train_s, 3),
                "wall_s": round(time.perf_counter() - epoch_start, 3),
                "skipped_steps": skipped if count_skips else None,
                "scale": scaler.get_scale() if scaler is not None else None,
            }
        )
    last = record["epochs"][-1]
    record.update(
        {
            "train_images_per_s": round(steps * task["batch"] * epochs / train_seconds, 2),
            "wall_s": round(time.perf_counter() - run_start, 3),
            "final_heldout_accuracy": last["heldout_accuracy"],
            "final_heldout_loss": last["heldout_loss"],
            "epochs_autocast_on": [e["epoch"] for e in record["epochs"] if e["autocast"]],
            # BatchNorm's running statistics are updated by every forward pass,
            # skipped steps included: a non-finite one stays for good.
            "nonfinite_buffers": [
                name for name, b in model.named_buffers() if not torch.isfinite(b).all()
            ],
        }
    )
    if policy is not None:
        stats = policy.stats()
        record["policy"] = {
            "repr": repr(policy),
            "schedule": stats["schedule"],
            "settings": stats["settings"],
            "epochs_on": stats["epochs_on"],
            "epochs_off": stats["epochs_off"],
            "guard_trips": stats["guard_trips"],
            "buffer_restores": stats["buffer_restores"],
            "buffer_log": [
                {k: len(v) if k == "buffers" else v for k, v in entry.items()}
                for entry in stats["buffer_log"]
            ],
            "autocast_dtype_it_recommends": str(policy.autocast_dtype(device)).split(".")[-1],
            "decisions": [
                {k: e[k] for k in ("epoch", "autocast", "reason", "detail")}
                for e in stats["epochs"]
            ],
            "changes": [e["message"] for e in stats["change_log"]],
        }
    return record


def run_in_process(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs ``spec`` in a fresh process (one thread on the CPU) and returns its record."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIACC_TRAINING_")}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(spec["threads"])})
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    result = last_result(done.stdout)
    if done.returncode != 0 or result is None:
        raise SystemExit(
            f"{spec['kind']} seed {spec['seed']} failed (exit {done.returncode}):\n"
            + done.stderr[-3000:]
        )
    return result


def run_kinds(
    kinds: list[tuple[str, str]], base: dict[str, Any], seeds: int, label: str
) -> list[dict[str, Any]]:
    """Every (kind, dtype) once per seed, the order turned by one kind per seed."""
    runs = []
    for seed in range(seeds):
        turn = seed % len(kinds)
        for kind, dtype in kinds[turn:] + kinds[:turn]:
            record = run_in_process(dict(base, kind=kind, dtype=dtype, seed=seed))
            runs.append(record)
            print(
                f"{label} seed {seed} {record_name(record)}: "
                f"{record['train_images_per_s']:.1f} images/s, "
                f"held-out accuracy {record['final_heldout_accuracy']:.3f}, "
                f"autocast on in epochs {record['epochs_autocast_on']}",
                flush=True,
            )
    return runs


def record_name(record: dict[str, Any]) -> str:
    """The run kind's name: ``fp32``, ``amp_bf16``, ``policy0_fp16``..."""
    return "fp32" if record["kind"] == "fp32" else f"{record['kind']}_{record['dtype']}"


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per run kind, over seeds: throughput, final accuracy and loss, epochs on."""
    names = list(dict.fromkeys(record_name(r) for r in runs))
    table = {}
    for name in names:
        mine = [r for r in runs if record_name(r) == name]
        rates = [r["train_images_per_s"] for r in mine]
        accuracy = [r["final_heldout_accuracy"] for r in mine]
        losses = [r["final_heldout_loss"] for r in mine]
        table[name] = {
            "seeds": len(mine),
            "train_images_per_s_mean": round(_mean(rates), 2),
            "train_images_per_s_min": min(rates),
            "train_images_per_s_max": max(rates),
            "final_heldout_accuracy_mean": round(_mean(accuracy), 5),
            "final_heldout_accuracy_per_seed": accuracy,
            "final_heldout_loss_per_seed": losses,
            "wall_s_mean": round(_mean([r["wall_s"] for r in mine]), 2),
            "epochs_autocast_on_per_seed": [r["epochs_autocast_on"] for r in mine],
        }
    return table


def main_goals(table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The goals of the main runs, computed: throughput against AMP, accuracy against fp32."""
    goals: dict[str, Any] = {
        "criteria": (
            f"policy train images/s >= {THROUGHPUT_SHARE:.0%} of plain AMP's of the same dtype "
            f"(means over seeds); policy final held-out accuracy within {ACCURACY_POINTS} "
            "points of fp32's (means over seeds)"
        ),
    }
    for name, row in table.items():
        if not name.startswith("policy"):
            continue
        amp = table.get(f"amp_{name.split('_', 1)[1]}")
        share = row["train_images_per_s_mean"] / amp["train_images_per_s_mean"] if amp else None
        points = points_from_fp32(table, name)
        goals[name] = {
            "throughput_over_amp": round(share, 4) if share is not None else None,
            "throughput_goal_met": share is not None and share >= THROUGHPUT_SHARE,
            "accuracy_minus_fp32_points": round(points, 3),
            # Within, the bound included (float sums may land a hair past it).
            "accuracy_goal_met": abs(points) <= ACCURACY_POINTS + 1e-9,
        }
    for name in table:
        if name.startswith("amp"):
            goals[f"{name}_accuracy_minus_fp32_points"] = round(points_from_fp32(table, name), 3)
    return goals


def points_from_fp32(table: dict[str, dict[str, Any]], name: str) -> float:
    """``name``'s mean final held-out accuracy minus fp32's, in points (per-seed values)."""
    mine = _mean(table[name]["final_heldout_accuracy_per_seed"])
    return (mine - _mean(table["fp32"]["final_heldout_accuracy_per_seed"])) * 100


def _fails(records: list[dict[str, Any]], fp32_accuracy: float) -> bool:
    """Whether runs end far below fp32 (``STRESS_MARGIN_POINTS``) or with a non-finite loss."""
    accuracy = _mean([r["final_heldout_accuracy"] for r in records])
    finite = all(isinstance(r["final_heldout_loss"], float) for r in records)
    return not finite or (fp32_accuracy - accuracy) * 100 > STRESS_MARGIN_POINTS


def stress_part(args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    """Probes the stress candidates, then runs the first where fp16 AMP fails in full."""
    device = args.device
    scaler = make_scaler(device)
    part: dict[str, Any] = {
        "grad_scaler_available": scaler is not None,
        "fp16_autocast_available": fp16_autocast_works(device),
        "margin_points": STRESS_MARGIN_POINTS,
        "probes": [],
    }
    if scaler is None or not part["fp16_autocast_available"]:
        part["note"] = f"no float16 autocast with a GradScaler on {device} in this torch"
        print(f"stress: {part['note']}", flush=True)
        return part
    task = dict(STRESS, **(STRESS_TINY if args.tiny else {}))
    chosen = None
    for candidate in STRESS_CANDIDATES:
        settings = {k: v for k, v in candidate.items() if k != "name"}
        probe_base = dict(base, task=dict(task, **settings), epochs=args.stress_probe_epochs)
        runs = run_kinds([("fp32", "fp32"), ("amp", "fp16")], probe_base, 1, candidate["name"])
        by_kind = {record_name(r): r for r in runs}
        fp32_accuracy = by_kind["fp32"]["final_heldout_accuracy"]
        fp32_learns = fp32_accuracy > 1.5 / task["classes"] and not _fails(
            [by_kind["fp32"]], fp32_accuracy
        )
        amp_fails = _fails([by_kind["amp_fp16"]], fp32_accuracy)
        part["probes"].append(
            {
                "candidate": candidate,
                "epochs": args.stress_probe_epochs,
                "fp32_learns": fp32_learns,
                "fp16_amp_fails": amp_fails,
                "runs": runs,
            }
        )
        if fp32_learns and amp_fails:
            chosen = candidate
            break
    if chosen is None:
        part["note"] = "no candidate made fp16 AMP fail while fp32 learned"
        print(f"stress: {part['note']}", flush=True)
        return part
    settings = {k: v for k, v in chosen.items() if k != "name"}
    full = dict(base, task=dict(task, **settings), epochs=args.stress_epochs)
    kinds = [("fp32", "fp32"), ("amp", "fp16")]
    kinds += [(f"policy{n}", "fp16") for n in POLICY_ARGS] + [("amp", "bf16")]
    runs = run_kinds(kinds, full, args.seeds, f"stress {chosen['name']}")
    table = summarise(runs)
    fp32_accuracy = table["fp32"]["final_heldout_accuracy_mean"]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for record in runs:
        by_name.setdefault(record_name(record), []).append(record)
    verdicts = {
        name: {
            "fails": _fails(records, fp32_accuracy),
            "accuracy_minus_fp32_points": round(points_from_fp32(table, name), 3),
            "autocast_ever_on": any(r["epochs_autocast_on"] for r in records),
            "final_train_loss_per_seed": [r["epochs"][-1]["train_loss"] for r in records],
            "nonfinite_buffers_per_seed": [len(r["nonfinite_buffers"]) for r in records],
            "guard_trips_per_seed": [r["policy"]["guard_trips"] for r in records if "policy" in r],
            "buffer_restores_per_seed": [
                r["policy"].get("buffer_restores") for r in records if "policy" in r
            ],
        }
        for name, records in by_name.items()
    }
    amp_fails = verdicts["amp_fp16"]["fails"]
    goal: dict[str, Any] = {
        "criteria": (
            "fp16 AMP fails (mean final accuracy more than "
            f"{STRESS_MARGIN_POINTS} points below fp32's, or a non-finite held-out "
            "loss) and the policy does not; a policy that never turned autocast on "
            "did not meet the overflow (its finish says nothing about the guard)"
        ),
        "fp16_amp_fails": amp_fails,
        "bf16_amp_fails": verdicts["amp_bf16"]["fails"],
    }
    for name, verdict in verdicts.items():
        if name.startswith("policy"):
            goal[f"{name}_finishes_where_fp16_amp_fails"] = amp_fails and not verdict["fails"]
            goal[f"{name}_met_the_overflow"] = verdict["autocast_ever_on"]
    part.update(
        {
            "chosen": chosen,
            "task": full["task"],
            "epochs": args.stress_epochs,
            "policy_called": POLICY_CALLED,
            "runs": runs,
            "summary": table,
            "verdicts": verdicts,
            "goal": goal,
        }
    )
    return part


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--data-seed", type=int, default=1234)
    parser.add_argument(
        "--dtypes",
        default="",
        help="comma-separated: bf16,fp16 (default: bf16 on cpu, both on cuda)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny images and sets (the unit test)")
    parser.add_argument("--stress", action="store_true", help="also run the stress case")
    parser.add_argument("--skip-main", action="store_true", help="only the stress case")
    parser.add_argument("--stress-epochs", type=int, default=12)
    parser.add_argument("--stress-probe-epochs", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not names:
        names = ["bf16"] if args.device == "cpu" else ["fp16", "bf16"]
    if any(d not in DTYPES for d in names):
        parser.error(f"--dtypes takes {', '.join(DTYPES)}")
    args.dtype_list = names
    return args


def main(argv: Optional[list[str]] = None) -> None:
    """Runs the parts asked for and writes the results file."""
    args = parse_args(argv)
    if args.worker:
        print_result(train_run(json.loads(args.worker)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    flags = cpu_bf16_flags()
    if args.device == "cpu" and not flags:
        print(
            "this CPU has no bf16 instructions (avx512_bf16, amx_bf16): "
            "bf16 autocast is emulated and slow",
            flush=True,
        )
    base = {
        "device": args.device,
        "threads": 1,
        "data_seed": args.data_seed,
        "epochs": args.epochs,
        "task": dict(MAIN, **(TINY if args.tiny else {})),
    }
    load_before = os.getloadavg()
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    out: dict[str, Any] = {
        "benchmark": "bench_amp",
        "device": args.device,
        "tiny": args.tiny,
        "cpu_bf16_instructions": flags,
        "cpu_bf16_note": (
            f"native bf16 instructions: {', '.join(flags)}"
            if flags
            else "no bf16 instructions (avx512_bf16, amx_bf16): bf16 autocast is emulated"
        ),
        "policy_args": {f"policy{n}": a for n, a in POLICY_ARGS.items()},
        "policy_called": POLICY_CALLED,
    }
    if args.skip_main:
        for key in ("setup", "runs", "machine", "load", "policy_called"):
            if key in previous:
                out[key] = previous[key]
        if previous.get("runs"):  # the summary and goals as this version computes them
            out["summary"] = summarise(previous["runs"])
            out["goals"] = main_goals(out["summary"])
    else:
        kinds = [("fp32", "fp32")]
        for dtype in args.dtype_list:
            kinds += [("amp", dtype)] + [(f"policy{n}", dtype) for n in POLICY_ARGS]
        runs = run_kinds(kinds, base, args.seeds, "main")
        table = summarise(runs)
        out.update(
            {
                "setup": {
                    "task": base["task"],
                    "epochs": args.epochs,
                    "seeds": args.seeds,
                    "data_seed": args.data_seed,
                    "threads": 1,
                    "optimizer": "SGD momentum 0.9, weight decay 5e-4, cosine lr per epoch",
                },
                "runs": runs,
                "summary": table,
                "goals": main_goals(table),
            }
        )
    if args.stress:
        out["stress"] = stress_part(args, base)
    elif "stress" in previous:
        out["stress"] = previous["stress"]
    load_after = os.getloadavg()
    if not args.skip_main:
        out["machine"] = machine_info(["torchvision"])
        out["load"] = load_note(load_before, load_after)
    if args.stress:
        out["stress"]["machine"] = machine_info(["torchvision"])
        out["stress"]["load"] = load_note(load_before, load_after)
    write_json(args.out, out)
    for name, row in out.get("summary", {}).items():
        print(
            f"{name:>14}: {row['train_images_per_s_mean']:8.1f} images/s, "
            f"final held-out accuracy {row['final_heldout_accuracy_mean']:.4f}"
        )
    print(f"wrote {args.out}")


def load_note(before: tuple[float, float, float], after: tuple[float, float, float]) -> dict:
    """The load averages around the runs, and whether the machine was shared."""
    cores = os.cpu_count() or 1
    loaded = max(before[0], after[0]) > 1.0 + 0.25 * cores
    return {
        "load_average_before": [round(x, 2) for x in before],
        "load_average_after": [round(x, 2) for x in after],
        "cores": cores,
        "loaded": loaded,
        "note": (
            "the machine was loaded by other jobs while the runs ran (each run uses one "
            "thread): timings are noisy, compare kinds within a seed"
            if loaded
            else "the machine was otherwise idle"
        ),
    }


if __name__ == "__main__":
    main()
