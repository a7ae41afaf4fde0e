"""An emulated two-node cluster on one machine, for the DDP benchmarks.

Two network namespaces ("nodes") joined by a veth pair whose two ends are
rate-limited with a ``tbf`` qdisc (default 200 Mbit/s each way), like two
hosts on a slow Ethernet link. Ranks of the same node talk over that node's
own address (the kernel keeps it local); ranks of different nodes cross the
link. For NCCL, :meth:`Node.env` gives each node its own ``NCCL_HOSTID``, so
NCCL treats the namespaces as separate hosts (its network transport between
them, shared memory or P2P inside one, even with every rank on one GPU).

Needs root. Uses iproute2 (``ip``, ``tc``) when installed, else the
pure-Python ``pyroute2`` package (``TIACC_NETNS_TOOL=ip|pyroute2`` forces
one). Only the addresses of the namespaces it creates are used, and ``down``
(or leaving the ``cluster()`` context) removes everything it made. Each
``cluster()`` names its namespaces and links after the calling process, so
several can run at once (a benchmark next to the tests); the command line
uses fixed names::

    python tools/netns_cluster.py up --rate-mbit 200
    python tools/netns_cluster.py exec 1 -- python -c 'print("on node 1")'
    python tools/netns_cluster.py down
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

PREFIX = "tiacc-node"
SUBNET = "10.231.77"
BURST_BYTES = 256 * 1024  # holds at least rate/HZ bytes up to 1 Gbit/s


def burst_bytes(rate_mbit: float) -> int:
    """The shaper's bucket: at least what the link carries in 10 ms (a tick at HZ=100).

    A bucket smaller than the bytes of one timer tick caps the rate under the
    one asked for, which 256 KiB does above about 1 Gbit/s.
    """
    return max(BURST_BYTES, round(rate_mbit * 1e6 / 8 / 100))


LATENCY = "100ms"

# Runs argv[2:] inside namespace argv[1] (the pyroute2 way of `ip netns exec`).
_ENTER = (
    "import os, sys\n"
    "from pyroute2 import netns\n"
    "netns.setns(sys.argv[1])\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def tool() -> str:
    """``ip`` when iproute2 is installed (or forced), else ``pyroute2``."""
    forced = os.environ.get("TIACC_NETNS_TOOL")
    if forced in ("ip", "pyroute2"):
        return forced
    return "ip" if shutil.which("ip") and shutil.which("tc") else "pyroute2"


@dataclass(frozen=True)
class Node:
    """One emulated node."""

    index: int
    # Tells apart the clusters of concurrent processes ("" on the command line).
    tag: str = ""

    @property
    def netns(self) -> str:
        """The namespace name."""
        return f"{PREFIX}-{self.tag}-{self.index}" if self.tag else f"{PREFIX}{self.index}"

    @property
    def veth(self) -> str:
        """The node's end of the link (interface names hold 15 characters)."""
        return f"tv{self.tag}-{self.index}" if self.tag else f"tiacc-veth{self.index}"

    @property
    def address(self) -> str:
        """The node's IP address on the link."""
        return f"{SUBNET}.{self.index + 1}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node's namespace."""
        if tool() == "ip":
            return ["ip", "netns", "exec", self.netns, *argv]
        return [sys.executable, "-c", _ENTER, self.netns, *argv]

    def env(self) -> dict[str, str]:
        """The variables of a rank on this node.

        gloo and NCCL then use this node's end of the link, and NCCL sees
        the two namespaces as two hosts.
        """
        return {
            "GLOO_SOCKET_IFNAME": self.veth,
            "NCCL_SOCKET_IFNAME": self.veth,
            "NCCL_HOSTID": self.netns,
        }


NODES = (Node(0), Node(1))


def nodes_of_this_process() -> tuple[Node, ...]:
    """Two nodes named after this process, apart from any other cluster."""
    tag = f"{os.getpid():x}"
    return (Node(0, tag), Node(1, tag))


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def up(rate_mbit: float = 200.0, nodes: tuple[Node, ...] = NODES) -> None:
    """Creates the namespaces, the link and the rate limits.

    Args:
        rate_mbit: link rate in Mbit/s in each direction; 0 leaves the link
            unshaped (the veth pair's own speed).
        nodes: the two nodes to create.
    """
    down(nodes)
    if tool() == "pyroute2":
        _up_pyroute2(rate_mbit, nodes)
        return
    for node in nodes:
        _run(["ip", "netns", "add", node.netns])
        _run(node.command(["ip", "link", "set", "lo", "up"]))
    a, b = nodes
    _run(["ip", "link", "add", a.veth, "type", "veth", "peer", "name", b.veth])
    for node in nodes:
        _run(["ip", "link", "set", node.veth, "netns", node.netns])
        _run(node.command(["ip", "addr", "add", f"{node.address}/24", "dev", node.veth]))
        _run(node.command(["ip", "link", "set", node.veth, "up"]))
        if rate_mbit <= 0:
            continue
        # tbf shapes what leaves each end, so each direction gets `rate`.
        burst = str(burst_bytes(rate_mbit))
        _run(
            node.command(
                ["tc", "qdisc", "add", "dev", node.veth, "root", "tbf"]
                + ["rate", f"{rate_mbit}mbit", "burst", burst, "latency", LATENCY]
            )
        )


def _up_pyroute2(rate_mbit: float, nodes: tuple[Node, ...]) -> None:
    from pyroute2 import IPRoute, netns

    for node in nodes:
        netns.create(node.netns)
    a, b = nodes
    with IPRoute() as ipr:
        ipr.link("add", ifname=a.veth, kind="veth", peer=b.veth)
        for node in nodes:
            ipr.link("set", index=ipr.link_lookup(ifname=node.veth)[0], net_ns_fd=node.netns)
    for node in nodes:
        with IPRoute(netns=node.netns) as ipr:
            index = ipr.link_lookup(ifname=node.veth)[0]
            ipr.addr("add", index=index, address=node.address, prefixlen=24)
            ipr.link("set", index=index, state="up")
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            if rate_mbit <= 0:
                continue
            ipr.tc(
                "add",
                "tbf",
                index=index,
                rate=f"{round(rate_mbit * 1000)}kbit",
                burst=burst_bytes(rate_mbit),
                latency=LATENCY,
            )


def link_stats(nodes: tuple[Node, ...] = NODES) -> dict[str, int]:
    """Bytes sent and packets dropped by both shapers so far (summed)."""
    totals = {"sent_bytes": 0, "dropped_packets": 0}
    for node in nodes:
        if tool() == "pyroute2":
            from pyroute2 import IPRoute

            with IPRoute(netns=node.netns) as ipr:
                index = ipr.link_lookup(ifname=node.veth)[0]
                for qdisc in ipr.get_qdiscs(index=index):
                    stats = qdisc.get_attr("TCA_STATS") or {}
                    totals["sent_bytes"] += int(stats.get("bytes", 0))
                    totals["dropped_packets"] += int(stats.get("drop", 0))
            continue
        out = _run(node.command(["tc", "-s", "qdisc", "show", "dev", node.veth])).stdout
        match = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+)", out)
        if match:
            totals["sent_bytes"] += int(match.group(1))
            totals["dropped_packets"] += int(match.group(2))
    return totals


def down(nodes: tuple[Node, ...] = NODES) -> None:
    """Removes the namespaces (and with them the veth pair and qdiscs)."""
    if tool() == "pyroute2":
        from pyroute2 import netns

        for node in nodes:
            if node.netns in netns.listnetns():
                netns.remove(node.netns)
        return
    for node in nodes:
        _run(["ip", "netns", "delete", node.netns], check=False)


@contextlib.contextmanager
def cluster(rate_mbit: float = 200.0) -> Iterator[tuple[Node, ...]]:
    """Two nodes of this process, set up for the duration of the ``with`` block."""
    nodes = nodes_of_this_process()
    try:
        up(rate_mbit, nodes)
        yield nodes
    finally:
        down(nodes)


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
            print(f"node {node.index}: netns {node.netns}, address {node.address} ({tool()})")
    elif args.cmd == "down":
        down()
    else:
        argv_ = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return subprocess.call(NODES[args.node].command(argv_))
    return 0


if __name__ == "__main__":
    sys.exit(main())
