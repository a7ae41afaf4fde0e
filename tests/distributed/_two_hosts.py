"""Two hosts on one machine, for the multi-host tests: network namespaces with real sshd.

:func:`two_hosts` makes two network namespaces named after the test process,
joined by one veth pair whose ends have a different name on each host
(``etha0`` on host A, ``ensb1`` on host B: names no tool treats as virtual),
each end shaped to 1 Gbit/s. Each namespace gets, under ``/etc/netns/<ns>/``
(which ``ip netns exec`` mounts over ``/etc``):

- ``hosts`` as stock Debian writes it: ``127.0.0.1 localhost`` and
  ``127.0.1.1 <hostname>`` (the machine's name: namespaces share the UTS
  name, so both hosts have the same one), then the aliases ``hosta`` and
  ``hostb`` with their link addresses;
- ``ssh/ssh_config``, the ssh client's configuration there: the known hosts
  are a file of the cluster's, written beforehand with both host keys, so
  ssh neither asks nor writes ``~/.ssh/known_hosts``.

Each host runs its own ``sshd`` (``ip netns exec NS sshd -D -e -f CONFIG``,
a child of this process) on its link address, port 22 of its namespace,
taking root's logins with the cluster's ed25519 key only. A command started
on host A (:meth:`TwoHosts.popen`) reaches host B with plain ``ssh -i KEY
hostb CMD``, as ``tiaccrun`` does; the hosts share the file system, so the
remote end runs the same Python and sees the same files.

Leaving the ``with`` block stops everything that runs in the two namespaces
(the sshds, their sessions, what the tests started there), deletes the
namespaces (the veth pair goes with them) and their ``/etc/netns`` folders;
it then checks that ssh left root's ``~/.ssh`` as it was. The namespaces of
a test process killed before its teardown are removed by the next
:func:`two_hosts` (:func:`remove_stale`).

Needs root, iproute2 (``ip``, ``tc``), OpenSSH's server and client;
:class:`Unavailable` says which is missing. Run this file to bring the two
hosts up, check ssh both ways and take them down again.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SSHD = "/usr/sbin/sshd"
# A /24 of the link; the benchmarks' emulated nodes use 10.231.77.0/24. The
# addresses only exist inside the namespaces, so concurrent clusters do not
# collide.
SUBNET = "10.231.78"
SSH_PORT = 22
RATE_MBIT = 1000.0
# The shaper's bucket: what the link carries in 10 ms (a timer tick at HZ=100),
# at least 256 KiB (tools/netns_cluster.py's burst_bytes).
MIN_BURST_BYTES = 256 * 1024
NETNS_ETC = Path("/etc/netns")
# Seconds sshd gets to listen, and a process to exit after SIGTERM.
START_TIMEOUT = 20.0
STOP_GRACE = 5.0

_clusters = itertools.count()


class Unavailable(Exception):
    """Two hosts cannot be emulated here; the message says why (a test skips)."""


@dataclass(frozen=True)
class Host:
    """One emulated host.

    Attributes:
        alias: its name in both hosts' ``/etc/hosts`` (``hosta``, ``hostb``).
        netns: its network namespace.
        nic: its end of the link (the only interface besides ``lo``).
        address: its IPv4 address on the link.
    """

    alias: str
    netns: str
    nic: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host (inside its namespace)."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass(frozen=True)
class Process:
    """A process of the machine, as ``/proc`` shows it."""

    pid: int
    cmdline: str


@dataclass
class TwoHosts:
    """Two hosts up, each with its sshd; see the module's docstring.

    Attributes:
        a: host A (``hosta``, NIC ``etha0``).
        b: host B (``hostb``, NIC ``ensb1``).
        folder: the cluster's files: keys, known hosts, sshd configs and logs.
        key: the private key root's logins take on both hosts (``ssh -i``).
        port: the port sshd listens on, on both hosts (``ssh -p``).
        hostname: the machine's host name (both hosts', at 127.0.1.1).
    """

    a: Host
    b: Host
    folder: Path
    key: Path
    port: int = SSH_PORT
    hostname: str = ""
    sshds: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def hosts(self) -> tuple[Host, Host]:
        """Both hosts, A first."""
        return (self.a, self.b)

    def popen(self, host: Host, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Starts ``argv`` on ``host``; ``kwargs`` go to ``subprocess.Popen``.

        The process starts a session of its own (so a test can signal the
        whole of it) unless ``start_new_session`` says otherwise.
        """
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(host.command(argv), **kwargs)

    def run(
        self, host: Host, argv: Sequence[str], timeout: float = 60.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` on ``host`` to its end, its output captured as text.

        Raises:
            subprocess.TimeoutExpired: It ran past ``timeout`` seconds (it
                was killed).
        """
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(host.command(argv), timeout=timeout, **kwargs)

    def ssh(self, target: Host, command: str) -> list[str]:
        """The ssh command line that runs ``command`` on ``target`` (as tiaccrun builds it)."""
        return [
            "ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
            "-o", "ConnectTimeout=10", "-p", str(self.port), "-i", str(self.key),
            target.alias, command,
        ]  # fmt: skip

    def processes(self, host: Host) -> list[Process]:
        """The live processes in ``host``'s namespace, its sshd's listener aside."""
        listener = self.sshds.get(host.netns)
        skip = {listener.pid} if listener is not None and listener.poll() is None else set()
        return [p for p in netns_processes(host.netns) if p.pid not in skip]

    def wait_idle(self, limit: float = 15.0) -> list[Process]:
        """Waits up to ``limit`` s until nothing but the sshds runs on the hosts.

        Returns:
            What still runs on either host then (``[]`` once idle).
        """
        deadline = time.monotonic() + limit
        while True:
            left = [p for host in self.hosts for p in self.processes(host)]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def sshd_logs(self) -> str:
        """Both sshds' logs, for a failure's message."""
        texts = []
        for host in self.hosts:
            log = self.folder / f"sshd-{host.alias}.log"
            text = log.read_text(errors="replace") if log.exists() else "(none)"
            texts.append(f"--- sshd on {host.alias}:\n{text}")
        return "\n".join(texts)


# -- processes ---------------------------------------------------------------


def _state(pid: int) -> str:
    """The process's state letter (``Z`` for a zombie), ``""`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    return _state(pid) not in ("", "Z")


def _cmdline(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def processes_with(text: str) -> list[Process]:
    """Every live process of the machine whose command line contains ``text``."""
    found = []
    for pid in _pids():
        cmdline = _cmdline(pid)
        if cmdline is not None and text in cmdline and alive(pid):
            found.append(Process(pid, cmdline))
    return found


def netns_processes(netns: str) -> list[Process]:
    """The live processes whose network namespace is ``netns`` (``ip netns pids``)."""
    try:
        ns = os.stat(f"/run/netns/{netns}")
    except OSError:
        return []
    found = []
    for pid in _pids():
        try:
            st = os.stat(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (ns.st_dev, ns.st_ino) and alive(pid):
            found.append(Process(pid, _cmdline(pid) or ""))
    return found


def _stop(pids: Sequence[int]) -> None:
    """SIGTERM to ``pids``, SIGKILL to those left after ``STOP_GRACE`` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + STOP_GRACE
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [p for p in pids if alive(p)]
        if not pids:
            return


# -- set-up ------------------------------------------------------------------

# The namespaces' names: the owner's pid in hex, its cluster's number, the host.
PREFIX = "tiacc-2h"
_OWNED = re.compile(rf"^{PREFIX}-([0-9a-f]+)-\d+-[ab]$")


def unavailable() -> str | None:
    """Why two hosts cannot be emulated here (before trying), or ``None``."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and sshd)"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (iproute2, openssh-client)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is missing (install openssh-server)"
    return None


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _hosts_file(hostname: str, hosts: Sequence[Host]) -> str:
    lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{hostname}"]
    lines += [f"{h.address}\t{h.alias}" for h in hosts]
    lines += ["", "::1\tlocalhost ip6-localhost ip6-loopback"]
    return "\n".join(lines) + "\n"


def _ssh_config(folder: Path) -> str:
    # The command line's -o (StrictHostKeyChecking=accept-new) wins over
    # these; with both keys known beforehand nothing is ever added.
    return (
        "Host *\n"
        f"    UserKnownHostsFile {folder / 'known_hosts'}\n"
        "    GlobalKnownHostsFile /dev/null\n"
        "    HashKnownHosts no\n"
        "    UpdateHostKeys no\n"
        "    LogLevel ERROR\n"
    )


def _sshd_config(folder: Path, host: Host, port: int) -> str:
    return (
        f"ListenAddress {host.address}:{port}\n"
        f"HostKey {folder / f'host_key_{host.alias}'}\n"
        f"PidFile {folder / f'sshd-{host.alias}.pid'}\n"
        f"AuthorizedKeysFile {folder / 'authorized_keys'}\n"
        "PermitRootLogin prohibit-password\n"
        "PubkeyAuthentication yes\n"
        "AuthenticationMethods publickey\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "PermitUserRC no\n"
        "PermitUserEnvironment no\n"
        "X11Forwarding no\n"
        "PrintMotd no\n"
        "PrintLastLog no\n"
        "UseDNS no\n"
        "MaxStartups 100\n"
        "LoginGraceTime 30\n"
    )


def _keygen(path: Path, comment: str) -> str:
    """A new ed25519 key pair without passphrase at ``path``; its public line."""
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])
    return Path(f"{path}.pub").read_text().strip()


def _home_ssh() -> Path:
    return Path(pwd.getpwuid(os.getuid()).pw_dir) / ".ssh"


def _snapshot(folder: Path) -> dict[str, tuple[int, int]] | None:
    """Each file under ``folder`` with its size and mtime; ``None`` when absent."""
    if not folder.exists():
        return None
    found = {}
    for path in [folder, *folder.rglob("*")]:
        with contextlib.suppress(OSError):
            st = path.stat()
            found[str(path)] = (st.st_size, st.st_mtime_ns)
    return found


def _wait_listening(cluster: TwoHosts, host: Host, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    proc = cluster.sshds[host.netns]
    while "Server listening on" not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            raise RuntimeError(
                f"sshd on {host.alias} exited ({proc.returncode}):\n{log.read_text()}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd on {host.alias} not listening after {START_TIMEOUT:g} s")
        time.sleep(0.05)


def _up(cluster: TwoHosts, rate_mbit: float) -> None:
    """Namespaces, link, files and sshds of ``cluster`` (``_down`` undoes it)."""
    a, b = cluster.hosts
    for host in cluster.hosts:
        done = subprocess.run(["ip", "netns", "add", host.netns], capture_output=True, text=True)
        if done.returncode != 0:
            raise Unavailable(f"'ip netns add' failed: {done.stderr.strip()}")
    # Both ends made inside their namespaces: no name ever shows in this one.
    peer = ["peer", "name", b.nic, "netns", b.netns]
    _run(["ip", "link", "add", a.nic, "netns", a.netns, "type", "veth", *peer])
    for host in cluster.hosts:
        _run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
        _run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.nic])
        _run(["ip", "-n", host.netns, "link", "set", host.nic, "up"])
        if rate_mbit > 0 and shutil.which("tc"):
            burst = max(MIN_BURST_BYTES, round(rate_mbit * 1e6 / 8 / 100))
            shaper = ["rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "100ms"]
            _run(host.command(["tc", "qdisc", "add", "dev", host.nic, "root", "tbf", *shaper]))

    folder = cluster.folder
    folder.mkdir(parents=True, exist_ok=True)
    client = _keygen(cluster.key, "two-hosts-client")
    (folder / "authorized_keys").write_text(client + "\n")
    known = []
    for host in cluster.hosts:
        public = _keygen(folder / f"host_key_{host.alias}", f"two-hosts-{host.alias}")
        names = [host.alias, host.address]
        if cluster.port != 22:
            names = [f"[{n}]:{cluster.port}" for n in names]
        known.append(f"{','.join(names)} {' '.join(public.split()[:2])}")
    (folder / "known_hosts").write_text("\n".join(known) + "\n")
    for host in cluster.hosts:
        etc = NETNS_ETC / host.netns
        (etc / "ssh").mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(_hosts_file(cluster.hostname, cluster.hosts))
        (etc / "ssh" / "ssh_config").write_text(_ssh_config(folder))
        (folder / f"sshd-{host.alias}.conf").write_text(_sshd_config(folder, host, cluster.port))
    # sshd's privilege separation folder (the Debian package makes it at boot).
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)

    for host in cluster.hosts:
        log = folder / f"sshd-{host.alias}.log"
        with open(log, "wb") as out:
            cluster.sshds[host.netns] = cluster.popen(
                host,
                [SSHD, "-D", "-e", "-f", str(folder / f"sshd-{host.alias}.conf")],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
    for host in cluster.hosts:
        _wait_listening(cluster, host, folder / f"sshd-{host.alias}.log")
    # Logins both ways: each host reaches the other by its alias, as itself.
    for here, there in ((a, b), (b, a)):
        done = cluster.run(here, cluster.ssh(there, "cat /proc/net/dev"), timeout=60)
        if done.returncode != 0 or f"{there.nic}:" not in done.stdout:
            logs = cluster.sshd_logs()
            hint = ""
            if "account is locked" in logs:
                # sshd without PAM refuses a locked account (a "!" password
                # in /etc/shadow) even with a key.
                hint = "\nroot's account is locked: give it the password '*' (usermod -p '*' root)"
            raise RuntimeError(
                f"ssh from {here.alias} to {there.alias} failed ({done.returncode}): "
                f"{done.stdout}{done.stderr}\n{logs}{hint}"
            )


def remove_stale() -> list[str]:
    """Removes the namespaces of clusters whose process died before its teardown.

    A test process killed outright (SIGKILL, a CI job cut off) leaves its
    namespaces, their sshds and sessions behind: what runs in them was
    started there by that cluster, and is stopped.

    Returns:
        The namespaces removed.
    """
    try:
        names = os.listdir("/run/netns")
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        match = _OWNED.match(name)
        if match is None or alive(int(match[1], 16)):
            continue
        _stop([p.pid for p in netns_processes(name)])
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        removed.append(name)
    return removed


def _down(cluster: TwoHosts, created_etc: bool) -> None:
    """Stops what runs on the hosts, then deletes their namespaces and files."""
    for proc in cluster.sshds.values():
        if proc.poll() is None:
            proc.terminate()
    for proc in cluster.sshds.values():
        try:
            proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # What runs there now was started there by this cluster: sshd's
    # sessions and what they or the tests started.
    _stop([p.pid for host in cluster.hosts for p in netns_processes(host.netns)])
    for host in cluster.hosts:
        subprocess.run(["ip", "netns", "delete", host.netns], capture_output=True)
        shutil.rmtree(NETNS_ETC / host.netns, ignore_errors=True)
    if created_etc:
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only when empty: another cluster may use it


@contextlib.contextmanager
def two_hosts(folder: Path | None = None, rate_mbit: float = RATE_MBIT) -> Iterator[TwoHosts]:
    """Two hosts with their sshds for the ``with`` block; see the module's docstring.

    Args:
        folder: where the cluster's files go (a new temporary folder, removed
            at the end, when ``None``).
        rate_mbit: the link's rate in each direction; 0 leaves it unshaped.

    Raises:
        Unavailable: Not root, a tool is missing, or namespaces cannot be
            made here.
        RuntimeError: The hosts could not be set up, or ssh altered root's
            ``~/.ssh`` (a bug of this module).
    """
    reason = unavailable()
    if reason is not None:
        raise Unavailable(reason)
    own = folder is None
    folder = Path(tempfile.mkdtemp(prefix="two-hosts-")) if folder is None else folder
    tag = f"{os.getpid():x}-{next(_clusters)}"
    cluster = TwoHosts(
        a=Host("hosta", f"{PREFIX}-{tag}-a", "etha0", f"{SUBNET}.1"),
        b=Host("hostb", f"{PREFIX}-{tag}-b", "ensb1", f"{SUBNET}.2"),
        folder=folder,
        key=folder / "id_ed25519",
        hostname=socket.gethostname(),
    )
    home_ssh = _home_ssh()
    before = _snapshot(home_ssh)
    created_etc = not NETNS_ETC.exists()
    try:
        remove_stale()
        _up(cluster, rate_mbit)
        yield cluster
    finally:
        _down(cluster, created_etc)
        if own:
            shutil.rmtree(folder, ignore_errors=True)
    after = _snapshot(home_ssh)
    if after != before:
        raise RuntimeError(f"ssh altered {home_ssh}: before {before}, after {after}")


def main() -> int:
    """Brings two hosts up, shows ssh working both ways, takes them down."""
    try:
        with two_hosts() as cluster:
            for here, there in (cluster.hosts, cluster.hosts[::-1]):
                done = cluster.run(
                    here, cluster.ssh(there, "ip -br addr; getent hosts $(hostname)")
                )
                print(f"{here.alias} -> ssh {there.alias}: rc {done.returncode}")
                print(done.stdout + done.stderr, end="")
    except Unavailable as e:
        print(f"two hosts unavailable: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
