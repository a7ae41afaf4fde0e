"""Runs one multi-rank job on the emulated two-node cluster.

Shared by the DDP benchmarks: ranks ``0 .. k-1`` on the first node given,
``k .. 2k-1`` on the second (a single node runs the whole job over its own
loopback), torchrun-style variables, each node's link settings
(``netns_cluster.Node.env``), and the shapers' counters read around the job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from _machine import REPO, last_result
from netns_cluster import Node, link_stats

# The start of the line rank 0 logs when TIACC_TRAINING_ALGORITHM=auto has
# timed flat against 2D (the logger's name, either spelling).
AUTO_PREFIXES = ("tiacc-training: auto", "tiacc_training: auto")


def cuda_unavailable() -> str | None:
    """Why a job with four ranks on GPU 0 cannot run here, or None."""
    import torch

    from tiacc_training.torch.distributed._nccl import shared_gpu_unavailable

    if not torch.cuda.is_available():
        return "needs a CUDA device"
    return shared_gpu_unavailable(4)


def cuda_env() -> dict[str, str]:
    """The variables of every rank of a job whose ranks all share GPU 0.

    NCCL >= 2.30 lets several ranks share a GPU under
    ``NCCL_MULTI_RANK_GPU_ENABLE=1``; the NCCL this process was pointed
    at (``TIACC_TRAINING_NCCL_LIBRARY``, which :func:`run_job` does not
    pass on by itself) is the ranks' too; ``NCCL_MAX_CTAS`` (default 8)
    keeps four ranks' kernels from crowding each other out.
    """
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "CUDA_VISIBLE_DEVICES": "0"}
    library = os.environ.get("TIACC_TRAINING_NCCL_LIBRARY")
    if library:
        env["TIACC_TRAINING_NCCL_LIBRARY"] = library
    env["NCCL_MAX_CTAS"] = os.environ.get("NCCL_MAX_CTAS", "8")
    return env


def run_job(
    nodes: Sequence[Node],
    worker: Path,
    worker_args: list[str],
    env_extra: dict[str, str],
    ranks_per_node: int = 2,
    timeout: float = 900,
    stderr_prefixes: Sequence[str] = (),
    import_root: Path = REPO,
) -> dict:
    """Runs ``worker`` on every rank and returns rank 0's ``RESULT`` JSON.

    The ranks import the package from ``import_root`` first (another
    build's tree, for ``ab_builds``).

    The result gains ``link_sent_bytes`` and ``link_dropped_packets``: what
    the two shapers saw during the whole job. With ``stderr_prefixes`` it
    also gains ``rank0_stderr_lines``: rank 0's stderr lines that start with
    one of them (stderr is otherwise only shown when a rank fails).

    Raises:
        RuntimeError: a rank failed (its output is in the message).
    """
    world = ranks_per_node * len(nodes)
    port = 29000 + int(time.time()) % 1000
    procs = []
    for rank in range(world):
        node = nodes[rank // ranks_per_node]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIACC_TRAINING_")}
        env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank % ranks_per_node),
                "LOCAL_WORLD_SIZE": str(ranks_per_node),
                "MASTER_ADDR": nodes[0].address,
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(import_root), os.environ.get("PYTHONPATH", "")) if p
                ),
                **node.env(),
                **env_extra,
            }
        )
        cmd = node.command([sys.executable, str(worker), *worker_args])
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    before = link_stats(tuple(nodes))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outputs.append(p.communicate())
    after = link_stats(tuple(nodes))
    failed = [
        f"rank {rank} exited {p.returncode}:\n{out}\n{err[-2000:]}"
        for rank, (p, (out, err)) in enumerate(zip(procs, outputs))
        if p.returncode != 0
    ]
    if failed:
        raise RuntimeError(f"{' '.join(worker_args)} failed:\n" + "\n".join(failed))
    result = last_result(outputs[0][0])
    if result is None:
        raise RuntimeError(f"{' '.join(worker_args)}: rank 0 printed no RESULT line")
    result["link_dropped_packets"] = after["dropped_packets"] - before["dropped_packets"]
    result["link_sent_bytes"] = after["sent_bytes"] - before["sent_bytes"]
    if stderr_prefixes:
        result["rank0_stderr_lines"] = [
            x for x in outputs[0][1].splitlines() if x.startswith(tuple(stderr_prefixes))
        ]
    return result
