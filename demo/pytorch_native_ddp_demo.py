"""End-to-end demo: native DDP training with all three parts of tiacc-training.

A small CNN learns the 10 classes of a generated image dataset with 2 ranks
(torchrun; on a machine with 0, 1 or several GPUs: CPU, both ranks on one
GPU, or one GPU each), using:

1. communication: ``tdist.init_tiacc_training()``, after which the native
   ``DistributedDataParallel`` sends its gradient buckets through the tiacc
   engine;
2. data: ``IndexTFRDataset`` over TFRecord shards packed by ``img2tfrecord``
   (decode, crop, flip and normalise fused in Rust);
3. mixed precision: ``MixedPrecision_TrainingPolicy`` decides each epoch
   whether autocast is on.

Run without arguments it prepares the data (generates a training and a
held-out image folder, lists and packs them with the command-line tools;
reruns reuse what exists), then launches itself with torchrun. Each epoch it
prints the training loss, the held-out accuracy, images/s and what each part
applied. ``--compare`` then runs the same training with stock PyTorch
(``ImageFolder`` over the source JPEGs, native DDP, plain AMP every epoch)
and prints the speed ratio.

    python demo/pytorch_native_ddp_demo.py --workdir data/demo [--compare]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torchvision.transforms as T  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import tiacc_training.torch.distributed as tdist  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


# ---------------------------------------------------------------- data prep
def run_tool(args: list[str]) -> None:
    """Runs a command-line tool as a user would, echoing the command."""
    shown = " ".join(shlex.quote(a) for a in args).replace(sys.executable, "python3")
    print(f"$ {shown}", flush=True)
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)


def prepare_split(work: Path, split: str, per_class: int, seed: int, workers: int) -> None:
    """Generates ``work/<split>_images`` and packs it into ``work/<split>_tfrecord``.

    The training split reuses the layout of ``demo/pack_demo.py`` (``images``,
    ``train_list``, ``train_tfrecord``) so the two demos share one dataset.
    """
    from make_image_folder import make_image_folder

    images = work / ("images" if split == "train" else f"{split}_images")
    listing, packed = work / f"{split}_list", work / f"{split}_tfrecord"
    if (packed / f"{split}.index").exists():
        return
    print(f"== {split}: 10 classes x {per_class} JPEGs in {images}", flush=True)
    make_image_folder(str(images), classes=10, per_class=per_class, seed=seed)
    tool = [sys.executable, "-m"]
    run_tool([*tool, "tiacc_training.tools.general_image_list", "--img_dir", str(images),
              "--img_list", str(listing)])  # fmt: skip
    run_tool([*tool, "tiacc_training.tools.img2tfrecord", "--img_dir", str(images),
              "--img_list", str(listing), "--tfrecords_name", split,
              "--dataset_type", "ImageFold", "--workers", str(workers),
              "--output_dir", str(packed)])  # fmt: skip


# ---------------------------------------------------------------- training
def build_model() -> nn.Module:
    """A small CNN for 64x64 inputs."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]  # fmt: skip

    torch.manual_seed(0)
    return nn.Sequential(
        *block(3, 24), *block(24, 48), *block(48, 96), *block(96, 128),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    )  # fmt: skip


def transforms(size: int) -> tuple[T.Compose, T.Compose]:
    """Training and evaluation transforms (both run fused by IndexTFRDataset)."""
    train = T.Compose([T.RandomResizedCrop(size, scale=(0.3, 1.0)), T.RandomHorizontalFlip(),
                       T.ToTensor(), T.Normalize(MEAN, STD)])  # fmt: skip
    evaluate = T.Compose([T.Resize(size), T.CenterCrop(size), T.ToTensor(), T.Normalize(MEAN, STD)])
    return train, evaluate


def datasets(args: argparse.Namespace) -> tuple[object, object, str]:
    """The training and held-out datasets of the mode, and what was applied."""
    train_tf, eval_tf = transforms(args.image_size)
    work = Path(args.workdir)
    if args.mode == "stock":
        from torchvision.datasets import ImageFolder

        train = ImageFolder(str(work / "images"), train_tf)
        held_out = ImageFolder(str(work / "val_images"), eval_tf)
        return train, held_out, "torchvision ImageFolder + PIL transforms"
    from tiacc_training.torch.tiacc_torch_warp import IndexTFRDataset

    train = IndexTFRDataset(str(work / "train_tfrecord"), "train.index", train_tf)
    held_out = IndexTFRDataset(str(work / "val_tfrecord"), "val.index", eval_tf)
    how = "fused Rust decode+crop+flip+normalise" if train.uses_fused_path else "PIL transforms"
    return train, held_out, f"IndexTFRDataset over TFRecord shards ({how})"


def stock_backend(cuda: bool, local_size: int) -> str:
    """What a stock PyTorch script would pass to init_process_group.

    gloo for the CPU tensors of the metrics; NCCL for CUDA tensors unless
    ranks share a GPU, which NCCL refuses before 2.30 (and without
    NCCL_MULTI_RANK_GPU_ENABLE=1): then gloo for them too.
    """
    if not cuda:
        return "gloo"
    shared = local_size > torch.cuda.device_count()
    nccl_shares = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1" and (
        torch.cuda.nccl.version() >= (2, 30, 0)
    )
    return "cpu:gloo,cuda:" + ("nccl" if not shared or nccl_shares else "gloo")


def all_sum(*values: float) -> list[float]:
    """Sums ``values`` over the ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Held-out accuracy over every rank's share."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in loader:
            logits = model(images.to(device))
            correct += int((logits.argmax(1).cpu() == labels).sum())
            total += len(labels)
    model.train()
    correct, total = all_sum(correct, total)
    return correct / max(total, 1)


def worker(args: argparse.Namespace) -> None:
    """One rank of the training job (launched by torchrun)."""
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ["LOCAL_WORLD_SIZE"])
    # Ranks share the GPUs when there are fewer GPUs than ranks (one GPU,
    # two ranks: both on cuda:0).
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else None
    device = device or torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // local_size))
    if args.mode == "tiacc":
        # The drop-in: the script's own init_process_group below stays as it
        # is. The engine serves the group's CPU collectives and picks the
        # transport of CUDA buckets (NCCL, or TCP through host memory where
        # ranks share a GPU that this NCCL cannot share); its start-up lines
        # say which.
        tdist.init_tiacc_training()
    dist.init_process_group(stock_backend(cuda, local_size))
    rank, world = dist.get_rank(), dist.get_world_size()

    train_set, held_out_set, data_how = datasets(args)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader_kw = {"num_workers": args.workers, "persistent_workers": args.workers > 0}
    train_loader = DataLoader(
        train_set, batch_size=args.batch, sampler=sampler, drop_last=True, **loader_kw
    )
    held_out_loader = DataLoader(
        held_out_set,
        batch_size=128,
        sampler=DistributedSampler(held_out_set, shuffle=False),
        **loader_kw,
    )

    model = nn.parallel.DistributedDataParallel(build_model().to(device))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    from tiacc_training.torch.tiacc_torch_warp import MixedPrecision_TrainingPolicy

    amp_dtype = MixedPrecision_TrainingPolicy.autocast_dtype(device.type)
    # A CPU without native bfloat16 (no AVX512-BF16/AMX) emulates it, an
    # order of magnitude slower than float32: there autocast stays off, in
    # both modes, whatever is asked for.
    fast_low_precision = cuda or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    scaler = torch.amp.GradScaler(device.type, enabled=cuda and amp_dtype == torch.float16)
    if args.mode == "tiacc":
        # Policy 0: fp32 for the first epoch (the steep, sensitive start),
        # mixed precision from then on.
        policy = MixedPrecision_TrainingPolicy(0, start_time=1)
    else:
        policy = None

    if rank == 0:
        comm_how = "native DDP (no comm hook)"
        if args.mode == "tiacc":
            config = tdist.comm_config()
            engine = tdist.get_engine()  # the CPU engine, connected when the model was built
            carried = (
                ", ".join(sorted(set(engine.transports.values()))) if engine else "no CPU engine"
            )
            path = (
                f"CUDA buckets over {tdist.cuda_transport()}"
                if cuda
                else f"CPU buckets over {carried}"
            )
            comm_how = (
                f"tiacc engine: {config['num_streams']} channel(s), "
                f"compression {config['compression']}, {path}, "
                f"fusion {model.bucket_bytes_cap >> 20} MiB"
            )
        mp_how = (
            f"MixedPrecision_TrainingPolicy(policy 0, start 1) -> autocast {amp_dtype}"
            if policy
            else f"plain AMP every epoch ({amp_dtype})"
        )
        if not fast_low_precision:
            mp_how += (
                f"; this CPU has no native {amp_dtype} ({torch.backends.cpu.get_cpu_capability()}):"
                " autocast stays off (emulated, it is far slower than float32)"
            )
        print(f"[{args.mode}] communication: {comm_how}", flush=True)
        print(f"[{args.mode}] data: {data_how}", flush=True)
        print(f"[{args.mode}] mixed precision: {mp_how}", flush=True)

    loss_value = None
    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        if policy is not None:
            lr = opt.param_groups[0]["lr"]
            wanted = policy.enable_mixed_precision(epoch, lr=lr, loss=loss_value, scaler=scaler)
        else:
            wanted = True
        use_amp = wanted and fast_low_precision
        start = time.perf_counter()
        loss_sum, samples = 0.0, 0
        for images, labels in train_loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp):
                loss = nn.functional.cross_entropy(model(images), labels)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            loss_sum += float(loss.detach()) * len(labels)
            samples += len(labels)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        sched.step()
        loss_sum, samples, slowest = all_sum(loss_sum, samples, seconds)
        loss_value = loss_sum / samples
        accuracy = evaluate(model, held_out_loader, device)
        images_per_s = samples / (slowest / world)
        history.append(
            {"epoch": epoch, "loss": loss_value, "accuracy": accuracy,
             "images_per_s": images_per_s, "seconds": seconds, "amp_wanted": wanted,
             "amp": use_amp}
        )  # fmt: skip
        if rank == 0:
            print(
                f"[{args.mode}] epoch {epoch}: loss {loss_value:.4f}  held-out accuracy "
                f"{accuracy:.1%}  {images_per_s:.0f} images/s  "
                f"mixed precision {'on' if wanted else 'off'}"
                f"{'' if wanted == use_amp else ' (autocast off: no native support)'}",
                flush=True,
            )
    if rank == 0:
        print("RESULT " + json.dumps({"mode": args.mode, "epochs": history}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- launcher
def launch(args: argparse.Namespace, mode: str) -> dict:
    """Runs the training with torchrun (2 ranks) and returns rank 0's result.

    ``--standalone``: torchrun's agent binds its rendezvous store on a port
    the kernel picks and the ranks join that store, so no port is chosen
    here (one probed and released could be taken before rank 0 binds it).
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(args.nproc),
        str(Path(__file__).resolve()), "--worker", "--mode", mode,
        "--workdir", args.workdir, "--epochs", str(args.epochs), "--batch", str(args.batch),
        "--lr", str(args.lr), "--image-size", str(args.image_size),
        "--workers", str(args.workers),
    ]  # fmt: skip
    print(f"\n$ {' '.join(cmd).replace(sys.executable, 'python3')}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    result = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
        else:
            print(line, end="", flush=True)
    if proc.wait() != 0 or result is None:
        raise SystemExit(f"{mode} training failed (exit status {proc.returncode})")
    return result


def summarise(results: list[dict]) -> None:
    """Checks that the loss fell and prints the speed comparison."""
    for result in results:
        losses = [e["loss"] for e in result["epochs"]]
        if not losses[-1] < losses[0]:
            raise SystemExit(f"{result['mode']}: the loss did not fall: {losses}")
    print("\n== summary")
    # Epoch 0 includes DataLoader start-up; the steady epochs are the rest.
    speed = {}
    for result in results:
        steady = result["epochs"][1:] or result["epochs"]
        speed[result["mode"]] = sum(e["images_per_s"] for e in steady) / len(steady)
        last = result["epochs"][-1]
        print(
            f"   {result['mode']:<6} final loss {last['loss']:.4f}, held-out accuracy "
            f"{last['accuracy']:.1%}, {speed[result['mode']]:.0f} images/s (epochs 1+)"
        )
    if "stock" in speed and "tiacc" in speed:
        print(f"   speed-up of tiacc over stock PyTorch: {speed['tiacc'] / speed['stock']:.2f}x")


def main() -> int:
    """Prepares the data, runs the training (and the stock one with --compare)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="data/demo", help="where data goes (default data/demo)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--per-class", type=int, default=100, help="training images per class")
    p.add_argument("--compare", action="store_true", help="also run stock PyTorch")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["tiacc", "stock"], default="tiacc", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    workers = min(2, os.cpu_count() or 1)
    prepare_split(work, "train", args.per_class, seed=0, workers=workers)
    prepare_split(work, "val", max(10, args.per_class // 5), seed=1, workers=workers)
    results = [launch(args, "tiacc")]
    if args.compare:
        results.append(launch(args, "stock"))
    summarise(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
