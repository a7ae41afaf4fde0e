"""The Python examples in README.md and docs/*.md run, on a small packed dataset.

Each page's ```python blocks run in order in one fresh interpreter (a world of
one with torchrun's variables, on the CPU), in a folder that holds what the examples name:
``train_images/`` (an image folder), ``train_list`` and ``train/train.index``
with its shards. A block preceded by ``<!-- not-run: REASON -->`` is reported
as skipped with its reason. Tracebacks point at the page and line.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _launch import free_port
from conftest import REPO, write_image

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(?P<reason>\S.*?)\s*-->$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the block's first code line
    code: str
    not_run: str | None


def blocks(page: Path) -> list[Block]:
    """The ```python blocks of ``page``, with the reason a block is not run."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            match = NOT_RUN.match(before)
            code = "\n".join(lines[start:end]) + "\n"
            found.append(Block(page, start + 1, code, match["reason"] if match else None))
            i = end
        i += 1
    return found


def imported(code: str) -> set[str]:
    """The top-level modules a block imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


RUNNER = """
import json, sys
blocks = json.loads(sys.argv[1])
namespace = {"__name__": "__main__"}
for path, line, code in blocks:
    # Padding puts the code on its own line numbers, so tracebacks name the page's lines.
    exec(compile("\\n" * (line - 1) + code, path, "exec"), namespace)
print("all blocks ran")
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """train_images/ (2 classes x 4 JPEGs), train_list and train/ packed from them."""
    from tiacc_training.tools import general_image_list, img2tfrecord

    root = tmp_path_factory.mktemp("docs")
    for c, name in enumerate(["cat", "dog"]):
        for i in range(4):
            write_image(root / "train_images" / name / f"{name}_{i}.jpg", 64, 48, 10 * c + i)
    general_image_list.main(["--img_dir", str(root / "train_images"),
                             "--img_list", str(root / "train_list")])  # fmt: skip
    img2tfrecord.main(["--img_dir", str(root / "train_images"), "--img_list",
                       str(root / "train_list"), "--tfrecords_name", "train", "--dataset_type",
                       "ImageFold", "--output_dir", str(root / "train"), "--quiet"])  # fmt: skip
    return root


def test_the_pages_have_examples_and_every_marker_has_a_block():
    every = [b for page in PAGES for b in blocks(page)]
    assert len([b for b in every if b.not_run is None]) >= 8, every
    for page in PAGES:
        lines = page.read_text().splitlines()
        fenced = False  # markers shown inside a code block are examples, not markers
        for n, line in enumerate(lines):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and "<!--" in line and "not-run" in line:
                assert NOT_RUN.match(line.strip()), f"{page}:{n + 1}: malformed marker {line!r}"
                following = next(x for x in lines[n + 1 :] if x.strip())
                assert following.strip() == "```python", f"{page}:{n + 1}: no block after it"


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if any(b.not_run is None for b in blocks(p))],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_the_examples_of_a_page_run(page, workspace, tmp_path):
    if not hasattr(torch.amp, "GradScaler"):
        pytest.skip("the examples use torch.amp.GradScaler, new in torch 2.3")
    run = [(str(b.page), b.line, b.code) for b in blocks(page) if b.not_run is None]
    missing = sorted({m for _, _, code in run for m in imported(code)
                      if importlib.util.find_spec(m) is None})  # fmt: skip
    if missing:  # the frameworks page's, in a torch leg without them
        pytest.skip(f"{page.name}'s examples import {', '.join(missing)}, not installed here")
    cwd = tmp_path / "cwd"
    shutil.copytree(workspace, cwd)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIACC_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    # What torchrun sets for a world of one: the examples call the script's
    # own init_process_group("gloo"), as a torchrun script does.
    env.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(run)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and "all blocks ran" in proc.stdout, proc.stderr[-5000:]


NOT_RUN_BLOCKS = [b for page in PAGES for b in blocks(page) if b.not_run is not None]


@pytest.mark.parametrize(
    "block",
    NOT_RUN_BLOCKS or [None],
    ids=lambda b: f"{b.page.relative_to(REPO)}:{b.line}" if b else "none",
)
def test_blocks_marked_not_run(block):
    if block is None:
        pytest.skip("no block is marked not-run")
    compile(block.code, f"{block.page}:{block.line}", "exec")  # it is Python at least
    pytest.skip(f"not run: {block.not_run}")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the headings of ``page``."""
    found = set()
    for line in re.sub(r"(?ms)^```.*?^```", "", page.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_relative_links_and_anchors_resolve():
    link = re.compile(r"\]\(([^)\s]+)\)")
    for page in PAGES:
        text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())  # not inside code blocks
        for target in link.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.exists(), f"{page.name}: broken link {target}"
            if anchor and resolved.suffix == ".md":
                assert anchor in anchors(resolved), f"{page.name}: no heading for {target}"


def test_the_readme_fits_on_a_screen_or_two_and_links_the_frameworks_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "README.md: at most 250 lines; details go to docs/"
    section = readme.split("## Frameworks", 1)[-1].split("\n## ", 1)[0]
    assert "| Ray Train |" in section and "](docs/frameworks.md)" in section, section
