"""tiaccrun's ranks: started here or over ssh, their output copied, watched and ended together.

``Job`` starts each rank (``RankSpec``: its host and variables) as a child
process, or over ``ssh`` with :func:`remote_command`, copies its output
line by line with its prefix, and ends every rank when one fails or a
signal comes.
"""

from __future__ import annotations

import argparse
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
from tiacc_training.tools._tiaccrun_hosts import UsageError

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
