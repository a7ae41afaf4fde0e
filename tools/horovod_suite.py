"""Runs Horovod's own PyTorch test suite against ``tiacc_training.torch.horovod``.

Horovod's suite (``test/parallel/test_torch.py`` of a Horovod source
checkout) imports ``horovod.torch``; here that name is this package's
Horovod API, through a small shim in a temporary folder. The shim also
stands in for the few helpers the suite's ``test/utils/common.py`` imports
from Horovod's runner and from packages the suite needs besides
(``cloudpickle`` and ``mock``: the standard library's ``pickle`` and
``unittest.mock`` do what the suite uses them for). The suite runs as one
job of ``--np`` ranks under torchrun, each rank one pytest process (as
Horovod runs it under ``horovodrun``/``mpirun``), with the MPI variables
the suite reads for the expected rank and size.

    python tools/horovod_suite.py --horovod /path/to/horovod [--np 2] [-k EXPR]

Prints each rank's pytest summary; exits non-zero when a rank's pytest did.
The logs stay in ``--out`` (default: a temporary folder, printed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The shim's files: the Horovod names the suite imports, on this package.
SHIM = {
    "horovod/__init__.py": "",
    "horovod/torch/__init__.py": (
        "import sys\n\nimport tiacc_training.torch.horovod as _api\n\n"
        "sys.modules[__name__] = _api\n"
    ),
    "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "",
    "horovod/runner/util/threads.py": (
        "import threading\n\n\n"
        "def in_thread(target, args=(), name=None, daemon=True, silent=False):\n"
        "    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)\n"
        "    thread.start()\n"
        "    return thread\n"
    ),
    "cloudpickle.py": "from pickle import dumps, loads  # noqa: F401\n",
    "mock.py": "from unittest.mock import *  # noqa: F403\n",
}

# What each rank runs: the suite, with the rank and size where the suite looks.
RANK = """#!/bin/sh
export OMPI_COMM_WORLD_RANK="$RANK" OMPI_COMM_WORLD_SIZE="$WORLD_SIZE"
cd "{suite}"
exec "{python}" -m pytest -q -p no:cacheprovider test_torch.py "$@" > "{out}/rank.$RANK.log" 2>&1
"""


def prepare(horovod: Path, out: Path) -> Path:
    """Writes the shim and copies the suite's two files into ``out``; returns the rank script."""
    tests = horovod / "test"
    sources = {
        "test_torch.py": tests / "parallel" / "test_torch.py",
        "common.py": tests / "utils" / "common.py",
    }
    for name, source in sources.items():
        if not source.is_file():
            raise SystemExit(f"{source}: not found (--horovod takes a Horovod source checkout)")
        (out / name).write_bytes(source.read_bytes())
    for name, text in SHIM.items():
        path = out / "shim" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    script = out / "rank.sh"
    script.write_text(RANK.format(suite=out, python=sys.executable, out=out))
    script.chmod(0o755)
    return script


def main() -> int:
    """Runs the suite; returns the job's exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horovod", type=Path, required=True, help="a Horovod source checkout")
    parser.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--port", type=int, default=29731, help="the rendezvous port")
    parser.add_argument("--out", type=Path, help="where the logs go (default: a temporary folder)")
    parser.add_argument("-k", dest="select", help="pytest's -k expression")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="horovod-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    script = prepare(args.horovod.resolve(), out)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(out / "shim"), str(out), str(ROOT)])
    env.setdefault("TIACC_TRAINING_TIMEOUT", "60")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.np}"]
    command += [f"--master-port={args.port}", "--no-python", str(script)]
    if args.select:
        command += ["-k", args.select]
    status = subprocess.run(command, env=env, check=False).returncode
    for rank in range(args.np):
        lines = (out / f"rank.{rank}.log").read_text(errors="replace").splitlines()
        summary = [line for line in lines if line.startswith("FAILED")] + lines[-1:]
        print(f"rank {rank}:", *summary, sep="\n  ")
    print(f"logs: {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
