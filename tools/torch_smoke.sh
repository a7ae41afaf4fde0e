#!/usr/bin/env bash
# Smoke test of the "tiacc" CPU collectives on every minor torch release.
#
#   tools/torch_smoke.sh            (what `make test-torch-smoke` runs)
#
# For each release, one after the other: a fresh virtual environment under
# SMOKE_DIR with that torch from PyPI (and numpy<2 where torch's import
# complains about numpy 2), tiacc-training in it, tools/torch_smoke.py run
# there, the environment deleted. Each run's JSON line goes into SMOKE_OUT
# (a JSON list, rewritten after every release); a release that fails does
# not stop the others, and the script exits non-zero at the end if any did.
#
#   TORCH_SMOKE_RELEASES  releases to test (default: the newest patch of every
#                         minor release from 2.0 to the newest on PyPI)
#   SMOKE_WHEEL           a built wheel to install (default: the source tree,
#                         through a .pth file, with its in-tree _engine library)
#   SMOKE_SOURCE          that source tree (default: this checkout; e.g. a
#                         `git archive` of a commit plus _engine.abi3.so)
#   SMOKE_COMMIT          the commit recorded with the results (default: this
#                         checkout's HEAD, "+dirty" where tiacc_training/ has
#                         uncommitted changes; with SMOKE_WHEEL, the wheel's name)
#   SMOKE_DIR             where the environments go (default .compat/smoke)
#   SMOKE_OUT             the JSON list (default benches/results/torch_smoke.json)
#   SMOKE_PYTHON          the Python the environments are made from (python3)
#   SMOKE_PIP_CACHE       pip's cache, shared by the releases (SMOKE_DIR/pip-cache);
#                         emptied when it grows over SMOKE_CACHE_GB (default 8)
#   SMOKE_FORCED=0        skip the second run of the releases that take the newer
#                         form, which forces the older one there
#                         (TIACC_TRAINING_COLLECTIVES=tiacc-process-group)
#   SMOKE_KEEP=1          keep the environments (and reuse one that has torch)
#   SMOKE_TIMEOUT         seconds one smoke run may take; a rank still running
#                         then is reported as hung, with its stack (default 120)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
root=${SMOKE_DIR:-.compat/smoke}
out=${SMOKE_OUT:-benches/results/torch_smoke.json}
python=${SMOKE_PYTHON:-python3}
cache=${SMOKE_PIP_CACHE:-$root/pip-cache}
cache_gb=${SMOKE_CACHE_GB:-8}
timeout=${SMOKE_TIMEOUT:-120}
wheel=${SMOKE_WHEEL:-}
source=$(cd "${SMOKE_SOURCE:-$repo}" && pwd)
[ -n "$wheel" ] || [ -f "$source/tiacc_training/__init__.py" ] \
    || { echo "SMOKE_SOURCE=$source holds no tiacc_training package" >&2; exit 2; }
if [ -n "$wheel" ]; then
    wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
    [ -f "$wheel" ] || { echo "SMOKE_WHEEL=$wheel: no such file" >&2; exit 2; }
fi
if [ -n "${SMOKE_COMMIT:-}" ]; then
    commit=$SMOKE_COMMIT
elif [ -n "$wheel" ]; then
    commit=$(basename "$wheel")
else
    commit=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
    if [ "$source" = "$repo" ] && ! git -C "$repo" diff --quiet HEAD -- tiacc_training 2>/dev/null; then
        commit=$commit+dirty
    fi
fi
mkdir -p "$root" "$(dirname "$out")"
export PIP_CACHE_DIR=$cache PIP_DISABLE_PIP_VERSION_CHECK=1

# The newest patch of every minor release 2.x on PyPI, oldest first.
releases() {
    "$python" -m pip index versions torch 2>/dev/null | "$python" -c '
import re, sys
text = sys.stdin.read()
found = re.search(r"Available versions: (.*)", text)
if not found:
    sys.exit("pip index versions torch listed no versions")
newest = {}
for version in found.group(1).split(", "):
    parts = version.strip().split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts) or parts[0] != "2":
        continue  # pre-releases and torch 1.x
    key, patch = (2, int(parts[1])), int(parts[2])
    newest[key] = max(newest.get(key, -1), patch)
print(" ".join(f"2.{minor}.{patch}" for (_, minor), patch in sorted(newest.items())))
'
}

list=${TORCH_SMOKE_RELEASES:-$(releases)}
echo "torch releases: $list"
lines=$root/results.jsonl
: >"$lines"
start=$SECONDS
failed=()

# Writes the JSON list from the lines so far.
write_out() {
    "$python" - "$lines" "$out" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
with open(sys.argv[2], "w") as f:
    json.dump(records, f, indent=1)
    f.write("\n")
PY
}

# A JSON line for a release that failed before the smoke test could run.
setup_failure() {  # release, step, log file
    "$python" - "$1" "$2" "$3" <<'PY'
import json, sys
release, step, log = sys.argv[1:]
text = " | ".join(l.strip() for l in open(log, errors="replace") if l.strip())
print(json.dumps({"release": release, "torch": None, "path": "unknown", "reason": None,
                  "checks": {"install": {"result": "fail", "error": f"{step}: ...{text[-600:]}"}},
                  "ok": False}))
PY
}

# Adds the install's facts, and the forced run's line, to the smoke test's line.
annotate() {  # line, install seconds, numpy version, pinned, forced run's line or ""
    "$python" - "$@" "$commit" <<'PY'
import datetime, json, sys
line, seconds, numpy, pinned, forced, commit = sys.argv[1:]
record = json.loads(line)
if forced:
    # The release passes where both runs passed.
    other = json.loads(forced)
    record["forced_process_group"] = {
        key: other.get(key) for key in ("path", "reason", "line", "checks", "ok", "seconds")
    }
    record["ok_default"] = record["ok"]
    record["ok"] = bool(record["ok"] and other.get("ok"))
record["install_seconds"] = int(seconds)
record["numpy"] = numpy
record["numpy_pinned"] = pinned == "1"
record["commit"] = commit
record["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
print(json.dumps(record))
PY
}

# Whether torch imports cleanly (no error, nothing on stderr: numpy 2 under
# a torch built against numpy 1 prints its complaint there).
torch_imports() {  # venv
    local err
    err=$("$1/bin/python" -c 'import numpy, torch; torch.from_numpy(numpy.zeros(2)).sum()' 2>&1 >/dev/null) \
        && [ -z "$err" ]
}

for release in $list; do
    venv=$root/torch-$release
    log=$root/torch-$release.log
    t0=$SECONDS
    pinned=0
    echo "== torch $release"
    line=
    if ! { [ "${SMOKE_KEEP:-0}" = 1 ] && [ -x "$venv/bin/python" ] \
            && "$venv/bin/python" -c "import torch" 2>/dev/null; }; then
        rm -rf "$venv"
        if ! { "$python" -m venv "$venv" && "$venv/bin/pip" install -q --upgrade pip \
                && "$venv/bin/pip" install -q "torch==$release" numpy; } >"$log" 2>&1; then
            line=$(setup_failure "$release" "pip install torch==$release" "$log")
        fi
    fi
    if [ -z "$line" ] && ! torch_imports "$venv"; then
        # torch built against numpy 1: numpy 2 breaks its import (torch < 2.3).
        pinned=1
        echo "   torch $release does not import cleanly with $("$venv/bin/python" -c 'import numpy; print(numpy.__version__)'): numpy<2"
        if ! "$venv/bin/pip" install -q "numpy<2" >>"$log" 2>&1 || ! torch_imports "$venv"; then
            "$venv/bin/python" -c 'import numpy, torch' >>"$log" 2>&1 || true
            line=$(setup_failure "$release" "import torch (with numpy<2)" "$log")
        fi
    fi
    if [ -z "$line" ]; then
        if [ -n "$wheel" ]; then
            install_ok=$("$venv/bin/pip" install -q --force-reinstall --no-deps "$wheel" >>"$log" 2>&1 && echo 1 || echo 0)
        else
            site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
            echo "$source" >"$site/tiacc_training_source.pth"
            install_ok=1
        fi
        if [ "$install_ok" = 1 ]; then
            numpy=$("$venv/bin/python" -c 'import numpy; print(numpy.__version__)')
            case $numpy in 1.*) pinned=1 ;; esac  # (a kept environment pinned earlier)
            setup=$((SECONDS - t0))
            echo "   environment ready in ${setup} s (numpy $numpy)"
            # The smoke test prints its JSON line last, whatever happens.
            smoke=$("$venv/bin/python" tools/torch_smoke.py "$release" --timeout "$timeout" 2>>"$log" | tail -1) || true
            forced=
            took=$("$python" -c 'import json, sys; print(json.loads(sys.argv[1]).get("path"))' "$smoke" 2>/dev/null || true)
            if [ "${SMOKE_FORCED:-1}" != 0 ] && [ "$took" = backend ]; then
                forced=$(TIACC_TRAINING_COLLECTIVES=tiacc-process-group "$venv/bin/python" \
                    tools/torch_smoke.py "$release" --timeout "$timeout" 2>>"$log" | tail -1) || true
                [ -n "$forced" ] || forced='{"ok": false, "checks": {"init": {"result": "fail", "error": "printed no JSON line"}}}'
            fi
            if [ -n "$smoke" ] && line=$(annotate "$smoke" "$setup" "$numpy" "$pinned" "$forced" 2>>"$log"); then
                :
            else
                echo "tools/torch_smoke.py printed no JSON line: $smoke" >>"$log"
                line=$(setup_failure "$release" "tools/torch_smoke.py" "$log")
            fi
        else
            line=$(setup_failure "$release" "pip install $wheel" "$log")
        fi
    fi
    echo "$line" >>"$lines"
    write_out
    # One line on the release; fails where a check did.
    if ! "$python" - "$line" "$((SECONDS - t0))" <<'PY'; then
import json, sys
record = json.loads(sys.argv[1])
checks = " ".join(f"{name}={check['result']}" for name, check in record["checks"].items())
print(f"   torch {record.get('torch')}: path {record.get('path')}, {checks} ({sys.argv[2]} s)")
for name, check in record["checks"].items():
    if check["result"] == "fail":
        print(f"     {name}: {check['error']}")
forced = record.get("forced_process_group")
if forced:
    print(f"   forced process-group: path {forced.get('path')}, ok={forced.get('ok')}")
    for name, check in (forced.get("checks") or {}).items():
        if check["result"] == "fail":
            print(f"     {name}: {check['error']}")
sys.exit(0 if record["ok"] else 1)
PY
        failed+=("$release")
        cp "$log" "$root/torch-$release.failed.log" 2>/dev/null || true
    fi
    if [ "${SMOKE_KEEP:-0}" != 1 ]; then
        rm -rf "$venv"
    fi
    rm -f "$log"
    if [ -d "$cache" ] && [ "$(du -s --block-size=1G "$cache" | cut -f1)" -gt "$cache_gb" ]; then
        echo "   pip cache over $cache_gb GB: emptied"
        rm -rf "$cache"
    fi
done

echo "torch smoke: $(( $(wc -l <"$lines") - ${#failed[@]} )) passed, ${#failed[@]} failed" \
    "in $((SECONDS - start)) s; results in $out"
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}" >&2
    exit 1
fi
