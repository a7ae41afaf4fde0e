"""general_image_list: ImageFolder-compatible class ids, mapping files, bad input."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
from torchvision.datasets import ImageFolder

from tests.conftest import run_tool, write_image
from tiacc_training.tools import general_image_list as gil


def read_list(path):
    return [tuple(line.rsplit(" ", 1)) for line in path.read_text().splitlines()]


def test_ids_match_torchvision_imagefolder(image_folder, tmp_path):
    out = tmp_path / "list.txt"
    assert gil.main(["--img_dir", str(image_folder), "--img_list", str(out)]) == 0
    entries = read_list(out)
    folder = ImageFolder(str(image_folder))
    expected = [(os.path.relpath(path, image_folder), str(label)) for path, label in folder.samples]
    assert entries == expected
    mapping = pickle.loads((tmp_path / "list.txt.label_str2int.pkl").read_bytes())
    assert mapping == folder.class_to_idx


def test_extensions_case_insensitive_and_non_images_ignored(tmp_path):
    root = tmp_path / "imgs"
    write_image(root / "a" / "x.JPG", 8, 8, 0)
    write_image(root / "a" / "y.Jpeg", 8, 8, 1)
    write_image(root / "b" / "z.PNG", 8, 8, 2, fmt="PNG")
    write_image(root / "b" / "deep" / "w.bmp", 8, 8, 3, fmt="BMP")
    write_image(root / "b" / "v.webp", 8, 8, 4, fmt="WEBP")
    (root / "b" / "notes.txt").write_text("not an image")
    entries, mapping = gil.list_images(str(root))
    assert mapping == {"a": 0, "b": 1}
    assert [p for p, _ in entries] == ["a/x.JPG", "a/y.Jpeg", "b/v.webp", "b/z.PNG", "b/deep/w.bmp"]
    # The same order as torchvision's ImageFolder (BMP/PNG/JPEG/WebP are all in its list).
    folder = ImageFolder(str(root))
    assert [os.path.relpath(s, root) for s, _ in folder.samples] == [p for p, _ in entries]


def test_given_mapping_is_used_and_unknown_class_is_an_error(image_folder, tmp_path):
    mapping_path = tmp_path / "m.pkl"
    mapping_path.write_bytes(pickle.dumps({"ant": 10, "bee": 20, "cat": 30, "dog": 40}))
    out = tmp_path / "val.txt"
    args = ["--img_dir", str(image_folder), "--img_list", str(out)]
    assert gil.main([*args, "--label_str2int", str(mapping_path)]) == 0
    assert {label for _, label in read_list(out)} == {"10", "20", "30"}
    assert not (tmp_path / "val.txt.label_str2int.pkl").exists()

    mapping_path.write_bytes(pickle.dumps({"ant": 0, "bee": 1}))
    result = run_tool("general_image_list", *args, "--label_str2int", str(mapping_path))
    assert result.returncode == 2
    assert "'cat'" in result.stderr and "not in the --label_str2int mapping" in result.stderr


def test_bad_mapping_file(image_folder, tmp_path):
    bad = tmp_path / "bad.pkl"
    bad.write_bytes(pickle.dumps(["not", "a", "dict"]))
    with pytest.raises(gil.UsageError, match="dict of str -> int"):
        gil.load_mapping(str(bad))
    with pytest.raises(gil.UsageError, match="does not exist"):
        gil.load_mapping(str(tmp_path / "missing.pkl"))


def test_missing_and_empty_img_dir(tmp_path):
    result = run_tool("general_image_list", "--img_dir", str(tmp_path / "nope"), "--img_list", "x")
    assert result.returncode == 2 and "does not exist" in result.stderr
    (tmp_path / "empty").mkdir()
    result = run_tool("general_image_list", "--img_dir", str(tmp_path / "empty"), "--img_list", "x")
    assert result.returncode == 2 and "no class folders" in result.stderr
    (tmp_path / "empty" / "cls").mkdir()
    (tmp_path / "empty" / "cls" / "readme.txt").write_text("x")
    result = run_tool("general_image_list", "--img_dir", str(tmp_path / "empty"), "--img_list", "x")
    assert result.returncode == 2 and "has no images" in result.stderr


def test_paths_with_spaces(tmp_path):
    root = tmp_path / "imgs"
    write_image(root / "my class" / "an image.jpg", 8, 8, 0)
    entries, _ = gil.list_images(str(root))
    assert entries == [("my class/an image.jpg", 0)]
    shutil.rmtree(root)
