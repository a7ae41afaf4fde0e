"""tiaccrun's ranks: started here or over ssh, their output copied, watched and ended together.

``Job`` starts each rank (``RankSpec``: its host and variables) as a child
process, or over ``ssh`` with :func:`remote_command`, copies its output
line by line with its prefix, and ends every rank when one fails or a
signal comes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Callable

from tiacc_training.tools._tiaccrun_flags import DEFAULT_START_TIMEOUT
from tiacc_training.tools._tiaccrun_hosts import Interface, UnreachableHost, UsageError

# Seconds a rank gets to exit after SIGTERM before it is killed.
TERMINATE_GRACE = 10.0
# Variables of this process that are not handed to remote ranks: they
# describe this shell or this machine, not the job.
_NOT_FORWARDED = re.compile(
    r"^(HOSTNAME|HOST|PWD|OLDPWD|SHLVL|_|SHELL|TERM|TERMCAP|DISPLAY|XAUTHORITY|"
    r"SSH_.*|BASH_FUNC_.*|LS_COLORS|MAIL|USER|LOGNAME|HOME|TMUX.*|STY|WINDOW)$"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class RankSpec:
    """Where a rank runs and what it is told."""

    rank: int
    host: str
    local: bool
    env: dict[str, str] = field(default_factory=dict)


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


def remote_command(command: Sequence[str], cwd: str, watch: bool = True) -> str:
    """The shell text a remote host runs for a rank (or, ``watch`` false, a probe).

    It holds no variable of the job: it first reads them from the
    connection's stdin (:func:`environment_block`, a line count first), so
    that no value (a token, a cloud key) is ever on a command line, where
    every user of either host could read it. It then changes to ``cwd``,
    starts the command and waits for it, quietly (a rank killed by a signal
    is reported by tiaccrun, not by the shell); when the ssh connection
    closes (tiaccrun ended it, or died), the rank gets SIGTERM, so no rank
    outlives the job. Without ``watch`` the command simply replaces the
    shell once the variables are read (its stdin closed).
    """
    setup = [
        # POSIX sh (a login shell may be dash): the count of lines, then them.
        "IFS= read -r job_lines || exit 126",
        "job_env=",
        'while [ "$job_lines" -gt 0 ]; do IFS= read -r job_line || exit 126',
        '  job_env="$job_env$job_line',
        '"; job_lines=$((job_lines - 1)); done',
        'eval "$job_env"; unset job_env job_line job_lines',
        f"cd {shlex.quote(cwd)} || exit 127",
    ]
    if not watch:
        return "\n".join([*setup, f"exec {shlex.join(command)} </dev/null"])
    return "\n".join(
        [
            *setup,
            # A background list's stdin is /dev/null unless redirected: keep
            # the connection's stdin as fd 3 for the watcher.
            "exec 3<&0",
            f"{shlex.join(command)} </dev/null 3<&- &",
            "pid=$!",
            # Reads the connection's stdin until it closes (builtins only).
            '( while read -r _; do :; done; kill -TERM "$pid" 2>/dev/null ) <&3 >/dev/null 2>&1 &',
            "watcher=$!",
            "trap 'kill -TERM \"$pid\" 2>/dev/null' TERM INT HUP",
            'wait "$pid" 2>/dev/null; rc=$?',
            'while kill -0 "$pid" 2>/dev/null; do wait "$pid" 2>/dev/null; rc=$?; done',
            'kill "$watcher" 2>/dev/null',
            'exit "$rc"',
        ]
    )


def environment_block(env: dict[str, str]) -> bytes:
    """What :func:`remote_command` reads first from stdin: ``env`` as exports.

    The number of lines comes first (a value may span lines), so that the
    shell reads exactly the block and leaves the rest of stdin (the
    connection's end) to the rank's watcher.
    """
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
    return f"{exports.count(chr(10))}\n{exports}".encode()


def describe_exit(code: int, over_ssh: bool = False) -> str:
    """How a rank's (or worker's) non-zero exit status reads in tiaccrun's line.

    A negative status is the signal that killed a local process; over ssh
    (and for a shell) a status of 128 + N is taken as killed by signal N.
    """
    signum = -code if code < 0 else code - 128 if code > 128 else 0
    if signum:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"was killed by {name}" + (f" (exit code {code})" if code > 0 else "")
    if code == 255 and over_ssh:
        return "exited with code 255 (the ssh connection failed, or the rank exited 255)"
    return f"exited with code {code}"


def forwarded_environment(environ: dict[str, str]) -> dict[str, str]:
    """The part of this process's environment remote ranks get."""
    return {k: v for k, v in environ.items() if _ENV_NAME.match(k) and not _NOT_FORWARDED.match(k)}


# The module a remote host runs to list its interfaces (see check_ssh).
PROBE_MODULE = "tiacc_training.tools._tiaccrun_probe"


def probe_interpreter(command: Sequence[str]) -> str:
    """The Python that lists a remote host's interfaces: the job's, when it runs Python."""
    first = command[0] if command else ""
    return first if os.path.basename(first).startswith("python") else "python3"


def check_ssh(
    args: argparse.Namespace,
    hosts: list[str],
    deadline: float,
    command: Sequence[str] = ("python3",),
    env: dict[str, str] | None = None,
) -> dict[str, list[Interface] | None]:
    """Reaches every remote host over ssh, all at once, and lists its interfaces.

    Each host runs :data:`PROBE_MODULE` with the job's interpreter
    (:func:`probe_interpreter` of ``command``), in this directory and with
    ``env`` (sent over stdin, as the ranks' variables are).

    Returns:
        Each host's interfaces, ``None`` for a host that ssh reached but
        that could not list them (its ranks then get no interface).

    Raises:
        UnreachableHost: A host could not be reached by ``deadline``, or ssh
            failed (its message is included).
    """
    remaining = max(1.0, deadline - time.monotonic())
    probe = remote_command([probe_interpreter(command), "-m", PROBE_MODULE], os.getcwd(), False)
    block = environment_block(env or {})
    procs = {
        host: subprocess.Popen(
            [*ssh_base(args, remaining), host, probe],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for host in hosts
    }
    failures = []
    found: dict[str, list[Interface] | None] = {}
    for host, proc in procs.items():
        try:
            out, err = proc.communicate(block, timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failures.append(f"{host}: no answer within the start timeout")
            continue
        if proc.returncode == 255:
            failures.append(f"{host}: ssh exited with 255: {err.decode(errors='replace').strip()}")
            continue
        try:
            listed = json.loads(out.decode()) if proc.returncode == 0 else None
            found[host] = [(str(n), str(a), None if p is None else int(p)) for n, a, p in listed]
        except (ValueError, TypeError):
            found[host] = None
    if failures:
        raise UnreachableHost(
            "ssh to these hosts failed (tiaccrun needs password-less ssh, "
            "see -p and -i):\n  " + "\n  ".join(failures)
        )
    return found


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
        block = b""
        if spec.local:
            argv = list(self.command)
            env = {**self.base_env, **spec.env}
        else:
            block = environment_block({**forwarded, **spec.env})
            argv = [
                *ssh_base(self.args, self.args.start_timeout or DEFAULT_START_TIMEOUT),
                spec.host,
                remote_command(self.command, cwd),
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
        if proc.stdin is not None:  # the job's variables, never on a command line
            try:
                proc.stdin.write(block)
                proc.stdin.flush()
            except OSError:
                pass  # ssh already ended: its exit status says why
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
        what = describe_exit(code, over_ssh=not spec.local)
        return f"rank {spec.rank} on {spec.host} ({where}) {what}; the other ranks were terminated"
