"""What tiaccrun asks of a remote host before its ranks start: its network interfaces.

``python -m tiacc_training.tools._tiaccrun_probe`` prints this host's
interfaces that have an IPv4 address (the core's list, in the system's
order) as one JSON line of ``[name, address, prefix length]``; tiaccrun
runs it over ssh on every remote host and picks, per host, the interface
its ranks talk to the others over.
"""

from __future__ import annotations

import json
import sys

from tiacc_training import _engine

if __name__ == "__main__":
    json.dump([list(i) for i in _engine.network_interfaces()], sys.stdout)
    sys.stdout.write("\n")
