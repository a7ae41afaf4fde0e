"""Loading NCCL at run time, from Python, without a GPU.

Loading the library, ncclGetVersion and ncclGetUniqueId are host-only
calls; ncclCommInitRank must fail cleanly (a CommError) with no GPU. The
communicator's tests need ``_engine.NcclCommunicator``, built only with the
cargo feature ``nccl-communicator`` (``maturin develop --release --features
nccl-communicator``); they skip without it (the Rust tests in
``rust/tiacc-core/src/comm/nccl/tests.rs`` cover the same rules).
"""

from __future__ import annotations

import pytest
import torch

import tiacc_training.torch.distributed as tdist
from tiacc_training import _engine
from tiacc_training.errors import CommError, ConfigError, TiaccError

needs_communicator = pytest.mark.skipif(
    not hasattr(_engine, "NcclCommunicator"),
    reason="_engine.NcclCommunicator is built only with the cargo feature nccl-communicator",
)


@pytest.fixture
def nccl_dirs() -> list[str]:
    """The nvidia-nccl wheel's lib directories; skips when NCCL is absent."""
    dirs = tdist.nccl_search_dirs()
    try:
        _engine.nccl_version(dirs)
    except CommError as e:
        pytest.skip(f"no NCCL library here: {e}")
    return dirs


def test_version_from_python(nccl_dirs: list[str]) -> None:
    major, minor, patch = tdist.nccl_version()
    assert (major, minor) >= (2, 12)
    assert patch >= 0
    assert _engine.nccl_version(nccl_dirs) == (major, minor, patch)
    assert _engine.nccl_library_path(nccl_dirs).endswith("libnccl.so.2")


def test_an_explicit_library_path_is_loaded(nccl_dirs: list[str]) -> None:
    path = _engine.nccl_library_path(nccl_dirs)
    assert tdist.nccl_version(path) == _engine.nccl_version(nccl_dirs)


def test_a_missing_library_file_is_a_comm_error_naming_it() -> None:
    with pytest.raises(CommError, match="/nonexistent/libnccl.so.2") as info:
        _engine.nccl_version([], "/nonexistent/libnccl.so.2")
    assert isinstance(info.value, TiaccError)


def test_the_environment_setting_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIACC_TRAINING_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    assert tdist.comm_config()["nccl_library"] == "/nonexistent/libnccl.so.2"
    with pytest.raises(CommError, match="/nonexistent/libnccl.so.2"):
        tdist.nccl_version()


def test_a_library_that_is_not_nccl_names_the_missing_symbol() -> None:
    # Any shared library without NCCL's symbols will do: the extension itself.
    not_nccl = str(_engine.__file__)
    with pytest.raises(CommError, match="ncclGetVersion") as info:
        _engine.nccl_version([], not_nccl)
    assert not_nccl in str(info.value)


def test_unique_ids_are_128_bytes_and_differ(nccl_dirs: list[str]) -> None:
    a, b = _engine.nccl_unique_id(nccl_dirs), _engine.nccl_unique_id(nccl_dirs)
    assert isinstance(a, bytes) and len(a) == 128 and a != b


@needs_communicator
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without a GPU")
def test_a_communicator_without_a_gpu_is_a_comm_error(nccl_dirs: list[str]) -> None:
    uid = _engine.nccl_unique_id(nccl_dirs)
    with pytest.raises(CommError, match="ncclCommInitRank") as info:
        _engine.NcclCommunicator(uid, 0, 1, nccl_dirs)
    assert "world communicator, rank 0 of 1" in str(info.value)


@needs_communicator
def test_communicator_argument_mistakes_are_value_errors() -> None:
    with pytest.raises(ValueError, match="128 bytes"):
        _engine.NcclCommunicator(b"short", 0, 1)
    with pytest.raises(ValueError, match="rank 3"):
        _engine.NcclCommunicator(bytes(128), 3, 2)
    with pytest.raises(ValueError, match="group"):
        _engine.NcclCommunicator(bytes(128), 0, 1, group="galaxy")


def test_transport_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tdist.comm_config()["transport"] == "auto"
    monkeypatch.setenv("TIACC_TRAINING_TRANSPORT", "TCP")
    assert tdist.comm_config()["transport"] == "tcp"
    monkeypatch.setenv("TIACC_TRAINING_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ConfigError, match="TIACC_TRAINING_TRANSPORT") as info:
        tdist.comm_config()
    assert info.value.variable == "TIACC_TRAINING_TRANSPORT"
    monkeypatch.delenv("TIACC_TRAINING_TRANSPORT")
    # An argument goes through the same parser.
    assert _engine.CommConfig.from_env().with_overrides({"transport": "NCCL"}).transport == "nccl"
