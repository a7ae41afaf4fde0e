"""tiaccrun's hosts: the ``-H`` list and the hostfile, where each rank runs, and addresses.

Which host is this machine, the address of an interface, the address that
routes to a host, and a free port; ``UsageError`` names what was wrong.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from tiacc_training import _engine


class UsageError(Exception):
    """A bad flag, host list or hostfile; the message names it."""


class UnreachableHost(UsageError):
    """A host ssh could not reach (tiaccrun exits with 1, not 2); the message says why."""


@dataclass(frozen=True)
class Host:
    """A host and how many ranks it may run."""

    name: str
    slots: int


# -- hosts -------------------------------------------------------------------


def parse_hosts(text: str) -> list[Host]:
    """Parses ``-H``: ``host1:2,host2:4`` (a host without ``:slots`` has 1).

    Raises:
        UsageError: An empty entry, a bad slot count or a host named twice.
    """
    hosts: list[Host] = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            raise UsageError(f"-H/--hosts {text!r}: empty host entry")
        name, slots = _split_slots(entry, f"-H/--hosts entry {entry!r}")
        hosts.append(Host(name, slots))
    _check_unique(hosts, "-H/--hosts")
    return hosts


def parse_hostfile(path: str) -> list[Host]:
    """Parses a hostfile: ``host slots=N`` per line (``host`` alone: 1 slot).

    Blank lines and ``#`` comments are skipped.

    Raises:
        UsageError: The file cannot be read, or a line is malformed (the
            message names ``path:line``).
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UsageError(f"--hostfile {path}: {e.strerror or e}") from e
    hosts: list[Host] = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        fields = line.split()
        slots = 1
        for extra in fields[1:]:
            key, sep, value = extra.partition("=")
            if key in ("slots", "max_slots", "max-slots") and sep:
                if key == "slots":
                    slots = _slot_count(value, f"{where}: {raw.strip()!r}")
            else:
                raise UsageError(
                    f"{where}: {raw.strip()!r}: expected 'hostname slots=N', not {extra!r}"
                )
        if fields[0].count(":") == 1:  # host:N (an IPv6 address has more colons)
            raise UsageError(f"{where}: {raw.strip()!r}: write 'host slots=N', not 'host:N'")
        hosts.append(Host(fields[0].strip("[]"), slots))
    if not hosts:
        raise UsageError(f"--hostfile {path}: no hosts in the file")
    _check_unique(hosts, f"--hostfile {path}")
    return hosts


def _split_slots(entry: str, what: str) -> tuple[str, int]:
    if entry.startswith("["):  # [ipv6]:slots
        close = entry.find("]")
        if close < 0:
            raise UsageError(f"{what}: unclosed '['")
        name, rest = entry[1:close], entry[close + 1 :]
        if not rest:
            return name, 1
        if not rest.startswith(":"):
            raise UsageError(f"{what}: expected host:slots")
        return name, _slot_count(rest[1:], what)
    name, sep, slots = entry.rpartition(":")
    if not sep:
        return entry, 1
    if not name:
        raise UsageError(f"{what}: no host name")
    return name, _slot_count(slots, what)


def _slot_count(value: str, what: str) -> int:
    try:
        slots = int(value)
    except ValueError:
        slots = 0
    if slots < 1:
        raise UsageError(f"{what}: slots must be a positive integer, got {value!r}")
    return slots


def _check_unique(hosts: list[Host], what: str) -> None:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise UsageError(f"{what}: host {host.name!r} is listed twice")
        seen.add(host.name)


def assign_ranks(hosts: list[Host], num_proc: int) -> list[tuple[int, int]]:
    """Places ``num_proc`` ranks host by host.

    Returns:
        For each rank, its host's index in ``hosts`` and its local rank.

    Raises:
        UsageError: The hosts have fewer slots than ``num_proc``.
    """
    total = sum(h.slots for h in hosts)
    if num_proc > total:
        listed = ", ".join(f"{h.name}:{h.slots}" for h in hosts)
        raise UsageError(f"-np {num_proc} is more than the {total} slots of the hosts ({listed})")
    placement: list[tuple[int, int]] = []
    for index, host in enumerate(hosts):
        for local_rank in range(host.slots):
            if len(placement) == num_proc:
                return placement
            placement.append((index, local_rank))
    return placement


# -- addresses ---------------------------------------------------------------


# An interface of a host: (name, IPv4 address, prefix length or None).
Interface = tuple[str, str, "int | None"]


def interface_address(name: str) -> str:
    """The IPv4 address of this host's network interface ``name``.

    Raises:
        UsageError: No such interface, or it has no IPv4 address.
    """
    interfaces = _engine.network_interfaces()
    for found, address, _ in interfaces:
        if found == name:
            return address
    names = ", ".join(n for n, _, _ in interfaces) or "none with an IPv4 address"
    raise UsageError(
        f"--network-interface {name}: no interface of that name with an IPv4 address "
        f"on this host (interfaces: {names})"
    )


def local_addresses() -> set[str]:
    """The IPv4 addresses of this machine's interfaces."""
    return {address for _, address, _ in _engine.network_interfaces()}


def _network(interface: Interface) -> ipaddress.IPv4Network | None:
    """The IPv4 network an interface is on (``None``: loopback, link-local or unknown)."""
    _, address, prefix = interface
    ip = ipaddress.IPv4Address(address)
    if prefix is None or ip.is_loopback or ip.is_link_local:
        return None
    return ipaddress.IPv4Network(f"{address}/{prefix}", strict=False)


def choose_interfaces(
    hosts: dict[str, list[Interface] | None],
    names: list[str] | None,
    towards: Sequence[str] = (),
) -> dict[str, Interface]:
    """The interface each host's ranks talk to the others over.

    With ``names`` (``--network-interface``): on each host, the first of
    them the host has. Without: a network that every host has an interface
    on, the one holding an address of ``towards`` first (where the host
    list's names lead), else the first in the first host's order of
    interfaces; no host gets one where no such network exists. A host
    whose interfaces are unknown (``None``: its listing failed) gets none.

    Args:
        hosts: each host's interfaces, in the job's host order.
        names: the interface names the user gave, if any.
        towards: IPv4 addresses the host list's names resolve to.

    Raises:
        UsageError: ``names`` given and a host has none of them (the
            message lists that host's interfaces).
    """
    chosen: dict[str, Interface] = {}
    if names:
        for host, interfaces in hosts.items():
            if interfaces is None:
                continue
            found = next((i for n in names for i in interfaces if i[0] == n), None)
            if found is None:
                listed = ", ".join(f"{n} ({a})" for n, a, _ in interfaces) or "none"
                raise UsageError(
                    f"--network-interface {','.join(names)}: host {host} has none of these "
                    f"interfaces (it has {listed})"
                )
            chosen[host] = found
        return chosen
    known = {h: i for h, i in hosts.items() if i is not None}
    if not known:
        return chosen
    networks = {h: {_network(i): i for i in reversed(ifaces)} for h, ifaces in known.items()}
    first = next(iter(known.values()))
    candidates = [c for c in (_network(i) for i in first) if c is not None]
    candidates.sort(key=lambda c: not any(ipaddress.IPv4Address(a) in c for a in towards))
    for candidate in candidates:
        if all(candidate in n for n in networks.values()):
            return {h: networks[h][candidate] for h in known}
    return chosen


def resolve_ipv4(host: str) -> str | None:
    """The first IPv4 address ``host`` resolves to here, or ``None``."""
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except OSError:
        return None


def is_local(host: str, addresses: set[str]) -> bool:
    """Whether ``host`` names this machine (by name or by an address it has)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False
    return bool(resolved) and resolved <= addresses


def route_address(host: str) -> str:
    """This machine's address that routes to ``host`` (no packet is sent).

    The engine's choice (``_engine.local_addr_towards``, the rule its ranks
    advertise by), towards ``host``'s IPv4 address.

    Raises:
        UsageError: ``host`` does not resolve, or no route leads to it.
    """
    try:
        target = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except OSError as e:
        raise UsageError(f"host {host!r}: cannot resolve or route to it: {e}") from e
    address = _engine.local_addr_towards(target, 9)
    # The engine answers loopback where no route leads to the host.
    if ipaddress.ip_address(address).is_loopback and not ipaddress.ip_address(target).is_loopback:
        raise UsageError(f"host {host!r}: cannot resolve or route to it: no route from this host")
    return address


def free_port() -> int:
    """A TCP port free on this machine now, for a rank 0 on another host.

    Nothing holds it after this returns, and it says nothing of the other
    host: used only where rank 0 runs elsewhere and ``MASTER_PORT`` is unset
    (with rank 0 on this machine, tiaccrun hosts the store: :func:`host_store`).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
