"""The engine's reading of the environment as Python sees it: strict mode,
interface names, AIACC's fusion fraction and NCCL interface."""

from __future__ import annotations

import os

import pytest

from tiacc_training import _engine
from tiacc_training.errors import ConfigError


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith(("TIACC_TRAINING_", "LIGHT_", "PERSEUS_", "HOROVOD_")) or name in (
            "GLOO_SOCKET_IFNAME",
            "NCCL_SOCKET_IFNAME",
        ):
            monkeypatch.delenv(name)
    return monkeypatch


def test_strict_mode_raises_naming_the_variable_and_the_closest_name(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("PERSEUS_ALLREDUCE_STREAM", "4")
    assert _engine.CommConfig.from_env().num_streams == 2
    clean_env.setenv("TIACC_TRAINING_STRICT", "1")
    with pytest.raises(ConfigError, match="did you mean PERSEUS_ALLREDUCE_STREAMS") as raised:
        _engine.CommConfig.from_env()
    assert raised.value.variable == "PERSEUS_ALLREDUCE_STREAM"


def test_an_interface_that_does_not_exist_lists_those_that_do(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert _engine.CommConfig.from_env().socket_addr == "127.0.0.1"
    clean_env.setenv("PERSEUS_GLOO_NETWORK_INTERFACE", "no-such-nic9")
    with pytest.raises(ConfigError, match=r"lo \(127\.0\.0\.1\)") as raised:
        _engine.CommConfig.from_env()
    assert raised.value.variable == "PERSEUS_GLOO_NETWORK_INTERFACE"


def test_fusion_fraction_and_accumulation(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("PERSEUS_ALLREDUCE_FUSION", "16")
    clean_env.setenv("PERSEUS_ACCUMULATE_N_STEPS", "4")
    config = _engine.CommConfig.from_env()
    assert config.bucket_bytes(1600) == 100
    assert config.accumulate_n_steps == 4
    assert config.to_dict()["fusion_fraction"] == 16


def test_aiacc_s_nccl_interface_reaches_nccl_unless_nccl_s_own_is_set(
    clean_env: pytest.MonkeyPatch,
) -> None:
    from tiacc_training.torch.distributed import _config

    # Recorded as unset, so that the value the engine sets goes at teardown.
    clean_env.setenv("NCCL_SOCKET_IFNAME", "unset")
    clean_env.delenv("NCCL_SOCKET_IFNAME")
    clean_env.setenv("PERSEUS_NCCL_NETWORK_INTERFACE", "lo")
    config = _config.effective_config()
    assert config.socket_addr == "127.0.0.1"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "=lo"
    clean_env.setenv("NCCL_SOCKET_IFNAME", "^docker")
    _config.effective_config()
    assert os.environ["NCCL_SOCKET_IFNAME"] == "^docker"
