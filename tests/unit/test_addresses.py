"""Where ranks bind on hosts as they come: the interface per host, the loopback hostname.

``choose_interfaces`` (tiaccrun's pick of each host's interface),
``_addresses.advertised_host`` when the rendezvous host is this host's
loopback name, the package's gloo backend bound to the engine's address,
and the hint a script's own gloo group gets on such a host. The real
two-host jobs (namespaces, sshd) are in ``tests/distributed/test_two_hosts.py``.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from tiacc_training import _engine
from tiacc_training.tools import tiaccrun
from tiacc_training.torch.distributed import _addresses
from tiacc_training.torch.distributed._state import state

A = [("lo", "127.0.0.1", 8), ("etha0", "10.77.1.1", 24), ("mgmt0", "192.168.5.1", 24)]
B = [("lo", "127.0.0.1", 8), ("mgmt1", "192.168.5.2", 24), ("ensb1", "10.77.1.2", 24)]


def test_each_host_gets_its_own_interface_on_a_shared_network():
    chosen = tiaccrun.choose_interfaces({"a": A, "b": B}, None)
    assert chosen == {"a": A[1], "b": B[2]}  # the first network of host a that b has too
    # The network the host list's names lead to comes first.
    chosen = tiaccrun.choose_interfaces({"a": A, "b": B}, None, ["192.168.5.2"])
    assert chosen == {"a": A[2], "b": B[1]}
    # No shared network: nobody gets one; an unknown host gets none.
    assert tiaccrun.choose_interfaces({"a": A[:2], "b": B[:2]}, None) == {}
    assert tiaccrun.choose_interfaces({"a": A, "b": None}, None) == {"a": A[1]}


def test_network_interface_takes_the_first_name_each_host_has():
    chosen = tiaccrun.choose_interfaces({"a": A, "b": B}, ["etha0", "ensb1"])
    assert chosen == {"a": A[1], "b": B[2]}
    with pytest.raises(tiaccrun.UsageError, match=r"host b has none of these interfaces"):
        tiaccrun.choose_interfaces({"a": A, "b": B}, ["etha0"])


def test_the_interface_variables_of_a_host():
    env = tiaccrun.interface_environment(B[2])
    assert env == {"GLOO_SOCKET_IFNAME": "ensb1", "NCCL_SOCKET_IFNAME": "=ensb1"}


class _Config:
    socket_addr = None


@pytest.fixture
def launch(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(
        state,
        "launch",
        {"world_size": 4, "local_size": 2, "master_addr": "myhost", "master_port": 29500},
    )
    return state.launch


def test_a_loopback_rendezvous_host_gives_the_outward_interface(monkeypatch, launch):
    outward = _engine.outward_interface()
    if outward is None:
        pytest.skip("this host has no interface but loopback (and bridges)")
    # The rendezvous host is this host's name, which maps to 127.0.1.1.
    monkeypatch.setattr(_addresses._engine, "local_addr_towards", lambda host, port: "127.0.1.1")
    assert _addresses.advertised_host(_Config()) == outward[1]
    # On one host the loopback address is right.
    launch["local_size"] = 4
    assert _addresses.advertised_host(_Config()) == "127.0.1.1"
    # A routable route is kept as it is.
    launch["local_size"] = 2
    monkeypatch.setattr(_addresses._engine, "local_addr_towards", lambda host, port: "10.0.0.9")
    assert _addresses.advertised_host(_Config()) == "10.0.0.9"


def test_the_hint_for_a_gloo_group_of_the_script(monkeypatch, launch):
    monkeypatch.setattr(_addresses.socket, "gethostname", lambda: "localhost")
    hint = _addresses.loopback_hint(launch)
    assert hint is not None and "'localhost' resolves to 127.0.0.1" in hint
    assert "GLOO_SOCKET_IFNAME=" in hint
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert _addresses.loopback_hint(launch) is None
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert _addresses.loopback_hint({"world_size": 2, "local_size": 2}) is None


def test_the_package_gloo_backend_runs_on_the_address_given(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    made = []
    real = dist.ProcessGroupGloo.create_device

    def create_device(**kwargs):
        made.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(dist.ProcessGroupGloo, "create_device", create_device)
    timeout = datetime.timedelta(seconds=30)
    gloo = _addresses.gloo_backend(dist.HashStore(), 0, 1, timeout, "127.0.0.1")
    assert made == [{"hostname": "127.0.0.1"}]
    tensor = torch.ones(3)
    gloo.allreduce([tensor]).wait()
    assert tensor.tolist() == [1.0, 1.0, 1.0]
