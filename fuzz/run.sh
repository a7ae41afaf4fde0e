#!/usr/bin/env bash
# Runs the tiacc-core fuzz targets one after the other (not in parallel).
#
#   bash fuzz/run.sh [seconds]      # default: 600 seconds per target
#
# Works on a stable toolchain: RUSTC_BOOTSTRAP=1 lets cargo-fuzz pass its -Z
# flags. Seeds fuzz/corpus/<target>/ (gitignored) when it is empty.
set -euo pipefail

SECONDS_PER_TARGET="${1:-600}"
FUZZ_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$FUZZ_DIR"

export RUSTC_BOOTSTRAP=1
CARGO_FUZZ="${CARGO_FUZZ:-cargo fuzz}"
SANITIZER="${SANITIZER:-address}"   # `none` also works, and runs faster
TARGETS=(record_reader example_decode image_decode)

seed() {
    local py=python3
    [ -x "$FUZZ_DIR/../.venv/bin/python" ] && py="$FUZZ_DIR/../.venv/bin/python"
    "$py" - "$FUZZ_DIR/corpus" <<'PY'
import os, struct, sys

def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF

def masked(data: bytes) -> int:
    c = crc32c(data)
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF

def frame(payload: bytes) -> bytes:
    n = struct.pack("<Q", len(payload))
    return n + struct.pack("<I", masked(n)) + payload + struct.pack("<I", masked(payload))

def varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)

def ld(field: int, body: bytes) -> bytes:  # length-delimited field
    return varint(field << 3 | 2) + varint(len(body)) + body

def example(features: dict) -> bytes:
    entries = b"".join(ld(1, ld(1, k.encode()) + ld(2, v)) for k, v in features.items())
    return ld(1, entries)

def bytes_list(*vals): return ld(1, b"".join(ld(1, v) for v in vals))
def int64_list(*vals): return ld(3, ld(1, b"".join(varint(v) for v in vals)))
def int64_unpacked(*vals): return ld(3, b"".join(varint(1 << 3) + varint(v) for v in vals))
def float_list(*vals): return ld(2, ld(1, b"".join(struct.pack("<f", v) for v in vals)))
def float_unpacked(*vals): return ld(2, b"".join(varint(1 << 3 | 5) + struct.pack("<f", v) for v in vals))

examples = [
    b"",
    example({}),
    example({"image/encoded": bytes_list(b"\xff\xd8\xff\xe0jpeg"), "image/class/label": int64_list(7)}),
    example({"scores": float_list(0.5, -1.25, float("nan")), "ids": int64_list(-1, 0, 1 << 40)}),
    example({"x": int64_unpacked(1, 2), "y": float_unpacked(1.0), "empty": int64_list()}),
    example({"none": b"", "b": bytes_list(b"", b"abc")}),
]

root = sys.argv[1]
corpus = {
    "example_decode": examples,
    "record_reader": [
        b"",
        frame(b""),
        frame(b"hello"),
        b"".join(frame(e) for e in examples),
        frame(examples[2]) + frame(examples[3]),
        frame(examples[2])[:-3],                       # truncated payload
        frame(examples[4]) + b"\x01\x02\x03",          # truncated header
    ],
}
try:  # small real images, when Pillow is at hand (the project's .venv has it)
    import io
    from PIL import Image

    def encoded(mode, fmt, size=(19, 13), **kw):
        img = Image.new(mode, size)
        img.putdata([tuple((x * 37 + i * 11) % 256 for i in range(len(mode))) if len(mode) > 1
                     else (x * 37) % 256 for x in range(size[0] * size[1])])
        out = io.BytesIO()
        img.save(out, fmt, **kw)
        return out.getvalue()

    corpus["image_decode"] = [
        encoded("RGB", "JPEG", quality=90),
        encoded("RGB", "JPEG", quality=50, subsampling=0),
        encoded("RGB", "JPEG", progressive=True),
        encoded("L", "JPEG"),
        encoded("CMYK", "JPEG"),
        encoded("RGB", "PNG"),
        encoded("RGBA", "PNG"),
        encoded("RGB", "BMP"),
        encoded("RGB", "WEBP"),
    ]
except ImportError:
    corpus["image_decode"] = [b"\xff\xd8\xff\xd9", b"\x89PNG\r\n\x1a\n"]
for target, seeds in corpus.items():
    d = os.path.join(root, target)
    os.makedirs(d, exist_ok=True)
    for i, s in enumerate(seeds):
        with open(os.path.join(d, f"seed-{i:02d}"), "wb") as f:
            f.write(s)
PY
}

need_seed=0
for t in "${TARGETS[@]}"; do
    if [ -z "$(ls -A "corpus/$t" 2>/dev/null)" ]; then need_seed=1; fi
done
if [ "$need_seed" = 1 ]; then
    echo "seeding corpus/ ..."
    seed
fi

# With -jobs=1 libFuzzer runs the fuzzer in a child process that logs to
# ./fuzz-0.log (echoed when it ends); keep each target's log under logs/.
mkdir -p logs
status=0
for t in "${TARGETS[@]}"; do
    echo "=== $t: ${SECONDS_PER_TARGET}s, sanitizer=$SANITIZER ==="
    rc=0
    $CARGO_FUZZ run -O -s "$SANITIZER" "$t" "corpus/$t" -- \
        -max_total_time="$SECONDS_PER_TARGET" -jobs=1 -print_final_stats=1 || rc=$?
    if [ -f fuzz-0.log ]; then mv fuzz-0.log "logs/$t.log"; fi
    if [ "$rc" != 0 ]; then
        echo "!!! $t exited with $rc: see logs/$t.log and artifacts/$t/" >&2
        status=$rc
    fi
done
exit "$status"
