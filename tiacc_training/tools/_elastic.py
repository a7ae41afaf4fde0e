"""tiaccrun's elastic driver: hosts that come and go, workers in rounds.

``tiaccrun --host-discovery-script SCRIPT`` runs the job elastically, as
``horovodrun`` does:

- every second the script is run; each line of its output is a host that
  may run workers now, ``host`` or ``host:slots`` (``--slots-per-host``
  otherwise);
- the driver keeps one worker per slot of each usable host, up to
  ``--max-np``, and starts the job once ``-np`` slots are there (within
  ``--elastic-timeout``);
- the workers form their worlds in rounds through the driver's store
  (``tiacc_training.torch.horovod._rounds``): a new round when hosts are
  added or removed, when a worker fails (its host is then not used again)
  and when a worker asks for one after a failed collective;
- a host whose worker failed is not used again, or, with
  ``--blacklist-cooldown-range MIN MAX`` (Horovod's), only for a cooldown:
  MIN seconds times 2 to the number of its failures, plus up to MIN at
  random, at most MAX; a failure during the cooldown does not lengthen it;
- a worker starts with its first round's variables, and
  ``TORCHELASTIC_USE_AGENT_STORE=True`` with ``MASTER_ADDR`` and
  ``MASTER_PORT`` at the driver's store, so that a script calling
  ``init_process_group()`` itself joins that store as torchrun's workers
  join the agent's (``TORCHELASTIC_RESTART_COUNT`` is the round);
- fewer than ``--min-np`` slots for longer than ``--elastic-timeout``, or
  more new rounds than ``--reset-limit``, end the job with an error;
- the job succeeds when the workers of the current round have all exited
  with 0.

tiaccrun hands the driver what it knows of hosts and processes
(:class:`Launcher`); the driver owns the store, the rounds and the workers'
lives.
"""

from __future__ import annotations

import datetime
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from tiacc_training.tools._tiaccrun_job import describe_exit
from tiacc_training.torch.horovod import _rounds

DISCOVERY_INTERVAL = 1.0
DISCOVERY_TIMEOUT = 30.0
_TICK = 0.1
# How long a worker's request for a new round waits for a worker's exit: the
# peer that broke the failed collective is often a worker that is dying, and
# the request can come before its exit does.
DEATH_GRACE = 1.0


# The variables that make a worker's own init_process_group() join the
# driver's store (torchrun's names for its agent's store and attempt).
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


class ElasticError(Exception):
    """The elastic job cannot go on; the message says why."""


@dataclass
class Launcher:
    """What the driver needs from tiaccrun.

    Attributes:
        parse_hosts: the discovery script's lines (joined by commas) into
            ``[(host, slots)]``; raises ``ValueError`` naming a bad line.
        environments: a round's variables: given the hosts (in order) and
            each member's ``(host index, local rank)``, one dict per member.
        spawn: starts a worker ``(label, host, slot, env)``; returns its
            process.
        stop: sends a signal to a worker's process (and what it started).
        log: prints a line of tiaccrun's.
        store_address: the address of this machine the workers on these
            hosts reach the driver's store at.
    """

    parse_hosts: Callable[[str], list[tuple[str, int]]]
    environments: Callable[[list[str], list[tuple[int, int]]], list[dict[str, str]]]
    spawn: Callable[[int, str, int, dict[str, str]], subprocess.Popen[bytes]]
    stop: Callable[[subprocess.Popen[bytes], int], None]
    log: Callable[[str], None]
    store_address: Callable[[list[str]], str]


@dataclass
class Settings:
    """The elastic flags (horovodrun's)."""

    discovery_script: str
    num_proc: int
    min_np: int
    max_np: int | None
    slots_per_host: int
    elastic_timeout: float
    reset_limit: int | None
    cooldown_range: tuple[int, int] | None = None


@dataclass
class _Worker:
    host: str
    slot: int
    label: int
    proc: subprocess.Popen[bytes]
    code: int | None = None

    @property
    def key(self) -> str:
        return f"{self.host}:{self.slot}"


@dataclass
class _Hosts:
    """The hosts the script lists now, in the order they first appeared."""

    order: list[str] = field(default_factory=list)
    slots: dict[str, int] = field(default_factory=dict)
    checked: float = -1e9

    def update(self, listed: list[tuple[str, int]]) -> None:
        names = [name for name, _ in listed]
        self.order = [h for h in self.order if h in names] + [
            h for h in names if h not in self.order
        ]
        self.slots = dict(listed)


class ElasticDriver:
    """Runs one elastic job; :meth:`run` returns tiaccrun's exit status."""

    def __init__(self, settings: Settings, launcher: Launcher, env: dict[str, str]) -> None:
        self.settings = settings
        self.launcher = launcher
        self.store_address = "127.0.0.1"
        self.hosts = _Hosts()
        # Hosts not used after a failure: until when (time.monotonic(); inf:
        # for good), and how often each failed.
        self.blacklist: dict[str, float] = {}
        self.failures: dict[str, int] = {}
        self.workers: dict[str, _Worker] = {}
        self.ended: list[_Worker] = []
        self.round = -1
        self.members: list[str] = []
        # The labels of the current round's workers: a slot a failed worker
        # had may be taken again by a new one (a host back after its
        # cooldown), and only the new one's exit counts.
        self.member_labels: set[int] = set()
        self.resets = 0
        self.labels = 0
        self.short_since: float | None = None
        self.finishing = False
        self.stopping: signal.Signals | None = None
        timeout = datetime.timedelta(seconds=max(settings.elastic_timeout, 60.0))
        self.store = dist.TCPStore(
            "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timeout
        )
        self.env = {
            **env,
            _rounds.ELASTIC: "1",
            _rounds.STORE_PORT: str(self.store.port),
            _rounds.TIMEOUT: f"{settings.elastic_timeout:g}",
        }

    # -- the loop ----------------------------------------------------------------

    def run(self) -> int:
        """Runs the job to its end; returns the exit status."""
        try:
            self._start()
            while True:
                if self.stopping is not None:
                    self.launcher.log(f"{self.stopping.name}: terminating every worker")
                    self._terminate_all()
                    return 128 + int(self.stopping)
                status = self._tick()
                if status is not None:
                    return status
                time.sleep(_TICK)
        except ElasticError as e:
            self.launcher.log(f"error: {e}")
            self._terminate_all()
            return 1

    def _start(self) -> None:
        """Waits for ``-np`` slots (within the elastic timeout), then round 0."""
        deadline = time.monotonic() + self.settings.elastic_timeout
        while True:
            self._discover(force=True)
            usable = self._usable()
            if len(usable) >= self.settings.num_proc:
                break
            if time.monotonic() > deadline:
                raise ElasticError(
                    f"the discovery script listed {len(usable)} usable slot(s) "
                    f"({self._listed()}); -np {self.settings.num_proc} were not there within "
                    f"--elastic-timeout {self.settings.elastic_timeout:g} s"
                )
            if self.stopping is not None:
                return
            time.sleep(DISCOVERY_INTERVAL)
        self.store_address = self.launcher.store_address(self.hosts.order)
        self.env[_rounds.STORE_ADDR] = self.store_address
        self._new_round(self._target(), "start")

    def _tick(self) -> int | None:
        """One look at the workers and hosts; the exit status once the job ended."""
        changed = self._reap()
        if self.finishing:
            running = [w for w in self.workers.values() if w.label in self.member_labels]
            if not running:
                failed = [w for w in self.ended if w.label in self.member_labels and w.code]
                return _exit_status(failed[0].code) if failed else 0
            return None
        self._discover()
        self._cooled()
        target = self._target()
        if target != self.members:
            changed = changed or "hosts " + self._listed()
        if not changed and _rounds.requested(self.store, self.round):
            # A round formed now would take in a worker that is still dying
            # and fail again at once: look for exits a moment first.
            changed = self._reap_within(DEATH_GRACE)
            if self.finishing:
                return None
            changed = changed or "a worker asked for a new round after a failed collective"
            target = self._target()
        if not changed:
            self.short_since = None
            return None
        if len(target) < self.settings.min_np:
            now = time.monotonic()
            if self.short_since is None:
                self.short_since = now
                self.launcher.log(
                    f"{len(target)} usable slot(s) ({self._listed()}), fewer than --min-np "
                    f"{self.settings.min_np}: waiting up to {self.settings.elastic_timeout:g} s"
                )
            if now - self.short_since > self.settings.elastic_timeout:
                raise ElasticError(
                    f"fewer than --min-np {self.settings.min_np} usable slots "
                    f"({self._listed()}) for --elastic-timeout "
                    f"{self.settings.elastic_timeout:g} s"
                )
            return None
        self.short_since = None
        self._new_round(target, changed)
        return None

    # -- rounds ------------------------------------------------------------------

    def _new_round(self, target: list[str], why: str) -> None:
        """Publishes the next round of ``target`` workers, then starts the new ones."""
        if self.round >= 0:
            self.resets += 1
            limit = self.settings.reset_limit
            if limit is not None and self.resets > limit:
                raise ElasticError(
                    f"the job needed a new round ({why}) after {limit} already: "
                    f"--reset-limit {limit} reached"
                )
        hosts = [h for h in self.hosts.order if any(k.rsplit(":", 1)[0] == h for k in target)]
        placement = []
        placed: dict[str, int] = {}  # members placed so far per host: the next local rank
        for key in target:
            host = key.rsplit(":", 1)[0]
            placement.append((hosts.index(host), placed.get(host, 0)))
            placed[host] = placed.get(host, 0) + 1
        envs = self.launcher.environments(hosts, placement)
        self.round += 1
        for env in envs:  # a script's own init_process_group() joins the driver's store
            env.update({AGENT_STORE: "True", RESTART_COUNT: str(self.round)})
        self.members = list(target)
        round_envs = dict(zip(target, envs))
        _rounds.publish(self.store, self.round, round_envs)
        self.launcher.log(
            f"round {self.round}: {len(target)} worker(s) on {', '.join(hosts)} ({why})"
        )
        for key in target:
            if key not in self.workers:
                host, slot = key.rsplit(":", 1)
                self._spawn(host, int(slot), round_envs[key])
        self.member_labels = {self.workers[key].label for key in target}

    def _spawn(self, host: str, slot: int, round_env: dict[str, str]) -> None:
        env = {
            **self.env,
            **round_env,
            _rounds.WORKER_HOST: host,
            _rounds.WORKER_SLOT: str(slot),
        }
        proc = self.launcher.spawn(self.labels, host, slot, env)
        worker = _Worker(host, slot, self.labels, proc)
        self.labels += 1
        self.workers[worker.key] = worker

    def _reap_within(self, seconds: float) -> str | None:
        """:meth:`_reap` until a member's exit changes the job, for at most ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            changed = self._reap()
            if changed or self.finishing or time.monotonic() >= deadline:
                return changed
            time.sleep(min(_TICK / 2, max(0.0, deadline - time.monotonic())))

    def _reap(self) -> str | None:
        """Collects exited workers; what changed the job, if anything did."""
        changed = None
        for key, worker in list(self.workers.items()):
            code = worker.proc.poll()
            if code is None:
                continue
            worker.code = code
            del self.workers[key]
            self.ended.append(worker)
            member = worker.label in self.member_labels
            if code == 0:
                if member:
                    self.finishing = True  # the training function returned
                continue
            what = describe_exit(code, over_ssh=True)
            out_for = self._exclude(worker.host) or "is out already"
            self.launcher.log(f"worker {worker.label} ({key}) {what}; host {worker.host} {out_for}")
            if member:
                changed = f"worker {worker.label} ({key}) failed"
        return changed

    # -- hosts -------------------------------------------------------------------

    def _exclude(self, host: str) -> str | None:
        """Keeps ``host`` out after a failure; how long, for the log (``None``: already out)."""
        now = time.monotonic()
        if self.blacklist.get(host, 0.0) > now:
            return None  # out already: a failure in the cooldown does not lengthen it
        cooldown = self.settings.cooldown_range
        if cooldown is None:
            self.blacklist[host] = float("inf")
            return "is not used again"
        low, high = cooldown
        self.failures[host] = self.failures.get(host, 0) + 1
        delay = low * 2 ** self.failures[host] + random.uniform(0, 1) * low
        delay = max(low, min(high, delay))
        self.blacklist[host] = now + delay
        return f"is not used for {delay:.1f} s (--blacklist-cooldown-range)"

    def _cooled(self) -> None:
        """Ends the cooldowns that are over (the next round takes the host in)."""
        now = time.monotonic()
        back = sorted(h for h, until in self.blacklist.items() if until <= now)
        for host in back:
            del self.blacklist[host]
            self.launcher.log(f"host {host}'s cooldown ended: it may run workers again")

    def _discover(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.hosts.checked < DISCOVERY_INTERVAL:
            return
        self.hosts.checked = now
        script = self.settings.discovery_script
        try:
            done = subprocess.run(
                [script], capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            self.launcher.log(f"--host-discovery-script {script}: {e}; the hosts stay as they were")
            return
        if done.returncode != 0:
            self.launcher.log(
                f"--host-discovery-script {script} exited with {done.returncode} "
                f"({done.stderr.strip()[-200:]}); the hosts stay as they were"
            )
            return
        lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
        entries = [
            line if ":" in line else f"{line}:{self.settings.slots_per_host}" for line in lines
        ]
        try:
            listed = self.launcher.parse_hosts(",".join(entries)) if entries else []
        except ValueError as e:
            self.launcher.log(f"--host-discovery-script {script}: {e}; the hosts stay as they were")
            return
        self.hosts.update(listed)

    def _usable(self) -> list[str]:
        """The slots of the listed hosts that may run workers, host by host."""
        return [
            f"{h}:{s}"
            for h in self.hosts.order
            if self.blacklist.get(h, 0.0) <= time.monotonic()
            for s in range(self.hosts.slots[h])
        ]

    def _target(self) -> list[str]:
        """The next round's members: the current ones that remain, then new slots."""
        usable = self._usable()
        keep = [k for k in self.members if k in usable and k in self.workers]
        fresh = [k for k in usable if k not in keep and k not in self.workers]
        target = keep + fresh
        if self.settings.max_np is not None:
            target = target[: self.settings.max_np]
        return target

    def _listed(self) -> str:
        listed = [f"{h}:{self.hosts.slots[h]}" for h in self.hosts.order]
        text = ", ".join(listed) or "none"
        if self.blacklist:
            text += f"; not used after a failure: {', '.join(sorted(self.blacklist))}"
        return text

    # -- the end -----------------------------------------------------------------

    def _terminate_all(self) -> None:
        procs = [w.proc for w in self.workers.values()]
        for proc in procs:
            self.launcher.stop(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.launcher.stop(proc, signal.SIGKILL)
                proc.wait()


def _exit_status(code: int | None) -> int:
    if code is None or code == 0:
        return 0
    return code if code > 0 else 128 - code


def settings_from(args: Any) -> Settings:
    """The elastic settings of tiaccrun's parsed flags."""
    return Settings(
        discovery_script=args.host_discovery_script,
        num_proc=args.num_proc,
        min_np=args.min_np if args.min_np is not None else args.num_proc,
        max_np=args.max_np,
        slots_per_host=args.slots_per_host,
        elastic_timeout=args.elastic_timeout,
        reset_limit=args.reset_limit,
        cooldown_range=(
            tuple(args.blacklist_cooldown_range) if args.blacklist_cooldown_range else None
        ),
    )
