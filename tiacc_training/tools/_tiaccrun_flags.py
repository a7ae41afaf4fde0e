"""tiaccrun's command line: its flags, named as ``horovodrun`` names them, and what they set.

``parse_args`` parses and checks them (the elastic ones too);
``settings_environment`` gives the variables the flags set for every rank.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

PROG = "tiaccrun"
DEFAULT_START_TIMEOUT = 30.0
DEFAULT_ELASTIC_TIMEOUT = 600.0
# The variables that name the interface a rank binds to: gloo's (which the
# engine reads too) and NCCL's.
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# The bounds of --blacklist-cooldown-range, in seconds (Horovod's).
COOLDOWN_LIMITS = (1, 3600)


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
        type=int,
        help="number of ranks (elastic: the slots to wait for before starting; default --min-np)",
    )
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument(
        "-H", "--hosts", help="hosts and slots: host1:2,host2:2 (default: localhost:<np>)"
    )
    hosts.add_argument("-hostfile", "--hostfile", help="a file of 'hostname slots=N' lines")
    parser.add_argument("-p", "--ssh-port", type=int, help="ssh port on every remote host")
    parser.add_argument("-i", "--ssh-identity-file", help="private key for ssh")
    parser.add_argument(
        "--network-interface",
        "--network-interfaces",
        dest="nics",
        action=_nic_action(),
        help="interface(s) the ranks communicate over (comma-separated or "
        "repeated): on each host, the first of them it has (default: an "
        "interface on a network every host shares)",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        help="seconds for the ssh checks and the start of every rank, and "
        "for rank 0 to open the rendezvous (default: HOROVOD_START_TIMEOUT "
        f"or {DEFAULT_START_TIMEOUT:g}; the rendezvous is watched only when "
        "set)",
    )
    parser.add_argument(
        "--output-filename",
        help="also write each rank's output to <dir>/rank.<rank>/stdout and stderr",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print the placement and each rank's command"
    )
    parser.add_argument(
        "--no-prefix",
        action="store_true",
        help="print the ranks' lines without the [rank]<stream>: prefix",
    )
    timeline = parser.add_argument_group("timeline")
    timeline.add_argument(
        "--timeline-filename",
        help="record the Horovod timeline there (HOROVOD_TIMELINE)",
    )
    timeline.add_argument(
        "--timeline-mark-cycles",
        action="store_true",
        help="HOROVOD_TIMELINE_MARK_CYCLES=1 (accepted; the engine has no cycle to mark)",
    )
    tuning = parser.add_argument_group("settings handed to the ranks")
    tuning.add_argument("--fusion-threshold-mb", type=float, help="HOROVOD_FUSION_THRESHOLD in MiB")
    tuning.add_argument("--cycle-time-ms", type=float, help="HOROVOD_CYCLE_TIME in ms")
    hier = tuning.add_mutually_exclusive_group()
    hier.add_argument(
        "--hierarchical-allreduce",
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
        type=int,
        help="TIACC_TRAINING_NUM_NCCL_STREAMS (channels)",
    )
    elastic = parser.add_argument_group("elastic training")
    elastic.add_argument(
        "--host-discovery-script",
        help="run the job elastically: this executable prints the usable hosts, one "
        "'host' or 'host:slots' per line (run every second)",
    )
    elastic.add_argument("--min-np", type=int, help="fewest workers to train with (default -np)")
    elastic.add_argument(
        "--max-np", type=int, help="most workers to train with (default: all slots)"
    )
    elastic.add_argument(
        "--slots-per-host",
        "--slots",
        type=int,
        help="slots of a discovered host that gives none (default 1)",
    )
    elastic.add_argument(
        "--elastic-timeout",
        type=float,
        help="seconds to wait for --min-np slots (and for a worker's next round); default "
        f"HOROVOD_ELASTIC_TIMEOUT or {DEFAULT_ELASTIC_TIMEOUT:g}",
    )
    elastic.add_argument(
        "--blacklist-cooldown-range",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="let a host whose worker failed back after a cooldown: MIN seconds times 2 "
        "per failure of that host (plus up to MIN at random), at most MAX; without it a "
        f"failed host is not used again (MIN >= {COOLDOWN_LIMITS[0]}, MAX <= "
        f"{COOLDOWN_LIMITS[1]})",
    )
    elastic.add_argument(
        "--reset-limit",
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
    "blacklist_cooldown_range": "--blacklist-cooldown-range",
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
    if args.blacklist_cooldown_range is not None:
        low, high = args.blacklist_cooldown_range
        if not COOLDOWN_LIMITS[0] <= low <= high <= COOLDOWN_LIMITS[1]:
            parser.error(
                f"--blacklist-cooldown-range {low} {high}: expected {COOLDOWN_LIMITS[0]} <= "
                f"MIN <= MAX <= {COOLDOWN_LIMITS[1]} seconds"
            )
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


def settings_environment(args: argparse.Namespace) -> dict[str, str]:
    """The variables set by the flags (the same for every rank)."""
    env: dict[str, str] = {}
    if args.nics:
        # Until a host's own interface is chosen (tiaccrun's job_interfaces):
        # gloo and the engine take the first name, NCCL the list.
        env[IFNAME_VARIABLES[0]] = args.nics[0]
        env[IFNAME_VARIABLES[1]] = ",".join(args.nics)
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
