"""init_tiacc_training: configuration, launch detection, the DDP patch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _launch import base_env, free_port

import tiacc_training.torch.distributed as tdist
from tiacc_training.errors import ConfigError

SCRIPT = Path(__file__).resolve().parent / "single_process_checks.py"


def run_script(script: Path, scenario: str, env: dict[str, str]) -> str:
    """Runs ``scenario`` of a checks script in a process of its own with
    exactly ``env``; it must exit 0 having printed ``ALL_OK``. Returns its
    standard output, then its standard error."""
    proc = subprocess.run(
        [sys.executable, str(script), scenario],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0 and "ALL_OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def run_checks(scenario: str, env: dict[str, str] | None = None) -> str:
    full_env = base_env(env)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(var, None)
    full_env["PORT"] = str(free_port())
    return run_script(SCRIPT, scenario, full_env)


def test_plain_python_gets_a_world_of_one_and_the_patch() -> None:
    out = run_checks("plain", {"TIACC_TRAINING_FUSION_THRESHOLD": "1048576"})
    for name in [
        "initialised",
        "fusion_threshold",
        "explicit_bucket_cap",
        "engine_hook",
        "user_hook_wins",
        "second_user_hook_refused",
        "builtin_hook_wins",
    ]:
        assert f"CHECK {name}" in out
    assert "channels=2 fusion_threshold=1048576" in out
    assert "steps aside" in out


def test_works_after_the_user_initialised_the_group() -> None:
    out = run_checks("user_group")
    assert "CHECK engine_hook" in out
    assert "launcher=user" in out or "launcher=none" in out


def test_the_scripts_explicit_choices_win_with_one_warning_naming_both() -> None:
    out = run_checks("conflicts")
    assert "CHECK conflicts_warned" in out and "CHECK destroyed_with_the_group" in out


HOOK_CHECKS = Path(__file__).resolve().parent / "hook_checks.py"


@pytest.mark.parametrize("strict", ["0", "1"])
@pytest.mark.parametrize("scenario", ["never_ran", "fallback"])
def test_the_hook_never_steps_aside_in_silence(scenario: str, strict: str) -> None:
    env = base_env({"TIACC_TRAINING_STRICT": strict, "RANK": "0", "WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})  # fmt: skip
    out = run_script(HOOK_CHECKS, scenario, env)
    assert f"CHECK {scenario}_{'raised' if strict == '1' else 'reported'}" in out or (
        scenario == "fallback" and strict == "0" and "CHECK fallback_warned_once" in out
    ), out[-3000:]
    if strict == "0":
        # Rank 0's last line says what went through the engine and what did not.
        assert "tiacc_training: summary:" in out and "left to torch:" in out, out[-3000:]


def test_disable_switch_leaves_ddp_native() -> None:
    out = run_checks("disabled", {"TIACC_TRAINING_DISABLE": "1"})
    assert "CHECK disabled" in out
    assert "tiacc engine disabled" in out


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("TIACC_TRAINING_NUM_NCCL_STREAMS", "abc"),
        ("TIACC_TRAINING_NUM_NCCL_STREAMS", "0"),
        ("TIACC_TRAINING_FUSION_THRESHOLD", "-1"),
        ("TIACC_TRAINING_TIMEOUT", "never"),
        ("TIACC_TRAINING_DISABLE", "perhaps"),
        ("TIACC_TRAINING_COMPRESSION", "int8"),
        ("TIACC_TRAINING_COMPRESSION_SCOPE", "intra"),
        ("PERSEUS_ALLREDUCE_DTYPE", "7"),
        ("TIACC_TRAINING_NAN_CHECK", "maybe"),
        ("TIACC_TRAINING_TRANSPORT", "infiniband"),
        ("TIACC_TRAINING_TOPK_MOMENTUM", "1.0"),
        ("TIACC_TRAINING_TOPK_CLIP_NORM", "0"),
    ],
)
def test_a_bad_env_value_raises_config_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=var) as info:
        tdist.init_tiacc_training()
    assert info.value.variable == var
    assert value in str(info.value)


def test_the_start_up_report_says_what_applies_to_each_kind_of_bucket() -> None:
    out = run_checks(
        "plain",
        {
            "TIACC_TRAINING_NAN_CHECK": "1",
            "TIACC_TRAINING_COMPRESSION": "fp16",
            "LIGHT_TOPK_RATIO": "0.1",
        },
    )
    # One rank: auto has no nodes to go 2D over.
    assert "CPU buckets: in process (a world of one); algorithm=flat ring (auto: " in out
    assert "compression=fp16" in out
    assert "nan_check=on" in out
    if torch.cuda.is_available():
        assert "CUDA buckets: nccl" in out or "CUDA buckets: tcp with host staging" in out
    else:
        assert "CHECK cpu_transport_tcp" in out
        assert "CUDA buckets: none (torch sees no CUDA device)" in out
    # Settings that cannot apply are warnings naming the variable.
    assert "LIGHT_TOPK_RATIO has no effect without LIGHT_TOPK_ALLREDUCE=1" in out
    assert "TIACC_TRAINING_COMPRESSION has no effect in a world of one rank" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_transport_nccl_without_cuda_is_a_comm_error_at_init() -> None:
    out = run_checks("transport_nccl", {"TIACC_TRAINING_TRANSPORT": "nccl"})
    assert "CHECK transport_refused" in out
    message = out.split("COMM_ERROR ", 1)[1].splitlines()[0]
    # Either NCCL is missing (the error says what was tried) or CUDA is.
    assert "CUDA" in message or "NCCL" in message, message


def test_a_missing_nccl_library_file_is_a_comm_error_naming_it() -> None:
    out = run_checks(
        "nccl_library_missing", {"TIACC_TRAINING_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"}
    )
    assert "CHECK transport_refused" in out
    assert "/nonexistent/libnccl.so.2" in out.split("COMM_ERROR ", 1)[1].splitlines()[0]


def test_a_bad_launcher_value_raises_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "first")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="RANK"):
        tdist.init_tiacc_training()


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("fusion_threshold", 0),
        ("num_streams", 0),
        ("num_streams", 65),
        ("timeout", -1),
        ("compression", "int8"),
        ("transport", "udp"),
        ("topk_momentum", 1.5),
        ("topk_warmup_steps", -1),
        ("topk_clip_norm", 0.0),
    ],
)
def test_a_bad_argument_value_is_a_value_error_naming_it(argument: str, value: object) -> None:
    with pytest.raises(ValueError, match=argument):
        tdist.init_tiacc_training(**{argument: value})


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("fusion_threshold", True),
        ("fusion_threshold", 1.5),
        ("num_streams", "2"),
        ("timeout", "soon"),
        ("compression", 16),
        ("enable", "yes"),
        ("topk_momentum", "0.9"),
        ("topk_warmup_steps", 2.5),
        ("topk_momentum_masking", "on"),
    ],
)
def test_an_argument_of_the_wrong_type_is_a_type_error(argument: str, value: object) -> None:
    with pytest.raises(TypeError, match=argument):
        tdist.init_tiacc_training(**{argument: value})


def test_arguments_are_parsed_like_their_variables() -> None:
    from tiacc_training.torch.distributed import _config

    config = _config.effective_config(compression="FP16", transport=" NCCL ", num_streams=3)
    assert (config.to_dict()["compression"], config.transport) == ("fp16", "nccl")
    assert config.num_streams == 3
    config = _config.effective_config(
        topk_momentum=0.9, topk_momentum_masking=True, topk_warmup_steps=50, topk_clip_norm=2
    )
    settings = config.to_dict()
    assert (settings["topk_momentum"], settings["topk_momentum_masking"]) == (0.9, True)
    assert (settings["topk_warmup_steps"], settings["topk_clip_norm"]) == (50, 2.0)


def test_topk_applies_to_float32_buckets_at_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiacc_training.torch.distributed import _config

    assert not _config.effective_config().topk_applies("torch.float32", 1 << 30)
    monkeypatch.setenv("LIGHT_TOPK_ALLREDUCE", "1")
    monkeypatch.setenv("LIGHT_TOPK_THRESHOLD", "4096")
    config = _config.effective_config()
    assert config.topk_applies("torch.float32", 4096)
    assert not config.topk_applies("torch.float32", 4092)
    assert not config.topk_applies("torch.float16", 1 << 20)
    with pytest.raises(ValueError, match="complex64"):
        config.topk_applies("torch.complex64", 4096)
