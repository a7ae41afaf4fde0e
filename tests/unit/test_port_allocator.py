"""``_launch.free_port``: no port twice, none a store cannot bind, under churn.

The concurrent test runs this file as a script: one interpreter imports
torch once, then forks ``--procs`` processes that start together, like
pytest-xdist workers launching jobs. Each keeps a thread churning the
kernel's ephemeral ports (listening sockets on port 0, as gloo opens them,
and outgoing loopback connections) while it calls ``free_port`` ``--calls``
times, waits a moment as a rank 0 starting up would, and binds a real
``TCPStore`` on each port. The old picker (bind port 0, close, return the
number) fails it: other processes' port-0 sockets take its ports before the
stores bind them.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import multiprocessing as mp
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time

import _launch
import pytest
import torch.distributed as dist
from _launch import REPO, base_env, free_port, json_lines

# Each churning thread keeps this many port-0 listeners and this many
# loopback connections open at once, replacing the oldest.
CHURN_LISTENERS = 200
CHURN_CONNECTIONS = 50
# The longest wait between free_port and the store's bind (seconds).
MAX_GAP = 0.2
# SO_LINGER on, 0 s: close resets the connection, leaving no TIME_WAIT behind
# (the churn would otherwise keep most ephemeral ports in TIME_WAIT for a
# minute, for the other tests running beside this one).
RESET = struct.pack("ii", 1, 0)


def _churn(stop: threading.Event, counter: list[int]) -> None:
    """Takes and frees ephemeral ports until ``stop``: listeners on port 0 and
    outgoing loopback connections, a rolling set of each held open."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    listeners: collections.deque[socket.socket] = collections.deque()
    connections: collections.deque[tuple[socket.socket, socket.socket]] = collections.deque()
    try:
        while not stop.is_set():
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            listeners.append(listener)
            client = socket.create_connection(server.getsockname())
            accepted, _ = server.accept()
            for sock in (client, accepted):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
            connections.append((client, accepted))
            while len(listeners) > CHURN_LISTENERS:
                listeners.popleft().close()
            while len(connections) > CHURN_CONNECTIONS:
                for sock in connections.popleft():
                    sock.close()
            counter[0] += 1
    finally:
        for sock in [*listeners, *(s for pair in connections for s in pair), server]:
            sock.close()


def _child(calls: int, barrier: mp.Barrier, results: mp.Queue) -> None:
    """One launcher: ``calls`` ports from ``free_port``, a store bound on each."""
    stop = threading.Event()
    counter = [0]
    churn = threading.Thread(target=_churn, args=(stop, counter), daemon=True)
    churn.start()
    rng = random.Random(os.getpid())
    ports: list[int] = []
    errors: list[str] = []
    stores = []
    barrier.wait()
    for _ in range(calls):
        port = free_port()
        ports.append(port)
        time.sleep(rng.uniform(0.0, MAX_GAP))  # rank 0 starting up
        try:
            stores.append(
                dist.TCPStore(
                    "127.0.0.1",
                    port,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=30),
                )
            )
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(f"port {port}: {type(e).__name__}: {e}")
    barrier.wait()  # every store still up while the others bind theirs
    stop.set()
    churn.join()
    results.put({"ports": ports, "errors": errors, "churned": counter[0]})


def main() -> None:
    """Runs the concurrent launchers and prints their results as one ``RESULT`` line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--procs", type=int, default=16)
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    ctx = mp.get_context("fork")  # torch is imported once, here
    barrier = ctx.Barrier(args.procs)
    results = ctx.Queue()
    children = [
        ctx.Process(target=_child, args=(args.calls, barrier, results)) for _ in range(args.procs)
    ]
    for child in children:
        child.start()
    got = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=30)
    print("RESULT " + json.dumps(got), flush=True)


def test_concurrent_launchers_get_distinct_ports_their_stores_bind():
    procs, calls = 16, 4
    env = base_env({"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])})
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, __file__, "--procs", str(procs), "--calls", str(calls)],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    children = json_lines(done.stdout)[-1]
    assert len(children) == procs
    errors = [e for child in children for e in child["errors"]]
    assert not errors, "\n".join(errors)
    ports = [p for child in children for p in child["ports"]]
    assert len(ports) == procs * calls
    assert len(set(ports)) == len(ports), sorted(ports)
    pool = _launch._port_pool()
    assert all(p in pool for p in ports), (pool, sorted(ports))
    # The ports really were churned meanwhile.
    assert all(child["churned"] > 0 for child in children), children
    print(f"{procs * calls} ports in {time.monotonic() - start:.1f} s")


@pytest.fixture()
def small_pool(monkeypatch, tmp_path) -> range:
    """``free_port`` over three ports of its pool, with reservations of its own."""
    pool = _launch._port_pool()
    first = next(
        p for p in range(pool.start, pool.stop - 3) if all(map(_launch._bindable, range(p, p + 3)))
    )
    small = range(first, first + 3)
    monkeypatch.setattr(_launch, "_port_pool", lambda: small)
    monkeypatch.setattr(_launch, "RESERVATIONS", tmp_path / "ports")
    return small


def test_a_reserved_port_is_not_handed_out_again_until_it_is_stale(small_pool, tmp_path):
    got = {free_port() for _ in small_pool}
    assert got == set(small_pool)
    with pytest.raises(RuntimeError, match="no free port"):
        free_port()
    stale = small_pool[1]
    old = time.time() - _launch.RESERVATION_S - 60
    os.utime(tmp_path / "ports" / str(stale), (old, old))
    assert free_port() == stale


def test_a_port_in_use_is_skipped(small_pool):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", small_pool[0]))
        listener.listen(1)
        got = {free_port(), free_port()}
        with pytest.raises(RuntimeError):
            free_port()
    assert got == set(small_pool[1:])


if __name__ == "__main__":
    main()
