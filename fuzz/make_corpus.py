"""Writes the seed inputs of the fuzz targets into fuzz/corpus/<target>/.

The seeds are real data made by the project's own code: shards packed by
``img2tfrecord`` from small images written with Pillow, records written by
``TFRecordWriter``, and the Examples inside them; plus a few damaged copies
(truncated, a huge length field) so the fuzzer starts at the error paths.
Each seed is named ``seed-<what>``; inputs the fuzzer found and that were
merged in keep libFuzzer's names (their SHA-1).

Run it with the built package importable (``make setup`` first)::

    .venv/bin/python fuzz/make_corpus.py
"""

from __future__ import annotations

import io
import struct
import sys
import tempfile
from pathlib import Path

from PIL import Image

CORPUS = Path(__file__).resolve().parent / "corpus"
sys.path.insert(0, str(CORPUS.parent.parent))

from tiacc_training import tfrecord  # noqa: E402
from tiacc_training.tools import img2tfrecord  # noqa: E402


def image(mode: str, fmt: str, size: tuple[int, int] = (19, 13), **kw: object) -> bytes:
    """A small image with a gradient in every channel, encoded as ``fmt``."""
    img = Image.new(mode, size)
    bands = len(img.getbands())
    img.putdata(
        [
            tuple((x * 37 + b * 11) % 256 for b in range(bands)) if bands > 1 else (x * 37) % 256
            for x in range(size[0] * size[1])
        ]
    )
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


def images() -> dict[str, bytes]:
    """The image seeds: JPEG variants, PNG, BMP and WebP."""
    return {
        "jpeg-420": image("RGB", "JPEG", quality=90),
        "jpeg-444": image("RGB", "JPEG", quality=50, subsampling=0),
        "jpeg-progressive": image("RGB", "JPEG", progressive=True),
        "jpeg-gray": image("L", "JPEG"),
        "jpeg-cmyk": image("CMYK", "JPEG"),
        "jpeg-16x16": image("RGB", "JPEG", size=(16, 16)),
        "png-rgb": image("RGB", "PNG"),
        "png-rgba": image("RGBA", "PNG"),
        "png-gray": image("L", "PNG"),
        "bmp": image("RGB", "BMP"),
        "webp": image("RGB", "WEBP"),
    }


def packed_shard(imgs: dict[str, bytes], tmp: Path) -> Path:
    """A shard packed by img2tfrecord from three of the images."""
    folder, listing = tmp / "imgs", tmp / "list.txt"
    lines = []
    for rel, name, label in (
        ("a/rgb.jpg", "jpeg-420", 0),
        ("a/rgb.png", "png-rgb", 0),
        ("b/gray.jpg", "jpeg-gray", 1),
    ):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(imgs[name])
        lines.append(f"{rel} {label}\n")
    listing.write_text("".join(lines))
    items = img2tfrecord.read_image_list(str(folder), str(listing))
    img2tfrecord.pack(items, str(tmp / "tfr"), "ds", records_per_shard=8, show_progress=False)
    (shard,) = sorted((tmp / "tfr").glob("*.tfrecord"))
    return shard


def examples() -> dict[str, bytes]:
    """Serialized Examples with every kind of feature."""
    return {
        "features-mixed": tfrecord.encode_example(
            {"ids": [-1, 0, 1 << 40], "scores": [0.5, -1.25, float("nan")], "name": b"abc"}
        ),
        "features-empty-bytes": tfrecord.encode_example({"b": [b"", b"x"], "s": "text"}),
        "image-example": tfrecord.encode_example(
            {"image/encoded": b"\xff\xd8\xff\xe0jpeg", "image/class/label": 7}
        ),
        "empty": b"",
    }


def written_shard(payloads: list[bytes], tmp: Path) -> bytes:
    """The bytes of a shard of ``payloads`` written by ``TFRecordWriter``."""
    path = tmp / "w.tfrecord"
    with tfrecord.TFRecordWriter(path) as w:
        for p in payloads:
            w.write(p)
    return path.read_bytes()


def main() -> None:
    """Writes every seed."""
    imgs = images()
    exs = examples()
    with tempfile.TemporaryDirectory() as tmp:
        path = packed_shard(imgs, Path(tmp))
        shard = path.read_bytes()
        payloads = {
            f"packed-record-{i}": p for i, (_, p) in enumerate(tfrecord.TFRecordReader(path).scan())
        }
        one = written_shard([exs["image-example"]], Path(tmp))
        reader_seeds = {
            "packed-3-images": shard,
            "written-examples": written_shard(list(exs.values()), Path(tmp)),
            "one-empty-record": written_shard([b""], Path(tmp)),
            "empty-file": b"",
            "truncated-payload": shard[: len(shard) // 2],
            "truncated-header": one + b"\x01\x02\x03",
        }
    length = struct.pack("<Q", 1 << 62)
    reader_seeds["huge-length"] = (
        length + struct.pack("<I", tfrecord.masked_crc32c(length)) + b"tail"
    )
    corpus = {
        "record_reader": reader_seeds,
        "example_decode": {**exs, **payloads},
        "image_decode": imgs,
    }
    for target, seeds in corpus.items():
        folder = CORPUS / target
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in seeds.items():
            (folder / f"seed-{name}").write_bytes(data)
        print(f"{target}: {len(seeds)} seeds in {folder}")


if __name__ == "__main__":
    main()
