"""The pieces of Horovod's elastic mode, one process: flags, rounds, states, sampler.

The whole mode (driver, workers joining and leaving) runs in
``tests/distributed/test_horovod_elastic.py``.
"""

from __future__ import annotations

import datetime
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tiacc_training.tools import _elastic, tiaccrun
from tiacc_training.torch.horovod import _rounds, elastic

# -- tiaccrun's flags ------------------------------------------------------------


def _script(tmp_path: Path) -> str:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    return str(script)


def _parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        tiaccrun.parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_elastic_flags_need_a_discovery_script(capsys: pytest.CaptureFixture[str]) -> None:
    err = _parse_error(["-np", "2", "--min-np", "1", "--reset-limit", "3", "python", "x"], capsys)
    assert "--min-np, --reset-limit need --host-discovery-script" in err


def test_elastic_flags_are_checked_against_np(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path)
    base = ["--host-discovery-script", script]
    assert "--min-np 3 is more than -np 2" in _parse_error(
        ["-np", "2", "--min-np", "3", *base, "python", "x"], capsys
    )
    assert "--max-np 1 is less than -np 2" in _parse_error(
        ["-np", "2", "--max-np", "1", *base, "python", "x"], capsys
    )
    assert "exclude each other" in _parse_error(
        ["-np", "2", "-H", "a:2", *base, "python", "x"], capsys
    )
    for bounds in (["0", "5"], ["5", "4"], ["1", "3601"]):
        err = _parse_error(
            ["-np", "2", "--blacklist-cooldown-range", *bounds, *base, "python", "x"], capsys
        )
        assert f"--blacklist-cooldown-range {' '.join(bounds)}: expected 1 <= MIN" in err
    assert "--blacklist-cooldown-range need --host-discovery-script" in _parse_error(
        ["-np", "2", "--blacklist-cooldown-range", "1", "2", "python", "x"], capsys
    )
    missing = str(tmp_path / "nothing.sh")
    err = _parse_error(["-np", "2", "--host-discovery-script", missing, "python", "x"], capsys)
    assert f"--host-discovery-script {missing}: not an executable file" in err


def test_elastic_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "42")
    args = tiaccrun.parse_args(
        ["--min-np", "2", "--host-discovery-script", _script(tmp_path), "python", "x"]
    )
    assert (args.num_proc, args.min_np, args.max_np) == (2, 2, None)
    assert (args.slots_per_host, args.elastic_timeout, args.reset_limit) == (1, 42.0, None)


# -- the rounds, on a real store ---------------------------------------------------


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip


def _member(store: dist.TCPStore, key: str, timeout: float = 5.0) -> _rounds.Membership:
    return _rounds.Membership(store, key, -1, timeout)


def test_a_round_forms_once_every_member_is_in(store: dist.TCPStore) -> None:
    _rounds.publish(store, 0, {"a:0": {"RANK": "0"}, "b:0": {"RANK": "1"}})
    results: dict[str, object] = {}
    other = threading.Thread(target=lambda: results.update(b=_rounds.join(_member(store, "b:0"))))
    other.start()
    first = _member(store, "a:0")
    assert _rounds.join(first) == (0, {"RANK": "0"})
    other.join()
    assert results["b"] == (0, {"RANK": "1"})
    assert first.round == 0


def test_a_worker_left_out_of_a_newer_round_is_told(store: dist.TCPStore) -> None:
    worker = _member(store, "b:0")
    worker.round = 0
    _rounds.publish(store, 0, {"a:0": {}, "b:0": {}})
    _rounds.publish(store, 1, {"a:0": {}})
    assert _rounds.join(worker) is None


def test_a_new_worker_waits_for_the_round_that_names_it(store: dist.TCPStore) -> None:
    _rounds.publish(store, 0, {"a:0": {}})
    fresh = _member(store, "b:0", timeout=0.5)
    with pytest.raises(_rounds.RoundTimeout, match=r"elastic worker b:0: no round naming it"):
        _rounds.join(fresh)


def test_a_worker_after_a_failed_collective_asks_for_a_round(store: dist.TCPStore) -> None:
    worker = _member(store, "a:0", timeout=0.5)
    _rounds.publish(store, 0, {"a:0": {}})
    worker.round = 0
    assert not _rounds.requested(store, 0)
    with pytest.raises(_rounds.RoundTimeout, match="last round it was in: 0"):
        _rounds.join(worker)
    assert _rounds.requested(store, 0)


def test_a_member_that_never_comes_is_named_by_count(store: dist.TCPStore) -> None:
    _rounds.publish(store, 0, {"a:0": {}, "b:0": {}})
    with pytest.raises(_rounds.RoundTimeout, match="only 1 of the 2 members of round 0"):
        _rounds.join(_member(store, "a:0", timeout=0.3))


def test_membership_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    assert _rounds.Membership.from_env(lambda *a: None) is None
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    monkeypatch.delenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", raising=False)
    with pytest.raises(ValueError, match="HOROVOD_GLOO_RENDEZVOUS_ADDR is not set"):
        _rounds.Membership.from_env(lambda *a: None)
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", "1234")
    monkeypatch.setenv("HOROVOD_HOSTNAME", "node7")
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "3")
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "9")
    seen = []
    member = _rounds.Membership.from_env(lambda *a: seen.append(a) or "client")
    assert member is not None and (member.key, member.timeout) == ("node7:3", 9.0)
    assert seen == [("127.0.0.1", 1234, 9.0)] and member.store == "client"


# -- the states and the sampler (a world of one, outside an elastic job) -------------


def test_object_state_commit_restore_sync() -> None:
    sent = []

    def bcast(obj: object) -> object:
        sent.append(obj)
        return {"epoch": 7, "batch": 1}

    state = elastic.ObjectState(bcast, lambda: 0, epoch=0, batch=0)
    state.epoch, state.batch = 2, 5
    state.commit()  # outside an elastic job: saves, and no host update to check
    state.epoch, state.batch = 3, 9
    state.restore()
    assert (state.epoch, state.batch) == (2, 5)
    state.sync()
    assert sent == [{"epoch": 2, "batch": 5}] and (state.epoch, state.batch) == (7, 1)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(1)])
    state.on_reset()
    assert calls == [1]


def test_elastic_sampler_shares_out_what_is_left() -> None:
    sampler = elastic.ElasticSampler(list(range(10)), shuffle=False)
    assert list(sampler) == list(range(10)) and len(sampler) == 10
    sampler.record_batch(0, 4)
    sampler.reset()
    assert list(sampler) == [4, 5, 6, 7, 8, 9]
    saved = sampler.state_dict()
    sampler.set_epoch(1)
    assert list(sampler) == list(range(10))
    sampler.load_state_dict(saved)
    assert sampler.epoch == 0 and list(sampler) == [4, 5, 6, 7, 8, 9]
    shuffled = elastic.ElasticSampler(list(range(10)), shuffle=True, seed=3)
    again = elastic.ElasticSampler(list(range(10)), shuffle=True, seed=3)
    assert list(shuffled) == list(again) and sorted(shuffled) == list(range(10))
    assert list(shuffled) != list(range(10))


# -- the driver, with workers that are not processes --------------------------------


class _FakeProc:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        return self.code or 0


def _driver(tmp_path: Path, hosts: str, **settings: object):
    listed = tmp_path / "hosts"
    listed.write_text(hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    spawned: dict[str, _FakeProc] = {}
    lines: list[str] = []

    def spawn(label: int, host: str, slot: int, env: dict[str, str]) -> _FakeProc:
        spawned[f"{host}:{slot}"] = proc = _FakeProc()
        proc.env = env
        return proc

    def stop(proc: _FakeProc, sig: int) -> None:
        proc.code = -sig

    def parse(text: str) -> list[tuple[str, int]]:
        return [(h.name, h.slots) for h in tiaccrun.parse_hosts(text)]

    def environments(names, placement):
        return [{"RANK": str(r), "HOST": names[h]} for r, (h, _) in enumerate(placement)]

    launcher = _elastic.Launcher(
        parse, environments, spawn, stop, lines.append, lambda n: "1.2.3.4"
    )
    values = {"num_proc": 2, "min_np": 1, "max_np": None, "slots_per_host": 1,
              "elastic_timeout": 0.5, "reset_limit": None, **settings}  # fmt: skip
    driver = _elastic.ElasticDriver(
        _elastic.Settings(discovery_script=str(script), **values), launcher, {}
    )
    return driver, listed, spawned, lines


def _tick(driver):
    driver.hosts.checked = -1e9  # discover again now
    return driver._tick()


def test_driver_rounds_follow_the_hosts_and_failures(tmp_path: Path) -> None:
    driver, listed, spawned, lines = _driver(tmp_path, "a:2\n")
    driver._start()
    assert (
        driver.round == 0 and driver.members == ["a:0", "a:1"] and sorted(spawned) == ["a:0", "a:1"]
    )
    # A worker's own init_process_group() joins the driver's store as
    # torchrun's workers join the agent's: every member is told so, and a
    # worker starts with its first round's variables.
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert _rounds.members(driver.store, 0)["a:1"] == {"RANK": "1", "HOST": "a", **agent}
    assert spawned["a:1"].env["RANK"] == "1" and spawned["a:1"].env["HOROVOD_LOCAL_RANK"] == "1"
    assert spawned["a:1"].env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert driver.env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "1.2.3.4"
    assert _tick(driver) is None and driver.round == 0  # nothing changed
    listed.write_text("a:2\nb:1\n")
    assert _tick(driver) is None
    assert driver.round == 1 and driver.members == ["a:0", "a:1", "b:0"]
    assert _rounds.latest_round(driver.store) == 1
    spawned["a:1"].code = 1  # a worker fails: its host is not used again
    assert _tick(driver) is None
    assert driver.round == 2 and driver.members == ["b:0"] and "a" in driver.blacklist
    assert any(
        "worker 1 (a:1) exited with code 1; host a is not used again" in line for line in lines
    )
    spawned["a:0"].code = 0  # left out of round 2: ends
    spawned["b:0"].code = 0  # the training function returned
    assert _tick(driver) == 0


def test_a_failed_host_comes_back_after_its_cooldown(tmp_path: Path) -> None:
    driver, listed, spawned, lines = _driver(tmp_path, "a:1\nb:1\n", cooldown_range=(1, 2))
    driver._start()
    assert driver.members == ["a:0", "b:0"]
    spawned["b:0"].code = -9
    assert _tick(driver) is None and driver.round == 1 and driver.members == ["a:0"]
    out = [line for line in lines if "worker 1 (b:0) was killed by SIGKILL" in line]
    assert len(out) == 1 and "host b is not used for 2.0 s" in out[0], lines
    assert _tick(driver) is None and driver.round == 1  # still cooling down
    time.sleep(2.1)
    assert _tick(driver) is None
    assert driver.round == 2 and driver.members == ["a:0", "b:0"] and not driver.blacklist
    assert any("host b's cooldown ended" in line for line in lines)
    # The second failure doubles the cooldown (1 s * 2**2 + up to 1 s), capped at 2 s.
    spawned["b:0"].code = 1
    assert _tick(driver) is None and driver.members == ["a:0"]
    assert driver.failures["b"] == 2 and 1.5 < driver.blacklist["b"] - time.monotonic() <= 2.0
    # Back once more: the slot's new worker finishing ends the job with 0,
    # whatever the earlier workers of that slot did.
    time.sleep(2.1)
    assert _tick(driver) is None and driver.members == ["a:0", "b:0"]
    spawned["a:0"].code = spawned["b:0"].code = 0
    assert _tick(driver) == 0


def test_driver_asked_for_a_round_and_the_reset_limit(tmp_path: Path) -> None:
    driver, listed, spawned, lines = _driver(tmp_path, "a:2\n", reset_limit=1)
    driver._start()
    driver.store.add("tiacc_training/elastic/request.0", 1)
    assert _tick(driver) is None and driver.round == 1 and driver.members == ["a:0", "a:1"]
    listed.write_text("a:1\n")
    with pytest.raises(_elastic.ElasticError, match="--reset-limit 1 reached"):
        _tick(driver)


def test_a_round_asked_for_leaves_out_a_worker_that_dies_just_after(tmp_path: Path) -> None:
    driver, listed, spawned, lines = _driver(tmp_path, "a:1\nb:1\n")
    driver._start()
    assert driver.members == ["a:0", "b:0"]
    # b:0 was killed: a's collective failed and a asks for a new round
    # before b's exit shows.
    threading.Timer(0.3, lambda: setattr(spawned["b:0"], "code", -9)).start()
    driver.store.add("tiacc_training/elastic/request.0", 1)
    assert _tick(driver) is None
    assert driver.round == 1 and driver.members == ["a:0"] and "b" in driver.blacklist


def test_driver_fails_after_too_few_slots_for_the_timeout(tmp_path: Path) -> None:
    driver, listed, spawned, lines = _driver(tmp_path, "a:2\n", min_np=2)
    driver._start()
    listed.write_text("a:1\n")
    assert _tick(driver) is None and driver.round == 0
    assert any("fewer than --min-np 2" in line for line in lines)
    time.sleep(0.6)
    with pytest.raises(_elastic.ElasticError, match="fewer than --min-np 2 usable slots"):
        _tick(driver)
