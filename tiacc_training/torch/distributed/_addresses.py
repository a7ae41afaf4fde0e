"""Where this rank's sockets bind: the engine's address, and the gloo groups the package builds.

A rank reaches the others on one address (:func:`advertised_host`): the
one an interface variable names, else the address that routes to the
rendezvous host. On a host whose name maps to a loopback address (stock
Debian and Ubuntu write ``127.0.1.1 <hostname>`` into ``/etc/hosts``) the
route to a rendezvous named by that hostname stays on the host; when the
job spans hosts the rank then uses the interface the core picks towards
other hosts (``_engine.outward_interface``) and says so once.

gloo, left to itself, binds where the hostname resolves, so a gloo group
the package builds (the "tiacc" backend's, under Horovod's and the elastic
rounds' groups) is bound to the engine's address instead
(:func:`gloo_backend`): adding the two lines never makes a job need a
setting the native job did not need. A script's own gloo group stays
torch's; when it cannot connect across hosts for this reason,
:func:`loopback_hint` names the cause and the fix.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from typing import Any

import torch.distributed as dist

from tiacc_training import _engine

from . import _launch
from ._rendezvous import default_store
from ._state import logger, state

# The variable torch's gloo reads for the interface(s) it binds to.
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
# The outward interface already reported in this process.
_reported: set[str] = set()


def spans_hosts(launch: dict[str, Any] | None = None) -> bool:
    """Whether the launcher placed this job's ranks on more than one host."""
    launch = (state.launch or {}) if launch is None else launch
    local, world = launch.get("local_size"), launch.get("world_size")
    return local is not None and world is not None and local < world


def advertised_host(config: Any, store: Any = None) -> str:
    """The IP peers reach this rank on.

    The configured one, else the local address that routes to the
    rendezvous host (the launcher's, or that of ``store``: by default the
    default group's). Where that route stays on this host while the job
    spans hosts, the interface towards other hosts (see the module's text).
    """
    if config.socket_addr:
        return config.socket_addr
    launch = state.launch or {}
    host, port = launch.get("master_addr"), launch.get("master_port")
    if host is None:
        store = default_store() if store is None else store
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        host, port = getattr(store, "host", None), getattr(store, "port", None)
    if host is None:
        return "127.0.0.1"
    address = _engine.local_addr_towards(host, int(port or _launch.DEFAULT_MASTER_PORT))
    if not ipaddress.ip_address(address).is_loopback or not spans_hosts(launch):
        return address
    outward = _engine.outward_interface()
    if outward is None:
        return address
    name, outward_address = outward
    if name not in _reported:
        _reported.add(name)
        logger.info(
            "  the rendezvous host %s resolves to this host's loopback (%s); towards the "
            "other hosts this rank uses %s (%s). Set %s (or NCCL_SOCKET_IFNAME) to choose "
            "another interface",
            host,
            address,
            name,
            outward_address,
            GLOO_IFNAME,
        )
    return outward_address


def gloo_backend(
    store: Any, rank: int, size: int, timeout: datetime.timedelta, address: str
) -> Any:
    """A gloo backend of the package's own, bound to ``address`` (the engine's).

    Where ``GLOO_SOCKET_IFNAME`` is set, or torch cannot take a device in
    its options, gloo chooses as torch's own groups do.
    """
    gloo = dist.ProcessGroupGloo
    options_type = getattr(gloo, "_Options", None)
    if os.environ.get(GLOO_IFNAME) or options_type is None or not hasattr(gloo, "create_device"):
        return gloo(store, rank, size, timeout)
    options = options_type()
    options._timeout = timeout
    options._devices = [gloo.create_device(hostname=address)]
    options._threads = 2  # what torch gives one device
    return gloo(store, rank, size, options)


def hostname_loopback() -> tuple[str, str] | None:
    """This host's name and the loopback address it resolves to, or ``None``."""
    name = socket.gethostname()
    try:
        found = socket.getaddrinfo(name, None, socket.AF_INET)
    except OSError:
        return None
    for info in found:
        address = str(info[4][0])
        if ipaddress.ip_address(address).is_loopback:
            return name, address
    return None


def loopback_hint(launch: dict[str, Any]) -> str | None:
    """Why a gloo group of torch's may not connect across hosts here, and the fix.

    Only where it applies: the job spans hosts, ``GLOO_SOCKET_IFNAME`` is
    unset and this host's name resolves to loopback (gloo binds there and
    tells the other hosts a loopback address).
    """
    if os.environ.get(GLOO_IFNAME) or not spans_hosts(launch):
        return None
    loopback = hostname_loopback()
    if loopback is None:
        return None
    name, address = loopback
    outward = _engine.outward_interface()
    example = f"{GLOO_IFNAME}={outward[0]}" if outward else f"{GLOO_IFNAME}=<interface>"
    return (
        f"this host's name {name!r} resolves to {address} (a loopback address, as "
        f"/etc/hosts often maps it), so gloo binds there and the other hosts cannot reach "
        f"this rank. Set {example} (this host's interface towards the others"
        + (f", {outward[1]}" if outward else "")
        + "), or map the hostname to a routable address in /etc/hosts"
    )
