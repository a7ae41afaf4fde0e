"""One rank of the DDP benchmarks (launched by bench_ddp.py, bench_nccl.py and bench_scaling.py).

Trains one of the models of :func:`build_model` (``--model``) with
DistributedDataParallel, natively or through the tiacc engine, or without
DDP at all (``--mode none``: the same model, batch and optimizer with no
gradient communication; the process group only serves the barriers around
the timed steps), and prints the per-step wall times of rank 0 as JSON,
with the part of each step up to the end of the forward pass (the loss
computed). On ``--device cpu`` native runs use gloo; on ``--device cuda``
(every rank on ``cuda:LOCAL_RANK % device_count``) native runs use NCCL.
Native runs may register one of torch's own communication hooks
(``--hook``). The optimizer is SGD or AdamW (``--optimizer``). Rank 0 also
reads its node's link counters around the timed steps, which gives the
bytes that crossed between the nodes per step, in each direction.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _machine import print_result
from _models import conv_classifier
from torch import nn

MODELS = ("mlp", "dominant", "tiny")
# Our own causal transformer language model (:class:`CausalLM`).
LANGUAGE_MODELS = ("lm",)
# torchvision's models, trained on random images of --image-size pixels.
VISION_MODELS = {
    "resnet18": "resnet18",
    "resnet50": "resnet50",
    "resnext50": "resnext50_32x4d",
}
SMALL_PARAM_BYTES = 4096


class _Residual(nn.Module):
    """``x + relu(linear(norm(x)))``: one narrow block of the tiny model."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(self.norm(x)))


class CausalLM(nn.Module):
    """A small GPT-style language model whose forward returns its loss.

    Token and learned position embeddings, ``layers`` pre-norm transformer
    blocks (causal self-attention, GELU feed-forward, no dropout), a final
    LayerNorm and an untied output head without bias. The input holds
    ``seq + 1`` token ids per sequence: the first ``seq`` are read, and
    each position predicts the id that follows it.
    """

    def __init__(
        self,
        vocab: int = 8192,
        seq: int = 64,
        d_model: int = 512,
        heads: int = 8,
        ff: int = 2048,
        layers: int = 6,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model,
                heads,
                dim_feedforward=ff,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy of ``ids`` (batch x (seq + 1)), a scalar."""
        inputs, targets = ids[:, :-1], ids[:, 1:]
        seq = inputs.shape[1]
        positions = torch.arange(seq, device=ids.device)
        h = self.tokens(inputs) + self.positions(positions)
        # Made here rather than kept as a buffer: DDP would send a buffer
        # to every rank before each forward, which is traffic on the link.
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=ids.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _token_batch(batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Random token ids, batch x (seq + 1), the same on every call (their own seed)."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (batch, seq + 1), generator=generator)


def build_model(
    name: str, batch: int, layers: int = 4, width: int = 1024, image_size: int = 64
) -> tuple[nn.Module, torch.Tensor, str]:
    """The model, one input batch for it, and a one-line description.

    - ``mlp``: ``layers`` x Linear(width, width) + ReLU (4 x 1024: 16.8 MB
      of float32 gradients in 8 equal-sized pairs of tensors);
    - ``dominant``: three stride-2 Conv2d on 32x32 RGB images, then Linear
      1024 -> 3072 -> 512 -> 256 -> 10; the 1024 x 3072 layer holds about
      65% of the 19.5 MB of gradients, so DDP forms few, large buckets;
    - ``tiny``: Linear 1024 -> 1024 -> 24 (the bulk, 4.3 MB), then 60
      residual blocks of LayerNorm(24) + Linear(24, 24) and a Linear(24, 10)
      head: 243 of its 246 parameter tensors are under 4 KB, so the cost per
      parameter and per bucket shows.

    - ``resnet18``, ``resnet50``, ``resnext50`` (32x4d): torchvision's
      models (1000 classes), on random RGB images of ``image_size`` pixels.
    - ``lm``: :class:`CausalLM`, 6 pre-norm transformer layers (d_model
      512, 8 heads, feed-forward 2048), vocabulary 8192, 64 tokens a
      sequence, untied head: 27.3 M parameters, 109.3 MB of float32
      gradients. Its input is random token ids and its output the loss.

    ``layers`` and ``width`` apply to ``mlp`` only.
    """
    if name == "lm":
        model = CausalLM()
        description = (
            "causal transformer LM: 6 pre-norm layers, d_model 512, 8 heads, FF 2048, "
            "vocab 8192, 64 tokens, learned positions, untied head"
        )
        return model, _token_batch(batch, seq=64, vocab=8192), description
    if name in VISION_MODELS:
        import torchvision  # optional: only the benchmarks of real models need it

        model = getattr(torchvision.models, VISION_MODELS[name])()
        x = torch.randn(batch, 3, image_size, image_size)
        return model, x, f"torchvision {VISION_MODELS[name]} on {image_size}x{image_size} images"
    if name == "mlp":
        stack: list[nn.Module] = []
        for _ in range(layers):
            stack += [nn.Linear(width, width), nn.ReLU()]
        return (
            nn.Sequential(*stack),
            torch.randn(batch, width),
            f"{layers} x Linear({width}, {width}) + ReLU",
        )
    if name == "dominant":
        model = conv_classifier(3, [(16, 2), (32, 2), (64, 2)], [64 * 4 * 4, 3072, 512, 256, 10])
        description = (
            "Conv2d 3->16->32->64 (3x3, stride 2) on 32x32 images, "
            "Linear 1024->3072->512->256->10, ReLU"
        )
        return model, torch.randn(batch, 3, 32, 32), description
    if name == "tiny":
        blocks, narrow = 60, 24
        model = nn.Sequential(
            nn.Linear(1024, 1024),
            nn.ReLU(),
            nn.Linear(1024, narrow),
            *[_Residual(narrow) for _ in range(blocks)],
            nn.Linear(narrow, 10),
        )
        description = (
            f"Linear 1024->1024->{narrow}, {blocks} x (x + ReLU(Linear({narrow}, {narrow})"
            f"(LayerNorm({narrow})(x)))), Linear({narrow}, 10)"
        )
        return model, torch.randn(batch, 1024), description
    known = MODELS + LANGUAGE_MODELS + tuple(VISION_MODELS)
    raise ValueError(f"unknown model {name!r}: expected one of {known}")


def model_stats(model: nn.Module) -> dict:
    """Gradient bytes, parameter counts, small tensors and the largest layer."""
    params = list(model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    layers = [
        (name, sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)))
        for name, m in model.named_modules()
        if any(True for _ in m.parameters(recurse=False))
    ]
    largest_name, largest_bytes = max(layers, key=lambda x: x[1])
    largest = dict(model.named_modules())[largest_name]
    return {
        "grad_bytes": grad_bytes,
        "parameter_tensors": len(params),
        "parameter_elements": sum(p.numel() for p in params),
        "params_under_4kb": sum(p.numel() * p.element_size() < SMALL_PARAM_BYTES for p in params),
        "layers_with_parameters": len(layers),
        "largest_layer": f"{largest_name}: {largest}",
        "largest_layer_bytes": largest_bytes,
        "largest_layer_share": round(largest_bytes / grad_bytes, 4),
    }


def link_counters() -> tuple[int, int]:
    """Bytes this node's end of the link has sent and received so far: ``(tx, rx)``.

    Read from ``/proc/net/dev``, which shows the reading process's network
    namespace however the process entered it.
    """
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    with open("/proc/net/dev", encoding="ascii") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == ifname:
                fields = counters.split()
                return int(fields[8]), int(fields[0])
    raise RuntimeError(f"{ifname} is not in /proc/net/dev")


def machine_cpu() -> tuple[int, int]:
    """The machine's CPU time so far in clock ticks: ``(busy, total)``.

    From the first line of ``/proc/stat`` (every core, every process and
    the kernel's own work, such as the network stack's softirqs); idle and
    I/O wait are the time not busy.
    """
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return sum(ticks) - idle, sum(ticks)


def thread_cpu() -> dict[str, float]:
    """This process's CPU seconds so far per thread group: the engine's
    threads (named ``tiacc-*``), gloo's and everything else (the Python
    thread's forward, backward and DDP, torch's own threads).

    From ``/proc/self/task/*/stat`` (user plus system time of each thread
    alive now; a thread that ended is not counted).
    """
    tick = os.sysconf("SC_CLK_TCK")
    groups = {"engine": 0.0, "gloo": 0.0, "other": 0.0}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick
        group = "engine" if name.startswith("tiacc") else "gloo" if "gloo" in name else "other"
        groups[group] += seconds
    return groups


def step_loss(output: torch.Tensor) -> torch.Tensor:
    """The loss of one step: the output itself when the model returns a scalar (``lm``).

    Otherwise the mean square of the output, a stand-in loss that reaches
    every output element.
    """
    return output if output.dim() == 0 else output.square().mean()


def build_optimizer(name: str, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD (lr 1e-3) or AdamW (lr 1e-4, weight decay 0.01)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    return torch.optim.SGD(params, lr=1e-3)


def register_torch_hook(ddp: nn.parallel.DistributedDataParallel, hook: str) -> None:
    """One of torch's built-in communication hooks, as a user would."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if hook == "noop":
        # No communication at all: each rank keeps its own gradients. What
        # is left is DDP's own work per step (bucket copies, hook calls).
        def no_communication(state: object, bucket: object) -> torch.futures.Future:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(bucket.buffer())  # type: ignore[attr-defined]
            return future

        # DDP checks the annotations as objects (this module's are strings).
        no_communication.__annotations__ = {
            "state": object,
            "bucket": torch.distributed.GradBucket,
            "return": torch.futures.Future[torch.Tensor],
        }
        ddp.register_comm_hook(None, no_communication)
    elif hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        # Compression from the third step on, so every timed step uses it.
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["native", "tiacc", "none"], required=True)
    parser.add_argument(
        "--model", choices=MODELS + LANGUAGE_MODELS + tuple(VISION_MODELS), default="mlp"
    )
    parser.add_argument("--image-size", type=int, default=64, help="torchvision models only")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=4, help="mlp only")
    parser.add_argument("--width", type=int, default=1024, help="mlp only")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    hooks = ["none", "noop", "fp16", "bf16", "powersgd"]
    parser.add_argument("--hook", choices=hooks, default="none")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument(
        "--sync",
        action="store_true",
        help="--mode none: a 4-byte allreduce after each backward (the ranks wait for "
        "each other every step, as DDP's do, with no gradient exchanged)",
    )
    parser.add_argument(
        "--grad-view",
        action="store_true",
        help="DDP(gradient_as_bucket_view=True): gradients live in the buckets (no copy in or out)",
    )
    args = parser.parse_args()

    cuda = args.device == "cuda"
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if args.mode == "tiacc":
        import tiacc_training.torch.distributed as tdist

        tdist.init_tiacc_training()
    else:
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model, x, _ = build_model(args.model, args.batch, args.layers, args.width, args.image_size)
    model = model.to(device)
    x = x.to(device)
    if args.mode == "none":
        # The compute floor: no DDP, so no gradient leaves the rank.
        ddp: nn.Module = model
    else:
        # PowerSGD chains allreduces inside future callbacks, whose order
        # gloo does not keep the same on every rank once there are several
        # buckets (ranks then abort on mismatched messages): it gets a
        # single bucket.
        bucket_cap_mb = 64 if args.hook == "powersgd" and not cuda else None
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=args.grad_view
        )
        if args.hook != "none":
            register_torch_hook(ddp, args.hook)
    opt = build_optimizer(args.optimizer, ddp.parameters())
    times = []
    forward_times = []
    cpu_start = 0.0
    link_start = (0, 0)
    machine_start = (0, 0)
    threads_start: dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu_start = usage.ru_utime + usage.ru_stime
            link_start = link_counters()
            machine_start = machine_cpu()
            threads_start = thread_cpu()
        start = time.perf_counter()
        opt.zero_grad()
        loss = step_loss(ddp(x))
        if cuda:
            torch.cuda.synchronize(device)
        forward_end = time.perf_counter()
        loss.backward()
        if args.sync:
            dist.all_reduce(torch.zeros(1, device=device))
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            forward_times.append(forward_end - start)
    # Every rank's last step is done when the barrier returns; the counters
    # then hold exactly the timed steps' traffic (plus one barrier's).
    dist.barrier()
    tx_end, rx_end = link_counters()
    busy_end, total_end = machine_cpu()
    threads_end = thread_cpu()
    threads_per_step = {
        k: (threads_end[k] - threads_start.get(k, 0.0)) / args.steps for k in threads_end
    }
    machine_busy = (busy_end - machine_start[0]) / max(1, total_end - machine_start[1])
    tx_per_step = (tx_end - link_start[0]) / args.steps
    rx_per_step = (rx_end - link_start[1]) / args.steps
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_per_step = (usage.ru_utime + usage.ru_stime - cpu_start) / args.steps
    stats = model_stats(model)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    if dist.get_rank() == 0:
        print_result(
            {
                "step_s": times,
                # Each timed step's start to the end of its forward pass.
                "forward_s": forward_times,
                "optimizer": args.optimizer,
                "grad_bytes": stats["grad_bytes"],
                "bucket_bytes_cap": getattr(ddp, "bucket_bytes_cap", None),
                # Whether DDP kept the gradients in its buckets
                # (--grad-view); None without DDP.
                "gradient_as_bucket_view": getattr(ddp, "gradient_as_bucket_view", None),
                "checksum": checksum,
                "rank0_cpu_s_per_step": cpu_per_step,
                "link_bytes_per_step": tx_per_step + rx_per_step,
                "link_tx_bytes_per_step": tx_per_step,
                "link_rx_bytes_per_step": rx_per_step,
                # The share of the machine's CPU time that was busy
                # during the timed steps (1.0: every core saturated).
                "machine_cpu_busy": machine_busy,
                # Rank 0's CPU seconds a step per thread group.
                "rank0_thread_cpu_s_per_step": threads_per_step,
            }
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
