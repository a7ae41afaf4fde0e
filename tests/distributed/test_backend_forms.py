"""The forms of the "tiacc" backend, and the choice between them.

Each check runs a world of one in a fresh process (the choice is made once
per process): the form the running torch constructs, the older form forced
by its variable, the older form's hand-off of other devices' tensors to the
backends asked for there, and gloo with the reason where torch can
construct neither form.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _launch import base_env, free_port

PRELUDE = """
import json, os, torch, torch.distributed as dist
import tiacc_training.torch.distributed as tdist
from tiacc_training.torch.distributed import _backend
def init(backend):
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
"""


FINISH = """
if dist.is_initialized():
    dist.destroy_process_group()
"""


def run(body: str, env: dict[str, str] | None = None) -> dict:
    """Runs ``body`` after the prelude; returns what it printed as ``RESULT``."""
    # Destroyed before the interpreter exits, as torch asks: a gloo group left
    # to the finalizer can abort the process there ("terminate called without
    # an active exception", a torch issue), after the script's work is done.
    code = PRELUDE.format(port=free_port()) + body + FINISH
    proc = subprocess.run(
        [sys.executable, "-c", code], env=base_env(env), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr[-4000:]
    return json.loads(line[-1][len("RESULT ") :])


def test_the_form_this_torch_constructs_serves_the_script_s_gloo() -> None:
    result = run(
        """
tdist.init_tiacc_training()
init("gloo")
t = torch.arange(4.0)
dist.all_reduce(t)
forms = _backend.forms()
print("RESULT " + json.dumps({
    "forms": forms, "form": _backend.form_of(), "path": _backend.path(),
    "group": type(dist.group.WORLD).__name__, "served": dict(_backend.served_in_process),
    "line": _backend.describe_cpu_collectives(), "t": t.tolist()}))
"""
    )
    forms = result["forms"]
    # Every torch 2.x constructs the older form.
    assert forms["process-group"] is None, result
    newer = forms["backend"] is None
    assert result["form"] == result["path"] == ("backend" if newer else "process-group")
    assert result["group"] == ("ProcessGroup" if newer else "TiaccProcessGroup"), result
    assert result["served"] == {"allreduce": 1} and result["t"] == [0.0, 1.0, 2.0, 3.0]
    if not newer:
        # The line says why the older form, naming this torch.
        assert "as a ProcessGroup: torch " in result["line"], result["line"]
        assert "cannot construct a Python Backend" in result["line"], result["line"]


def test_the_older_form_forced_hands_other_devices_to_their_backends() -> None:
    result = run(
        """
tdist.init_tiacc_training()
init("cpu:gloo,cuda:gloo")  # gloo serves CUDA tensors: no GPU needed to build it
group = dist.group.WORLD
calls = []
class Recorder:
    def allreduce(self, tensors, opts):
        calls.append([str(t.device) for t in tensors])
        return "recorded"
devices = sorted(["cpu", *group._devices])
if hasattr(group, "_device_types"):  # what torch itself sees registered
    assert sorted(str(d) for d in group._device_types) == devices, group._device_types
assert group.device_backend("cuda") is group.collectives.gloo
group._devices["meta"] = Recorder()  # a device without a GPU, to see the hand-off
got = group.allreduce([torch.empty(2, device="meta")], dist.AllreduceOptions())
try:
    group.device_backend("xpu")
    missing = None
except RuntimeError as error:
    missing = str(error)
t = torch.ones(3)
dist.all_reduce(t)
print("RESULT " + json.dumps({
    "backend": str(dist.get_backend()), "group": type(group).__name__, "devices": devices,
    "strings": _backend.takes_device_strings(),
    "got": got, "calls": calls, "missing": missing, "t": t.tolist(),
    "line": _backend.describe_cpu_collectives()}))
""",
        {"TIACC_TRAINING_COLLECTIVES": "tiacc-process-group"},
    )
    # torch 2.0.0 takes one backend name for every device.
    assert result["backend"] == ("cpu:tiacc,cuda:gloo" if result["strings"] else "tiacc"), result
    assert result["group"] == "TiaccProcessGroup", result
    assert result["devices"] == ["cpu", "cuda"], result
    # A meta tensor went to the meta device's backend, not to the engine.
    assert result["got"] == "recorded", result
    assert result["calls"] in ([["meta"]], [["meta:0"]]), result
    assert "not xpu tensors" in result["missing"], result
    assert result["t"] == [1.0, 1.0, 1.0]
    assert "as a ProcessGroup" in result["line"], result["line"]


def test_gloo_with_the_reason_where_no_form_can_be_constructed() -> None:
    result = run(
        """
_backend._forms = {
    "backend": "torch X cannot construct A", "process-group": "torch X cannot construct B"
}
_backend._registered = None
tdist.init_tiacc_training()
ok = _backend.register()
init("gloo")
t = torch.ones(2)
dist.all_reduce(t)
print("RESULT " + json.dumps({
    "ok": ok, "reason": _backend.unavailable_reason(), "backend": str(dist.get_backend()),
    "path": _backend.path(), "line": _backend.describe_cpu_collectives(), "t": t.tolist()}))
"""
    )
    assert result["ok"] is False
    assert result["reason"] == "torch X cannot construct A; torch X cannot construct B"
    assert result["backend"] == "gloo" and result["path"] == "gloo"
    assert result["line"].startswith("CPU collectives: gloo (the tiacc backend is unavailable"), (
        result
    )
    assert result["t"] == [1.0, 1.0]


@pytest.mark.parametrize("asked", ["gloo", None])
def test_collectives_gloo_constructs_nothing_of_ours(asked: str | None) -> None:
    result = run(
        f"""
made = []
for cls in (_backend.TiaccBackend, _backend.TiaccProcessGroup):
    original = cls.__init__
    def spy(self, *a, _original=original, **k):
        made.append(type(self).__name__)
        _original(self, *a, **k)
    cls.__init__ = spy
tdist.init_tiacc_training()
init({asked!r})
cuda = torch.cuda.is_available()
print("RESULT " + json.dumps({{"made": made, "backend": str(dist.get_backend()), "cuda": cuda}}))
""",
        {"TIACC_TRAINING_COLLECTIVES": "gloo"},
    )
    # With no backend asked, torch pairs gloo with NCCL where CUDA is there.
    expected = "cpu:gloo,cuda:nccl" if asked is None and result["cuda"] else "gloo"
    assert result == {"made": [], "backend": expected, "cuda": result["cuda"]}, result
