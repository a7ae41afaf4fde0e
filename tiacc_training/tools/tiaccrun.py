"""tiaccrun: start a training job on one or more hosts, as ``horovodrun`` does.

Usage:
    tiaccrun -np 4 python train.py
    tiaccrun -np 8 -H host1:4,host2:4 python train.py
    tiaccrun -np 8 --hostfile hosts -p 2222 --network-interface eth0 python train.py

Ranks are placed host by host (the first host's slots first). Ranks on this
machine start as child processes; ranks on other hosts start over ``ssh``
(``BatchMode``, the port and identity given), in the same working directory
and with this process's environment. Every rank gets the rendezvous
(``MASTER_ADDR``, ``MASTER_PORT``), the variables torchrun sets
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...) and Horovod's
(``HOROVOD_RANK``, ``HOROVOD_SIZE``, ...), so Horovod scripts on
``tiacc_training.torch.horovod`` and plain torch scripts with the two lines
of ``tiacc_training.torch.distributed`` both run under it.

The rendezvous store: without ``MASTER_PORT`` in the environment and with
rank 0 on this machine, tiaccrun hosts the job's ``TCPStore`` itself, bound
on port 0 before any rank starts, and hands its port to the ranks with
``TORCHELASTIC_USE_AGENT_STORE=True``, as torchrun's agent does: every rank
joins it as a client (torch's ``env://`` and ``tcp://`` rendezvous,
``init_tiacc_training``'s group and ``hvd.init()`` do), so no other process
can take the port between its choice and its use. With ``MASTER_PORT``
set, rank 0 hosts the store on that port, as before. When rank 0 runs on
another host (``-H`` or ``--hostfile`` whose first host is not this
machine), rank 0 hosts the store there: set ``MASTER_PORT`` to a port free
on that host; without it tiaccrun picks one free on this machine, which it
cannot check on that host.

Each output line of a rank is printed with the prefix ``[rank]<stdout>:``
or ``[rank]<stderr>:``. A rank that fails ends the job: the other ranks are
terminated and tiaccrun prints the rank, its host and its exit code or
signal, and exits with that code. Ctrl-C, SIGTERM and SIGHUP reach every
rank.

With ``--host-discovery-script`` the job is elastic (Horovod's elastic
mode): the hosts come from the script and the workers form their worlds
in rounds, see ``_elastic``.

The parts: ``_tiaccrun_flags`` (the command line), ``_tiaccrun_hosts``
(host lists, placement, addresses) and ``_tiaccrun_job`` (starting and
watching the ranks); this module plans the job and its rendezvous and
runs it. Every name of those parts is also a name of this module.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

from tiacc_training import _engine
from tiacc_training.tools import _elastic
from tiacc_training.tools._tiaccrun_flags import (
    DEFAULT_ELASTIC_TIMEOUT,
    DEFAULT_START_TIMEOUT,
    IFNAME_VARIABLES,
    PROG,
    build_parser,
    parse_args,
    settings_environment,
)
from tiacc_training.tools._tiaccrun_hosts import (
    Host,
    Interface,
    UnreachableHost,
    UsageError,
    assign_ranks,
    choose_interfaces,
    free_port,
    interface_address,
    is_local,
    local_addresses,
    parse_hostfile,
    parse_hosts,
    resolve_ipv4,
    route_address,
)
from tiacc_training.tools._tiaccrun_job import (
    PROBE_MODULE,
    TERMINATE_GRACE,
    Job,
    RankSpec,
    RendezvousWatch,
    check_ssh,
    describe_exit,
    environment_block,
    forwarded_environment,
    probe_interpreter,
    remote_command,
    ssh_base,
)

__all__ = [
    "PROG",
    "DEFAULT_START_TIMEOUT",
    "DEFAULT_ELASTIC_TIMEOUT",
    "build_parser",
    "parse_args",
    "settings_environment",
    "UsageError",
    "UnreachableHost",
    "Host",
    "parse_hosts",
    "parse_hostfile",
    "assign_ranks",
    "Interface",
    "choose_interfaces",
    "interface_address",
    "local_addresses",
    "is_local",
    "route_address",
    "free_port",
    "TERMINATE_GRACE",
    "PROBE_MODULE",
    "RankSpec",
    "RendezvousWatch",
    "ssh_base",
    "remote_command",
    "environment_block",
    "describe_exit",
    "probe_interpreter",
    "forwarded_environment",
    "check_ssh",
    "Job",
    "AGENT_STORE",
    "Plan",
    "host_store",
    "store_joined",
    "listening",
    "rank_environments",
    "interface_environment",
    "job_interfaces",
    "plan",
    "main",
    "run_elastic",
]

# The variable that tells the ranks' torch whether the store at
# MASTER_ADDR:MASTER_PORT is hosted for them (torchrun's agent store).
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


@dataclass
class Plan:
    """A job before it starts: its hosts, its ranks and their rendezvous.

    Attributes:
        hosts: the hosts, as listed.
        specs: each rank's host and variables.
        master_addr: ``MASTER_ADDR``, where the store is.
        master_port: ``MASTER_PORT``, the store's port.
        store: the store tiaccrun hosts for the ranks (``TCPStore``);
            ``None`` where rank 0 hosts it (``MASTER_PORT`` given, or rank 0
            on another host).
        interfaces: the interface each host's ranks use, where one was chosen.
    """

    hosts: list[Host]
    specs: list[RankSpec]
    master_addr: str
    master_port: int
    store: Any = None
    interfaces: dict[str, Interface] = field(default_factory=dict)


# -- the rendezvous ----------------------------------------------------------


def host_store(address: str, timeout: float) -> Any:
    """The job's rendezvous store, hosted by tiaccrun on a port the kernel picks.

    Bound on port 0 and listening before any rank starts, so the port handed
    to the ranks is never free for another process to take.

    Args:
        address: the address of this machine the ranks reach it at.
        timeout: seconds for this process's own requests to the store.

    Raises:
        UsageError: The store cannot be opened (the message says why).
    """
    try:
        return dist.TCPStore(
            address,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except (RuntimeError, OSError) as e:
        raise UsageError(f"cannot open the rendezvous store on {address}: {e}") from e


def store_joined(store: Any) -> bool:
    """Whether a rank has joined tiaccrun's store (written its first key)."""
    try:
        return store.num_keys() > 0
    except (RuntimeError, OSError):
        return False


def listening(port: int) -> bool:
    """Whether a socket of this machine listens on TCP ``port``."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        return True
        except OSError:
            continue
    return False


# -- the job's environment ---------------------------------------------------


# Variables that repeat another's value under the name torch's elastic agent
# (ROLE_*) or Horovod (HOROVOD_*) reads.
_SAME_VALUES = {
    "ROLE_RANK": "RANK",
    "ROLE_WORLD_SIZE": "WORLD_SIZE",
    "HOROVOD_RANK": "RANK",
    "HOROVOD_SIZE": "WORLD_SIZE",
    "HOROVOD_LOCAL_RANK": "LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE": "LOCAL_WORLD_SIZE",
}


def rank_environments(
    hosts: list[Host],
    placement: list[tuple[int, int]],
    master_addr: str,
    master_port: int,
    extra: dict[str, str],
) -> list[dict[str, str]]:
    """The variables each rank gets on top of the job's environment.

    torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``,
    ``ROLE_NAME``, ``MASTER_ADDR``, ``MASTER_PORT``) and Horovod's
    (``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``,
    ``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE``,
    ``HOROVOD_HOSTNAME``), then ``extra``.
    """
    world = len(placement)
    used = sorted({h for h, _ in placement})
    local_size = {h: sum(1 for i, _ in placement if i == h) for h in used}
    envs = []
    for rank, (host_index, local_rank) in enumerate(placement):
        # Horovod's cross communicator: the ranks of the same local rank, one
        # per host that has it.
        peers = [h for h in used if local_size[h] > local_rank]
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size[host_index]),
            "GROUP_RANK": str(used.index(host_index)),
            "GROUP_WORLD_SIZE": str(len(used)),
            "ROLE_NAME": "default",
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "HOROVOD_CROSS_RANK": str(peers.index(host_index)),
            "HOROVOD_CROSS_SIZE": str(len(peers)),
            "HOROVOD_HOSTNAME": hosts[host_index].name,
        }
        env.update({alias: env[name] for alias, name in _SAME_VALUES.items()})
        env.update(extra)
        envs.append(env)
    return envs


# -- the job -----------------------------------------------------------------


def interface_environment(interface: Interface) -> dict[str, str]:
    """The variables that bind a rank's gloo, NCCL and engine to ``interface``."""
    return {IFNAME_VARIABLES[0]: interface[0], IFNAME_VARIABLES[1]: f"={interface[0]}"}


def job_interfaces(
    args: argparse.Namespace,
    names: list[str],
    remote: dict[str, list[Interface] | None],
    log: Callable[[str], None],
) -> dict[str, Interface]:
    """The interface each host of the job talks to the others over (see ``choose_interfaces``).

    Hosts on this machine are listed here, the others by :func:`check_ssh`
    (``remote``). Nothing is chosen where the user's environment names an
    interface already, or for a job on this machine alone.

    Raises:
        UsageError: ``--network-interface`` names no interface a host has.
    """
    if not args.nics and any(os.environ.get(v) for v in IFNAME_VARIABLES):
        return {}
    if not remote and not args.nics:
        return {}
    towards = [a for a in (resolve_ipv4(name) for name in remote) if a is not None]
    if not args.nics and any(ipaddress.ip_address(a).is_loopback for a in towards):
        return {}  # "remote" hosts that are this one under a loopback name
    here = _engine.network_interfaces()
    listed = {name: remote[name] if name in remote else here for name in names}
    for name, interfaces in listed.items():
        if interfaces is None:
            log(
                f"could not list the network interfaces of {name} (is tiacc_training "
                f"importable by {probe_interpreter(args.command)} there?): its ranks use "
                "the route to MASTER_ADDR"
            )
    chosen = choose_interfaces(listed, args.nics, towards)
    if remote and not chosen and not args.nics:
        log(
            "found no network that every host has an interface on: the ranks use the "
            "route to MASTER_ADDR (--network-interface names one per host)"
        )
    return chosen


def plan(
    args: argparse.Namespace,
    log: Callable[[str], None] = lambda _: None,
    deadline: float | None = None,
) -> Plan:
    """Hosts, ranks, interfaces and the rendezvous of the job.

    No rank is started; remote hosts are reached over ssh once
    (:func:`check_ssh`: the connection, and their interfaces). Without
    ``MASTER_PORT`` and with rank 0 on this machine, the store is opened
    here (:func:`host_store`) and the ranks are told to join it
    (``TORCHELASTIC_USE_AGENT_STORE=True``); otherwise rank 0 hosts it
    (``TORCHELASTIC_USE_AGENT_STORE=False``, whatever this process's
    environment says).

    Raises:
        UsageError: Bad hosts, too few slots, an unusable interface, an
            unreachable host or a store that cannot be opened.
    """
    if args.hosts:
        hosts = parse_hosts(args.hosts)
    elif args.hostfile:
        hosts = parse_hostfile(args.hostfile)
    else:
        hosts = [Host("localhost", args.num_proc)]
    placement = assign_ranks(hosts, args.num_proc)
    addresses = local_addresses()
    local = [is_local(h.name, addresses) for h in hosts]
    used = sorted({h for h, _ in placement})
    remote_names = [hosts[h].name for h in used if not local[h]]
    if deadline is None:
        deadline = time.monotonic() + (args.start_timeout or DEFAULT_START_TIMEOUT)
    remote: dict[str, list[Interface] | None] = {}
    if args.nics:  # this host's names are checked before any ssh
        here = _engine.network_interfaces()
        choose_interfaces({hosts[h].name: here for h in used if local[h]}, args.nics)
    if remote_names:
        env = forwarded_environment(dict(os.environ))
        remote = check_ssh(args, remote_names, deadline, args.command, env)
    chosen = job_interfaces(args, [hosts[h].name for h in used], remote, log)
    first = used[0]
    if all(local[h] for h in used):
        master_addr = "127.0.0.1"
    elif hosts[first].name in chosen:
        master_addr = chosen[hosts[first].name][1]
    elif local[first]:
        master_addr = route_address(next(hosts[h].name for h in used if not local[h]))
    else:
        master_addr = hosts[first].name
    port_text = os.environ.get("MASTER_PORT")
    store = None
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise UsageError(f"MASTER_PORT={port_text!r} is not a TCP port")
        master_port = int(port_text)
    elif local[first]:
        store = host_store(master_addr, args.start_timeout or DEFAULT_START_TIMEOUT)
        master_port = store.port
    else:
        master_port = free_port()
    extra = {**settings_environment(args), AGENT_STORE: str(store is not None)}
    envs = rank_environments(hosts, placement, master_addr, master_port, extra)
    specs = []
    for rank, ((h, _), env) in enumerate(zip(placement, envs)):
        if hosts[h].name in chosen:
            env.update(interface_environment(chosen[hosts[h].name]))
        specs.append(RankSpec(rank, hosts[h].name, local[h], env))
    return Plan(hosts, specs, master_addr, master_port, store, chosen)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the job; returns tiaccrun's exit status."""
    args = parse_args(argv)

    def log(message: str) -> None:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)

    if args.host_discovery_script:
        return run_elastic(args, log)
    start_timeout = args.start_timeout or DEFAULT_START_TIMEOUT
    deadline = time.monotonic() + start_timeout
    try:
        job_plan = plan(args, log, deadline)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1 if isinstance(e, UnreachableHost) else 2
    specs, master_port = job_plan.specs, job_plan.master_port
    if args.verbose:
        for spec in specs:
            kind = "local" if spec.local else "ssh"
            log(
                f"rank {spec.rank}: {spec.host} ({kind}), local rank "
                f"{spec.env['LOCAL_RANK']} of {spec.env['LOCAL_WORLD_SIZE']}"
            )
        host = "tiaccrun" if job_plan.store is not None else "rank 0"
        log(f"rendezvous at {job_plan.master_addr}:{master_port} (the store hosted by {host})")
        for name, (nic, address, _) in job_plan.interfaces.items():
            log(f"{name}: its ranks use {nic} ({address})")

    base_env = dict(os.environ)
    if len(specs) > 1:
        # As torchrun: one OpenMP thread per rank unless the user chose.
        base_env.setdefault("OMP_NUM_THREADS", "1")
    job = Job(specs, list(args.command), args, base_env, log)

    def on_signal(signum: int, _frame: object) -> None:
        job.stopping = signal.Signals(signum)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, on_signal) for s in handled}
    try:
        try:
            job.start()
        except UsageError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
            return 1
        return job.wait(_rendezvous_watch(args, job_plan, deadline))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _rendezvous_watch(
    args: argparse.Namespace, job_plan: Plan, deadline: float
) -> RendezvousWatch | None:
    """What ``--start-timeout`` watches once the ranks started, if anything.

    A rank must join the store tiaccrun hosts, or rank 0 (on this machine)
    must listen on ``MASTER_PORT``; nothing is watched without the flag, or
    when rank 0 hosts the store on another host.
    """
    if args.start_timeout is None:
        return None
    port = job_plan.master_port
    store = job_plan.store
    if store is not None:
        missed = f"no rank joined the rendezvous (the store tiaccrun hosts on port {port})"
        return RendezvousWatch(lambda: store_joined(store), missed, deadline)
    if job_plan.specs[0].local:
        missed = f"rank 0 did not open the rendezvous (port {port})"
        return RendezvousWatch(lambda: listening(port), missed, deadline)
    return None


def run_elastic(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    """Runs the job with the elastic driver (``--host-discovery-script``)."""
    base_env = dict(os.environ)
    base_env.setdefault("OMP_NUM_THREADS", "1")
    job = Job([], list(args.command), args, base_env, log)
    addresses = local_addresses()
    extra = settings_environment(args)
    driver: _elastic.ElasticDriver | None = None

    def parse(text: str) -> list[tuple[str, int]]:
        try:
            return [(h.name, h.slots) for h in parse_hosts(text)]
        except UsageError as e:
            raise ValueError(str(e).replace("-H/--hosts", "the discovered hosts")) from e

    # Each remote host's interfaces, listed over ssh when it first runs workers.
    listed: dict[str, list[Interface] | None] = {}

    def interfaces(names: list[str]) -> dict[str, Interface]:
        remote = [h for h in names if not is_local(h, addresses)]
        new = [h for h in remote if h not in listed]
        if new:
            timeout = args.start_timeout or DEFAULT_START_TIMEOUT
            env = forwarded_environment(base_env)
            try:
                listed.update(check_ssh(args, new, time.monotonic() + timeout, args.command, env))
            except UsageError as e:  # its workers fail to start, and the driver says so
                log(str(e))
                listed.update({h: None for h in new})
        return job_interfaces(args, names, {h: listed[h] for h in remote}, lambda _: None)

    def store_address(names: list[str]) -> str:
        here = [h for h in names if is_local(h, addresses)]
        chosen = interfaces(names)
        if here and here[0] in chosen:
            return chosen[here[0]][1]
        if args.nics:
            return interface_address(args.nics[0])
        remote = [h for h in names if not is_local(h, addresses)]
        return route_address(remote[0]) if remote else "127.0.0.1"

    def environments(names: list[str], placement: list[tuple[int, int]]) -> list[dict[str, str]]:
        assert driver is not None
        hosts = [Host(name, 1) for name in names]
        address, port = driver.store_address, driver.store.port
        envs = rank_environments(hosts, placement, address, port, extra)
        chosen = interfaces(names)
        for env, (h, _) in zip(envs, placement):
            if names[h] in chosen:
                env.update(interface_environment(chosen[names[h]]))
        return envs

    def spawn(label: int, host: str, slot: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
        spec = RankSpec(label, host, is_local(host, addresses), env)
        if args.verbose:
            log(f"worker {label}: {host} slot {slot}")
        return job.launch(spec, 1)

    launcher = _elastic.Launcher(parse, environments, spawn, job._signal, log, store_address)
    driver = _elastic.ElasticDriver(_elastic.settings_from(args), launcher, base_env)

    def on_signal(signum: int, _frame: object) -> None:
        assert driver is not None
        driver.stopping = signal.Signals(signum)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, on_signal) for s in handled}
    try:
        status = driver.run()
        job.output.drain(5.0)
        return status
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
