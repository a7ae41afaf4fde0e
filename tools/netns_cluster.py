"""An emulated two-node cluster on one machine, for the DDP benchmark.

Two network namespaces ("nodes") joined by a veth pair whose two ends are
rate-limited with ``tc tbf`` (default 200 Mbit/s each way), like two hosts
on a slow Ethernet link. Ranks of the same node talk over that node's own
address (the kernel keeps it local); ranks of different nodes cross the link.

Needs root (``ip netns``, ``tc``). Only the addresses of the namespaces it
creates are used, and ``down`` (or leaving the ``cluster()`` context)
removes everything it made::

    python tools/netns_cluster.py up --rate-mbit 200
    python tools/netns_cluster.py exec 1 -- python -c 'print("on node 1")'
    python tools/netns_cluster.py down
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

PREFIX = "tiacc-node"
SUBNET = "10.231.77"


@dataclass(frozen=True)
class Node:
    """One emulated node."""

    index: int

    @property
    def netns(self) -> str:
        """The namespace name."""
        return f"{PREFIX}{self.index}"

    @property
    def veth(self) -> str:
        """The node's end of the link."""
        return f"tiacc-veth{self.index}"

    @property
    def address(self) -> str:
        """The node's IP address on the link."""
        return f"{SUBNET}.{self.index + 1}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


NODES = (Node(0), Node(1))


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def up(rate_mbit: float = 200.0) -> None:
    """Creates the namespaces, the link and the rate limits.

    Args:
        rate_mbit: link rate in Mbit/s in each direction.
    """
    down()
    for node in NODES:
        _run(["ip", "netns", "add", node.netns])
        _run(node.command(["ip", "link", "set", "lo", "up"]))
    a, b = NODES
    _run(["ip", "link", "add", a.veth, "type", "veth", "peer", "name", b.veth])
    for node in NODES:
        _run(["ip", "link", "set", node.veth, "netns", node.netns])
        _run(node.command(["ip", "addr", "add", f"{node.address}/24", "dev", node.veth]))
        _run(node.command(["ip", "link", "set", node.veth, "up"]))
        # tbf shapes what leaves each end, so each direction gets `rate`.
        # The burst must hold at least rate/HZ bytes; 256 KiB covers 1 Gbit/s.
        _run(
            node.command(
                [
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    node.veth,
                    "root",
                    "tbf",
                    "rate",
                    f"{rate_mbit}mbit",
                    "burst",
                    "256kb",
                    "latency",
                    "100ms",
                ]
            )
        )


def link_stats() -> dict[str, int]:
    """Bytes sent and packets dropped by both shapers so far (summed)."""
    totals = {"sent_bytes": 0, "dropped_packets": 0}
    for node in NODES:
        out = _run(node.command(["tc", "-s", "qdisc", "show", "dev", node.veth])).stdout
        match = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+)", out)
        if match:
            totals["sent_bytes"] += int(match.group(1))
            totals["dropped_packets"] += int(match.group(2))
    return totals


def down() -> None:
    """Removes the namespaces (and with them the veth pair and qdiscs)."""
    for node in NODES:
        _run(["ip", "netns", "delete", node.netns], check=False)


@contextlib.contextmanager
def cluster(rate_mbit: float = 200.0) -> Iterator[tuple[Node, ...]]:
    """The two nodes, set up for the duration of the ``with`` block."""
    up(rate_mbit)
    try:
        yield NODES
    finally:
        down()


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="create the two nodes and the link")
    p_up.add_argument("--rate-mbit", type=float, default=200.0)
    sub.add_parser("down", help="remove everything `up` created")
    p_exec = sub.add_parser("exec", help="run a command on a node: exec NODE -- CMD...")
    p_exec.add_argument("node", type=int, choices=[n.index for n in NODES])
    p_exec.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.cmd == "up":
        up(args.rate_mbit)
        for node in NODES:
            print(f"node {node.index}: netns {node.netns}, address {node.address}")
    elif args.cmd == "down":
        down()
    else:
        argv_ = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return subprocess.call(NODES[args.node].command(argv_))
    return 0


if __name__ == "__main__":
    sys.exit(main())
