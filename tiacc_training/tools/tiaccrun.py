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
"""

from __future__ import annotations

import argparse
import datetime
import errno
import fcntl
import ipaddress
import os
import re
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Callable

import torch.distributed as dist

from tiacc_training import _engine
from tiacc_training.tools import _elastic

PROG = "tiaccrun"
DEFAULT_START_TIMEOUT = 30.0
DEFAULT_ELASTIC_TIMEOUT = 600.0
# Seconds a rank gets to exit after SIGTERM before it is killed.
TERMINATE_GRACE = 10.0
# The variable that tells the ranks' torch whether the store at
# MASTER_ADDR:MASTER_PORT is hosted for them (torchrun's agent store).
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
# Variables of this process that are not handed to remote ranks: they
# describe this shell or this machine, not the job.
_NOT_FORWARDED = re.compile(
    r"^(HOSTNAME|HOST|PWD|OLDPWD|SHLVL|_|SHELL|TERM|TERMCAP|DISPLAY|XAUTHORITY|"
    r"SSH_.*|BASH_FUNC_.*|LS_COLORS|MAIL|USER|LOGNAME|HOME|TMUX.*|STY|WINDOW)$"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class UsageError(Exception):
    """A bad flag, host list or hostfile; the message names it."""


@dataclass(frozen=True)
class Host:
    """A host and how many ranks it may run."""

    name: str
    slots: int


@dataclass
class RankSpec:
    """Where a rank runs and what it is told."""

    rank: int
    host: str
    local: bool
    env: dict[str, str] = field(default_factory=dict)


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
    """

    hosts: list[Host]
    specs: list[RankSpec]
    master_addr: str
    master_port: int
    store: Any = None


@dataclass
class RendezvousWatch:
    """What ``--start-timeout`` bounds beyond the start: the ranks reaching the rendezvous.

    Attributes:
        reached: whether it has been reached (checked every 0.1 s).
        missed: what the job's end says when it was not, by the deadline.
        deadline: its ``time.monotonic()`` deadline.
    """

    reached: Callable[[], bool]
    missed: str
    deadline: float


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


def interface_address(name: str) -> str:
    """The IPv4 address of the network interface ``name``.

    Raises:
        UsageError: No such interface, or it has no IPv4 address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("256s", name.encode()[:15])
        try:
            reply = fcntl.ioctl(s.fileno(), 0x8915, request)  # SIOCGIFADDR
        except OSError as e:
            names = ", ".join(n for _, n in socket.if_nameindex())
            reason = "does not exist" if e.errno == errno.ENODEV else "has no IPv4 address"
            raise UsageError(
                f"--network-interface {name}: the interface {reason} on this host "
                f"(interfaces: {names})"
            ) from e
    return socket.inet_ntoa(reply[20:24])


def local_addresses() -> set[str]:
    """The IPv4 addresses of this machine's interfaces."""
    addresses = set()
    for _, name in socket.if_nameindex():
        try:
            addresses.add(interface_address(name))
        except UsageError:
            continue
    return addresses


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
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default",
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(world),
            "HOROVOD_LOCAL_RANK": str(local_rank),
            "HOROVOD_LOCAL_SIZE": str(local_size[host_index]),
            "HOROVOD_CROSS_RANK": str(peers.index(host_index)),
            "HOROVOD_CROSS_SIZE": str(len(peers)),
            "HOROVOD_HOSTNAME": hosts[host_index].name,
        }
        env.update(extra)
        envs.append(env)
    return envs


def settings_environment(args: argparse.Namespace) -> dict[str, str]:
    """The variables set by the flags (the same for every rank)."""
    env: dict[str, str] = {}
    if args.nics:
        # The engine's TCP transport takes the first name; NCCL takes the list.
        env["GLOO_SOCKET_IFNAME"] = args.nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(args.nics)
    if args.start_timeout is not None:
        env["HOROVOD_START_TIMEOUT"] = str(args.start_timeout)
    if args.timeline_filename:
        env["HOROVOD_TIMELINE"] = os.path.abspath(args.timeline_filename)
        if args.timeline_mark_cycles:
            env["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
    if args.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    if args.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = repr(args.cycle_time_ms)
    if args.hierarchical_allreduce is not None:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1" if args.hierarchical_allreduce else "0"
    if args.num_nccl_streams is not None:
        env["TIACC_TRAINING_NUM_NCCL_STREAMS"] = str(args.num_nccl_streams)
    return env


# -- starting ranks ----------------------------------------------------------


def ssh_base(args: argparse.Namespace, connect_timeout: float) -> list[str]:
    """The ``ssh`` command line up to the host."""
    command = [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=accept-new",
        "-o",
        f"ConnectTimeout={max(1, int(connect_timeout))}",
    ]
    if args.ssh_port is not None:
        command += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        command += ["-i", args.ssh_identity_file]
    return command


def remote_command(command: Sequence[str], cwd: str, env: dict[str, str]) -> str:
    """The shell text a remote host runs for a rank.

    It changes to ``cwd``, exports ``env``, starts the command and waits for
    it; when the ssh connection closes (tiaccrun ended it, or died), the
    rank gets SIGTERM, so no rank outlives the job.
    """
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return "\n".join(
        [
            f"cd {shlex.quote(cwd)} || exit 127",
            f"export {exports}" if exports else ":",
            # A background list's stdin is /dev/null unless redirected: keep
            # the connection's stdin as fd 3 for the watcher.
            "exec 3<&0",
            f"{shlex.join(command)} </dev/null 3<&- &",
            "pid=$!",
            # Reads the connection's stdin until it closes (builtins only).
            '( while read -r _; do :; done; kill -TERM "$pid" 2>/dev/null ) <&3 >/dev/null 2>&1 &',
            "watcher=$!",
            "trap 'kill -TERM \"$pid\" 2>/dev/null' TERM INT HUP",
            'wait "$pid"; rc=$?',
            'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done',
            'kill "$watcher" 2>/dev/null',
            'exit "$rc"',
        ]
    )


def forwarded_environment(environ: dict[str, str]) -> dict[str, str]:
    """The part of this process's environment remote ranks get."""
    return {k: v for k, v in environ.items() if _ENV_NAME.match(k) and not _NOT_FORWARDED.match(k)}


def check_ssh(args: argparse.Namespace, hosts: list[str], deadline: float) -> None:
    """Runs ``true`` on every remote host over ssh, all at once.

    Raises:
        UsageError: A host could not be reached by ``deadline``, or ssh
            failed (its message is included).
    """
    remaining = max(1.0, deadline - time.monotonic())
    procs = {
        host: subprocess.Popen(
            [*ssh_base(args, remaining), host, "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in hosts
    }
    failures = []
    for host, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failures.append(f"{host}: no answer within the start timeout")
            continue
        if proc.returncode != 0:
            failures.append(f"{host}: ssh exited with {proc.returncode}: {err.strip()}")
    if failures:
        raise UsageError(
            "ssh to these hosts failed (tiaccrun needs password-less ssh, "
            "see -p and -i):\n  " + "\n  ".join(failures)
        )


class _Output:
    """Copies a rank's stream line by line, prefixed, to the console and files."""

    def __init__(self, lock: threading.Lock, prefix: bool) -> None:
        self.lock = lock
        self.prefix = prefix
        self.threads: list[threading.Thread] = []

    def follow(
        self, stream: IO[bytes], rank: int, name: str, sink: IO[bytes], copy: IO[bytes] | None
    ) -> None:
        label = f"[{rank}]<{name}>:".encode()

        def pump() -> None:
            console = True
            with stream:
                for line in iter(stream.readline, b""):
                    if copy is not None:
                        copy.write(line)
                        copy.flush()
                    if not console:
                        continue  # keep reading, so that the rank never blocks
                    with self.lock:
                        try:
                            sink.write(label + line if self.prefix else line)
                            if not line.endswith(b"\n"):
                                sink.write(b"\n")
                            sink.flush()
                        except OSError:  # the console went away (a closed pipe)
                            console = False
            if copy is not None:
                copy.close()

        thread = threading.Thread(target=pump, name=f"rank{rank}-{name}", daemon=True)
        thread.start()
        self.threads.append(thread)

    def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class Job:
    """The ranks of one run: started, watched, and ended together."""

    def __init__(
        self,
        specs: list[RankSpec],
        command: list[str],
        args: argparse.Namespace,
        base_env: dict[str, str],
        log: Callable[[str], None],
    ) -> None:
        self.specs = specs
        self.command = command
        self.args = args
        self.base_env = base_env
        self.log = log
        self.procs: list[subprocess.Popen[bytes]] = []
        self.output = _Output(threading.Lock(), prefix=not args.no_prefix)
        # The signal tiaccrun got (SIGINT, SIGTERM, SIGHUP), once it got one.
        self.stopping: signal.Signals | None = None

    def start(self) -> None:
        """Starts every rank and the threads copying its output.

        Raises:
            UsageError: A rank's program (or ssh) cannot be started; the
                ranks already started are terminated.
        """
        width = len(str(len(self.specs) - 1))
        for spec in self.specs:
            try:
                self.launch(spec, width)
            except UsageError:
                self.terminate()
                raise

    def launch(self, spec: RankSpec, width: int) -> subprocess.Popen[bytes]:
        """Starts one rank (or elastic worker) and the threads copying its output.

        Args:
            spec: where it runs and its variables.
            width: digits of the ``--output-filename`` folder names.

        Raises:
            UsageError: its program (or ssh) cannot be started.
        """
        cwd = os.getcwd()
        forwarded = forwarded_environment(self.base_env)
        if spec.local:
            argv = list(self.command)
            env = {**self.base_env, **spec.env}
        else:
            remote_env = {**forwarded, **spec.env}
            argv = [
                *ssh_base(self.args, self.args.start_timeout or DEFAULT_START_TIMEOUT),
                spec.host,
                remote_command(self.command, cwd, remote_env),
            ]
            env = dict(self.base_env)
        if self.args.verbose:
            where = "locally" if spec.local else f"over ssh on {spec.host}"
            self.log(f"rank {spec.rank} {where}: {shlex.join(self.command)}")
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL if spec.local else subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            raise UsageError(f"rank {spec.rank}: cannot start {argv[0]!r}: {e}") from e
        self.procs.append(proc)
        copies: dict[str, IO[bytes] | None] = {"stdout": None, "stderr": None}
        if self.args.output_filename:
            folder = os.path.join(self.args.output_filename, f"rank.{spec.rank:0{width}d}")
            os.makedirs(folder, exist_ok=True)
            for name in copies:
                copies[name] = open(os.path.join(folder, name), "wb")  # noqa: SIM115
        assert proc.stdout is not None and proc.stderr is not None
        self.output.follow(proc.stdout, spec.rank, "stdout", sys.stdout.buffer, copies["stdout"])
        self.output.follow(proc.stderr, spec.rank, "stderr", sys.stderr.buffer, copies["stderr"])
        return proc

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Sends ``sig`` to every running rank, then kills what is left."""
        for proc in self.procs:
            self._signal(proc, sig)
        deadline = time.monotonic() + TERMINATE_GRACE
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                proc.wait()

    def _signal(self, proc: subprocess.Popen[bytes], sig: int) -> None:
        if proc.poll() is not None:
            return
        if proc.stdin is not None:  # an ssh rank: closing its stdin ends it remotely
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, rendezvous: RendezvousWatch | None) -> int:
        """Waits for the ranks; the first failure ends the job.

        Args:
            rendezvous: what must happen by its deadline (``--start-timeout``).

        Returns:
            The exit status of tiaccrun.
        """
        while True:
            if self.stopping is not None:
                self.log(f"{self.stopping.name}: terminating every rank")
                self.terminate()
                self.output.drain(5.0)
                return 128 + int(self.stopping)
            running = 0
            for spec, proc in zip(self.specs, self.procs):
                code = proc.poll()
                if code is None:
                    running += 1
                elif code != 0:
                    self.terminate()
                    self.output.drain(5.0)
                    self.log(self._describe_failure(spec, code))
                    return code if code > 0 else 128 - code
            if running == 0:
                self.output.drain(5.0)
                return 0
            if rendezvous is not None:
                if rendezvous.reached():
                    rendezvous = None
                elif time.monotonic() > rendezvous.deadline:
                    self.terminate()
                    self.output.drain(5.0)
                    self.log(
                        f"{rendezvous.missed} within the start timeout of "
                        f"{self.args.start_timeout:g} s; the job was ended"
                    )
                    return 1
            time.sleep(0.1)

    def _describe_failure(self, spec: RankSpec, code: int) -> str:
        where = "this host" if spec.local else "over ssh"
        if code < 0:
            try:
                what = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                what = f"was killed by signal {-code}"
        elif code == 255 and not spec.local:
            what = "exited with code 255 (the ssh connection failed, or the rank exited 255)"
        else:
            what = f"exited with code {code}"
            if code > 128:
                try:
                    what += f" (128 + {signal.Signals(code - 128).name}: killed by a signal)"
                except ValueError:
                    pass
        return f"rank {spec.rank} on {spec.host} ({where}) {what}; the other ranks were terminated"


# -- command line ------------------------------------------------------------


def _nic_action() -> type[argparse.Action]:
    class NicAction(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
            names = [n.strip() for n in str(values).split(",") if n.strip()]
            if not names:
                parser.error(f"{option_string}: no interface name")
            current = list(getattr(namespace, self.dest) or [])
            current += [n for n in names if n not in current]
            setattr(namespace, self.dest, current)

    return NicAction


def build_parser() -> argparse.ArgumentParser:
    """The flags, named as ``horovodrun`` names them."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Start a training job on this host or several (horovodrun's flags).",
    )
    parser.add_argument(
        "-np",
        "--num-proc",
        dest="num_proc",
        type=int,
        help="number of ranks (elastic: the slots to wait for before starting; default --min-np)",
    )
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument(
        "-H", "--hosts", help="hosts and slots: host1:2,host2:2 (default: localhost:<np>)"
    )
    hosts.add_argument("-hostfile", "--hostfile", help="a file of 'hostname slots=N' lines")
    parser.add_argument(
        "-p", "--ssh-port", dest="ssh_port", type=int, help="ssh port on every remote host"
    )
    parser.add_argument(
        "-i", "--ssh-identity-file", dest="ssh_identity_file", help="private key for ssh"
    )
    parser.add_argument(
        "--network-interface",
        "--network-interfaces",
        dest="nics",
        action=_nic_action(),
        help="interface(s) the ranks communicate over (comma-separated or "
        "repeated); the first also picks MASTER_ADDR",
    )
    parser.add_argument(
        "--start-timeout",
        dest="start_timeout",
        type=float,
        help="seconds for the ssh checks and the start of every rank, and "
        "for rank 0 to open the rendezvous (default: HOROVOD_START_TIMEOUT "
        f"or {DEFAULT_START_TIMEOUT:g}; the rendezvous is watched only when "
        "set)",
    )
    parser.add_argument(
        "--output-filename",
        dest="output_filename",
        help="also write each rank's output to <dir>/rank.<rank>/stdout and stderr",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print the placement and each rank's command"
    )
    parser.add_argument(
        "--no-prefix",
        dest="no_prefix",
        action="store_true",
        help="print the ranks' lines without the [rank]<stream>: prefix",
    )
    timeline = parser.add_argument_group("timeline")
    timeline.add_argument(
        "--timeline-filename",
        dest="timeline_filename",
        help="record the Horovod timeline there (HOROVOD_TIMELINE)",
    )
    timeline.add_argument(
        "--timeline-mark-cycles",
        dest="timeline_mark_cycles",
        action="store_true",
        help="HOROVOD_TIMELINE_MARK_CYCLES=1 (accepted; the engine has no cycle to mark)",
    )
    tuning = parser.add_argument_group("settings handed to the ranks")
    tuning.add_argument(
        "--fusion-threshold-mb",
        dest="fusion_threshold_mb",
        type=float,
        help="HOROVOD_FUSION_THRESHOLD in MiB",
    )
    tuning.add_argument(
        "--cycle-time-ms", dest="cycle_time_ms", type=float, help="HOROVOD_CYCLE_TIME in ms"
    )
    hier = tuning.add_mutually_exclusive_group()
    hier.add_argument(
        "--hierarchical-allreduce",
        dest="hierarchical_allreduce",
        action="store_const",
        const=True,
        help="HOROVOD_HIERARCHICAL_ALLREDUCE=1 (the engine's 2D allreduce)",
    )
    hier.add_argument(
        "--no-hierarchical-allreduce",
        dest="hierarchical_allreduce",
        action="store_const",
        const=False,
        help="HOROVOD_HIERARCHICAL_ALLREDUCE=0 (the flat ring)",
    )
    tuning.add_argument(
        "--num-nccl-streams",
        dest="num_nccl_streams",
        type=int,
        help="TIACC_TRAINING_NUM_NCCL_STREAMS (channels)",
    )
    elastic = parser.add_argument_group("elastic training")
    elastic.add_argument(
        "--host-discovery-script",
        dest="host_discovery_script",
        help="run the job elastically: this executable prints the usable hosts, one "
        "'host' or 'host:slots' per line (run every second)",
    )
    elastic.add_argument(
        "--min-np", dest="min_np", type=int, help="fewest workers to train with (default -np)"
    )
    elastic.add_argument(
        "--max-np", dest="max_np", type=int, help="most workers to train with (default: all slots)"
    )
    elastic.add_argument(
        "--slots-per-host",
        "--slots",
        dest="slots_per_host",
        type=int,
        help="slots of a discovered host that gives none (default 1)",
    )
    elastic.add_argument(
        "--elastic-timeout",
        dest="elastic_timeout",
        type=float,
        help="seconds to wait for --min-np slots (and for a worker's next round); default "
        f"HOROVOD_ELASTIC_TIMEOUT or {DEFAULT_ELASTIC_TIMEOUT:g}",
    )
    elastic.add_argument(
        "--reset-limit",
        dest="reset_limit",
        type=int,
        help="most new rounds (workers lost or added) before the job fails (default: no limit)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command of every rank")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses and checks the command line (argparse exits with 2 on errors)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command to run (tiaccrun -np 2 python train.py)")
    _check_elastic(parser, args)
    if args.num_proc is None:
        parser.error("-np/--num-proc is required (or --min-np with --host-discovery-script)")
    if args.num_proc < 1:
        parser.error(f"-np/--num-proc must be at least 1, got {args.num_proc}")
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        parser.error(f"-p/--ssh-port {args.ssh_port}: not a TCP port")
    if args.start_timeout is None and os.environ.get("HOROVOD_START_TIMEOUT"):
        value = os.environ["HOROVOD_START_TIMEOUT"]
        try:
            args.start_timeout = float(value)
        except ValueError:
            parser.error(f"HOROVOD_START_TIMEOUT={value!r}: expected seconds")
    if args.start_timeout is not None and args.start_timeout <= 0:
        parser.error(f"--start-timeout must be positive, got {args.start_timeout:g}")
    if args.fusion_threshold_mb is not None and args.fusion_threshold_mb < 0:
        parser.error("--fusion-threshold-mb must be >= 0")
    if args.num_nccl_streams is not None and not 1 <= args.num_nccl_streams <= 64:
        parser.error("--num-nccl-streams must be 1-64")
    return args


_ELASTIC_FLAGS = {
    "min_np": "--min-np",
    "max_np": "--max-np",
    "slots_per_host": "--slots-per-host",
    "elastic_timeout": "--elastic-timeout",
    "reset_limit": "--reset-limit",
}


def _check_elastic(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks the elastic flags and fills in their defaults."""
    if not args.host_discovery_script:
        given = [flag for dest, flag in _ELASTIC_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            parser.error(f"{', '.join(given)} need --host-discovery-script (an elastic job)")
        return
    script = args.host_discovery_script
    if not os.path.isfile(script) or not os.access(script, os.X_OK):
        parser.error(f"--host-discovery-script {script}: not an executable file")
    if args.hosts or args.hostfile:
        parser.error("-H/--hostfile and --host-discovery-script exclude each other")
    if args.num_proc is None:
        args.num_proc = args.min_np
    for dest in ("num_proc", "min_np", "max_np", "slots_per_host"):
        value = getattr(args, dest)
        if value is not None and value < 1:
            parser.error(f"{_ELASTIC_FLAGS.get(dest, '-np')} must be at least 1, got {value}")
    if args.reset_limit is not None and args.reset_limit < 0:
        parser.error(f"--reset-limit must be >= 0, got {args.reset_limit}")
    if args.num_proc is None:
        return  # the caller names -np
    if args.min_np is None:
        args.min_np = args.num_proc
    if args.min_np > args.num_proc:
        parser.error(f"--min-np {args.min_np} is more than -np {args.num_proc}")
    if args.max_np is not None and args.max_np < args.num_proc:
        parser.error(f"--max-np {args.max_np} is less than -np {args.num_proc}")
    if args.slots_per_host is None:
        args.slots_per_host = 1
    if args.elastic_timeout is None:
        value = os.environ.get("HOROVOD_ELASTIC_TIMEOUT", "").strip()
        try:
            args.elastic_timeout = float(value) if value else DEFAULT_ELASTIC_TIMEOUT
        except ValueError:
            parser.error(f"HOROVOD_ELASTIC_TIMEOUT={value!r}: expected seconds")
    if args.elastic_timeout <= 0:
        parser.error(f"--elastic-timeout must be positive, got {args.elastic_timeout:g}")


def plan(args: argparse.Namespace) -> Plan:
    """Hosts, ranks and the rendezvous of the job.

    No process is started. Without ``MASTER_PORT`` and with rank 0 on this
    machine, the store is opened here (:func:`host_store`) and the ranks
    are told to join it (``TORCHELASTIC_USE_AGENT_STORE=True``); otherwise
    rank 0 hosts it (``TORCHELASTIC_USE_AGENT_STORE=False``, whatever this
    process's environment says).

    Raises:
        UsageError: Bad hosts, too few slots, an unusable interface or a
            store that cannot be opened.
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
    first = used[0]
    if all(local[h] for h in used):
        master_addr = "127.0.0.1"
    elif local[first]:
        if args.nics:
            master_addr = interface_address(args.nics[0])
        else:
            remote = next(hosts[h].name for h in used if not local[h])
            master_addr = route_address(remote)
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
    specs = [
        RankSpec(rank, hosts[h].name, local[h], env)
        for rank, ((h, _), env) in enumerate(zip(placement, envs))
    ]
    return Plan(hosts, specs, master_addr, master_port, store)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the job; returns tiaccrun's exit status."""
    args = parse_args(argv)

    def log(message: str) -> None:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)

    if args.host_discovery_script:
        return run_elastic(args, log)
    try:
        job_plan = plan(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    specs, master_port = job_plan.specs, job_plan.master_port
    start_timeout = args.start_timeout or DEFAULT_START_TIMEOUT
    deadline = time.monotonic() + start_timeout
    remote_hosts = sorted({s.host for s in specs if not s.local})
    if args.verbose:
        for spec in specs:
            kind = "local" if spec.local else "ssh"
            log(
                f"rank {spec.rank}: {spec.host} ({kind}), local rank "
                f"{spec.env['LOCAL_RANK']} of {spec.env['LOCAL_WORLD_SIZE']}"
            )
        host = "tiaccrun" if job_plan.store is not None else "rank 0"
        log(f"rendezvous at {job_plan.master_addr}:{master_port} (the store hosted by {host})")
    try:
        if remote_hosts:
            check_ssh(args, remote_hosts, deadline)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1

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

    def store_address(names: list[str]) -> str:
        if args.nics:
            return interface_address(args.nics[0])
        remote = [h for h in names if not is_local(h, addresses)]
        return route_address(remote[0]) if remote else "127.0.0.1"

    def environments(names: list[str], placement: list[tuple[int, int]]) -> list[dict[str, str]]:
        assert driver is not None
        hosts = [Host(name, 1) for name in names]
        address, port = driver.store_address, driver.store.port
        return rank_environments(hosts, placement, address, port, extra)

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
