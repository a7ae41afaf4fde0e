"""img2tfrecord: content of the shards, determinism, bad input, interruption."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import REPO, coco_instances, run_tool, write_image
from tiacc_training import tfrecord
from tiacc_training.tools import general_image_list as gil
from tiacc_training.tools import img2tfrecord


def make_list(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "list.txt"
    assert gil.main(["--img_dir", str(folder), "--img_list", str(out)]) == 0
    return out


def pack_cli(folder: Path, img_list: Path, out: Path, *extra: str, name: str = "ds"):
    return run_tool(
        "img2tfrecord",
        "--img_dir", str(folder),
        "--img_list", str(img_list),
        "--tfrecords_name", name,
        "--dataset_type", "ImageFold",
        "--output_dir", str(out),
        "--quiet",
        *extra,
    )  # fmt: skip


def tree_digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_imagefold_records_hold_original_bytes_and_header_sizes(image_folder, tmp_path):
    img_list = make_list(image_folder, tmp_path)
    result = pack_cli(image_folder, img_list, tmp_path / "out", "--records_per_shard", "5")
    assert result.returncode == 0, result.stderr
    assert "packed 18 images (0 skipped) into 4 shards" in result.stdout
    index = tfrecord.read_index(tmp_path / "out" / "ds.index")
    lines = img_list.read_text().splitlines()
    assert len(index) == len(lines) == 18
    for (shard_file, shard_idx, offset, label), line in zip(index, lines):
        rel, list_label = line.rsplit(" ", 1)
        assert shard_file == f"ds-{shard_idx:05d}.tfrecord"
        assert label == int(list_label)
        ex = tfrecord.read_example(tmp_path / "out" / shard_file, offset)
        raw = (image_folder / rel).read_bytes()
        with Image.open(image_folder / rel) as im:
            width, height, fmt = im.width, im.height, im.format
        assert ex["image/encoded"] == [raw]
        assert ex["image/class/label"] == [label]
        assert ex["image/filename"] == [rel.encode()]
        assert ex["image/format"] == [fmt.encode()]
        assert (ex["image/width"], ex["image/height"]) == ([width], [height])
    idx_lines = (tmp_path / "out" / "ds-00001.tfrecord.idx").read_text().split("\n")[:-1]
    offsets = [o for f, _, o, _ in index if f == "ds-00001.tfrecord"]
    assert [int(line.split()[0]) for line in idx_lines] == offsets
    assert tfrecord.verify_index(tmp_path / "out" / "ds.index")["records"] == 18


def test_default_output_is_name_under_cwd(image_folder, tmp_path):
    img_list = make_list(image_folder, tmp_path)
    result = run_tool(
        "img2tfrecord", "--img_dir", str(image_folder), "--img_list", str(img_list),
        "--tfrecords_name", "val_demo", "--dataset_type", "ImageFold", "--quiet",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "val_demo" / "val_demo.index").exists()
    assert (tmp_path / "val_demo" / "val_demo-00000.tfrecord").exists()


def test_output_is_identical_for_any_worker_count(image_folder, tmp_path):
    img_list = make_list(image_folder, tmp_path)
    digests = []
    for workers in ["0", "1", "2", "3"]:
        out = tmp_path / f"out{workers}"
        result = pack_cli(
            image_folder, img_list, out, "--workers", workers, "--records_per_shard", "4"
        )
        assert result.returncode == 0, result.stderr
        digests.append(tree_digest(out))
    assert all(d == digests[0] for d in digests)
    assert len(digests[0]) == 11  # 5 shards + 5 .idx + index


def test_unreadable_and_non_image_files_are_skipped_or_fatal(image_folder, tmp_path):
    (image_folder / "bee" / "broken.jpg").write_bytes(b"\xff\xd8 truncated nonsense")
    (image_folder / "cat" / "text.png").write_text("just text")
    img_list = make_list(image_folder, tmp_path)
    result = pack_cli(image_folder, img_list, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert "packed 18 images (2 skipped)" in result.stdout
    assert "broken.jpg" in result.stderr and "text.png" in result.stderr
    assert f"{img_list}:" in result.stderr  # names the list line
    assert len(tfrecord.read_index(tmp_path / "out" / "ds.index")) == 18

    result = pack_cli(image_folder, img_list, tmp_path / "strict", "--strict")
    assert result.returncode == 2
    assert "--strict" in result.stderr and "broken.jpg" in result.stderr
    assert not (tmp_path / "strict" / "ds.index").exists()
    assert not list((tmp_path / "strict").glob("ds-*"))


def test_unreadable_file_is_skipped_or_fatal(image_folder, tmp_path):
    # A path that cannot be read as a file (a directory: even root cannot read it).
    unreadable = image_folder / "ant" / "dir.jpg"
    unreadable.mkdir()
    good = image_folder / "ant" / "ant_000.JPEG"
    items = [
        img2tfrecord.Item(str(good), "ant_000.JPEG", 0, "list:1"),
        img2tfrecord.Item(str(unreadable), "dir.jpg", 0, "list:2"),
    ]
    summary = img2tfrecord.pack(items, str(tmp_path / "o"), "ds", show_progress=False)
    assert (summary["records"], summary["skipped"]) == (1, 1)
    assert summary["image_bytes"] == good.stat().st_size
    with pytest.raises(img2tfrecord.UsageError, match=r"list:2: .*dir\.jpg.*--strict"):
        img2tfrecord.pack(items, str(tmp_path / "s"), "ds", strict=True, show_progress=False)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("ant/ant_000.JPEG 0\nonly_one_field\n", r"list.txt:2: expected `path label`"),
        ("ant/ant_000.JPEG zero\n", r"list.txt:1: label 'zero' is not an integer"),
        (
            "\nant/ant_000.JPEG 0\nant/missing.jpg 0\n",
            r"list.txt:3: image .*missing.jpg.* not exist",
        ),
        ("\n\n", "lists no images"),
    ],
)
def test_bad_list_lines(image_folder, tmp_path, content, match):
    img_list = tmp_path / "list.txt"
    img_list.write_text(content)
    result = pack_cli(image_folder, img_list, tmp_path / "out")
    assert result.returncode == 2
    import re

    assert re.search(match, result.stderr), result.stderr


def test_missing_or_empty_img_dir(tmp_path):
    img_list = tmp_path / "list.txt"
    img_list.write_text("a.jpg 0\n")
    result = pack_cli(tmp_path / "nope", img_list, tmp_path / "out")
    assert (
        result.returncode == 2
        and "--img_dir" in result.stderr
        and "does not exist" in result.stderr
    )
    (tmp_path / "empty").mkdir()
    result = pack_cli(tmp_path / "empty", img_list, tmp_path / "out")
    assert result.returncode == 2 and "is empty" in result.stderr


def test_bad_numeric_flags(image_folder, tmp_path):
    img_list = make_list(image_folder, tmp_path)
    result = pack_cli(image_folder, img_list, tmp_path / "o", "--workers", "-1")
    assert result.returncode == 2 and "--workers" in result.stderr
    result = pack_cli(image_folder, img_list, tmp_path / "o", "--records_per_shard", "0")
    assert result.returncode == 2 and "--records_per_shard" in result.stderr


def test_rerun_replaces_previous_dataset(image_folder, tmp_path):
    img_list = make_list(image_folder, tmp_path)
    out = tmp_path / "out"
    assert pack_cli(image_folder, img_list, out, "--records_per_shard", "2").returncode == 0
    assert len(list(out.glob("ds-*.tfrecord"))) == 9
    (out / "unrelated.txt").write_text("keep")
    assert pack_cli(image_folder, img_list, out, "--records_per_shard", "10").returncode == 0
    assert len(list(out.glob("ds-*.tfrecord"))) == 2
    assert (out / "unrelated.txt").exists()
    assert tfrecord.verify_index(out / "ds.index")["records"] == 18


def big_folder(root: Path, count: int) -> None:
    for i in range(count):
        write_image(root / f"c{i % 4}" / f"{i:05d}.jpg", 64, 48, i)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_run_leaves_nothing_that_looks_complete(tmp_path, sig):
    folder = tmp_path / "imgs"
    big_folder(folder, 400)
    img_list = make_list(folder, tmp_path)
    out = tmp_path / "out"
    # Slow the packer down so that the signal lands mid-run: one record per
    # shard means an fsync per record.
    cmd = [
        sys.executable, "-m", "tiacc_training.tools.img2tfrecord",
        "--img_dir", str(folder), "--img_list", str(img_list), "--tfrecords_name", "ds",
        "--dataset_type", "ImageFold", "--output_dir", str(out), "--records_per_shard", "1",
        "--quiet",
    ]  # fmt: skip
    # SIGINT as a terminal delivers it, also where the suite itself runs with
    # SIGINT ignored (a shell's background job), which children inherit.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    staging = None
    while time.monotonic() < deadline and staging is None:
        staged = list(out.glob(".ds.partial-*/ds-*.tfrecord")) if out.exists() else []
        if len(staged) >= 3:
            staging = staged[0].parent
        time.sleep(0.01)
    assert staging is not None, "the packer never started writing"
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "nothing was published" in stderr
        assert not staging.exists(), "Ctrl-C cleans up its staging directory"
    else:
        assert proc.returncode == -signal.SIGKILL
    assert not (out / "ds.index").exists()
    assert not list(out.glob("ds-*")), "no shard is published before the run completes"

    # A rerun removes what the killed run left and completes cleanly.
    result = run_tool(
        "img2tfrecord", "--img_dir", str(folder), "--img_list", str(img_list),
        "--tfrecords_name", "ds", "--dataset_type", "ImageFold", "--output_dir", str(out),
        "--records_per_shard", "100", "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"ds-0000{i}.tfrecord" for i in range(4)]
        + [f"ds-0000{i}.tfrecord.idx" for i in range(4)]
        + ["ds.index"]
    )
    assert tfrecord.verify_index(out / "ds.index")["records"] == 400


def coco_fixture(tmp_path: Path) -> tuple[Path, Path, dict]:
    folder = tmp_path / "coco"
    write_image(folder / "000000000009.jpg", 40, 30, 1)
    write_image(folder / "000000000025.jpg", 20, 50, 2)
    write_image(folder / "000000000030.png", 16, 16, 3, fmt="PNG")
    data = coco_instances(
        [
            (25, "000000000025.jpg", 20, 50),
            (9, "000000000009.jpg", 40, 30),
            (30, "000000000030.png", 16, 16),
        ],
        [
            (1, 9, 3, [4, 3, 20, 15], 300, 0),
            (2, 9, 1, [0, 0, 0, 5], 0, 0),
            (3, 25, 1, [10, 40, 15, 20], 300, 1),
            (4, 25, 3, [1, 1, 5, -2], 0, 0),
        ],
        {1: "person", 3: "car"},
    )
    ann = tmp_path / "instances_val.json"
    ann.write_text(json.dumps(data))
    return folder, ann, data


def test_coco_examples(tmp_path):
    folder, ann, _ = coco_fixture(tmp_path)
    result = run_tool(
        "img2tfrecord", "--img_dir", str(folder), "--img_list", str(ann),
        "--tfrecords_name", "coco_val", "--dataset_type", "coco",
        "--output_dir", str(tmp_path / "out"), "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "packed 3 images (0 skipped) with 2 boxes (2 empty dropped, 1 clipped)" in result.stdout
    index = tfrecord.read_index(tmp_path / "out" / "coco_val.index")
    assert [label for *_, label in index] == [9, 25, 30]  # image ids, sorted
    examples = [tfrecord.read_example(tmp_path / "out" / f, o) for f, _, o, _ in index]
    first = examples[0]
    assert first["image/source_id"] == [b"9"]
    assert first["image/format"] == [b"jpeg"]
    assert (first["image/width"], first["image/height"]) == ([40], [30])
    assert first["image/object/bbox/xmin"] == [pytest.approx(0.1)]
    assert first["image/object/bbox/xmax"] == [pytest.approx(0.6)]
    assert first["image/object/bbox/ymin"] == [pytest.approx(0.1)]
    assert first["image/object/bbox/ymax"] == [pytest.approx(0.6)]
    assert first["image/object/class/label"] == [3]
    assert first["image/object/class/text"] == [b"car"]
    assert first["image/object/area"] == [300.0]
    assert first["image/object/is_crowd"] == [0]
    assert first["image/encoded"] == [(folder / "000000000009.jpg").read_bytes()]
    second = examples[1]
    assert second["image/object/bbox/ymax"] == [1.0]  # 40 + 20 > 50: clipped
    assert second["image/object/is_crowd"] == [1]
    third = examples[2]  # no annotations: empty, correctly typed lists
    assert third["image/object/bbox/xmin"] == [] and third["image/object/class/label"] == []
    assert third["image/format"] == [b"png"]


def test_coco_size_mismatch_and_bad_json(tmp_path):
    folder, ann, data = coco_fixture(tmp_path)
    data["images"][0]["width"] = 99
    ann.write_text(json.dumps(data))
    items, _ = img2tfrecord.read_coco(str(folder), str(ann))
    with pytest.raises(
        img2tfrecord.UsageError, match="header says 20x50 but the annotations say 99x50"
    ):
        img2tfrecord.pack(items, str(tmp_path / "o"), "c", strict=True, show_progress=False)
    ann.write_text(json.dumps({"annotations": []}))
    with pytest.raises(img2tfrecord.UsageError, match="missing key 'images'"):
        img2tfrecord.read_coco(str(folder), str(ann))
    ann.write_text("{not json")
    with pytest.raises(img2tfrecord.UsageError, match="not valid JSON"):
        img2tfrecord.read_coco(str(folder), str(ann))


TOOLS = ("general_image_list", "img2tfrecord", "tfrecord_verify")


def test_three_ways_to_run_the_tools(image_folder, tmp_path):
    # The script file and `python -m` work from a source tree too; the console scripts
    # exist only where the package was installed (pip, maturin develop).
    scripts = Path(sys.executable).parent
    installed = all((scripts / t).exists() for t in TOOLS)
    commands = [
        [sys.executable, str(REPO / "tiacc_training" / "tools" / "general_image_list.py")],
        [sys.executable, "-m", "tiacc_training.tools.general_image_list"],
    ]
    if installed:
        commands.append([str(scripts / "general_image_list")])
    for i, cmd in enumerate(commands):
        out = tmp_path / f"list{i}.txt"
        result = subprocess.run(
            [*cmd, "--img_dir", str(image_folder), "--img_list", str(out)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert out.read_text() == (tmp_path / "list0.txt").read_text()
    for tool in ["img2tfrecord", "tfrecord_verify"]:
        for cmd in (
            [sys.executable, str(REPO / "tiacc_training" / "tools" / f"{tool}.py")],
            [sys.executable, "-m", f"tiacc_training.tools.{tool}"],
            *([[str(scripts / tool)]] if installed else []),
        ):
            result = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60)
            assert result.returncode == 0 and "usage:" in result.stdout
    if not installed:
        pytest.skip(
            f"console scripts not installed next to {sys.executable} (package used from a "
            "source tree): the script-file and `python -m` ways passed"
        )
