"""Write the image list that ``img2tfrecord`` packs.

Scans an ImageFolder-style directory (one sub-folder per class) and writes
one line per image, ``relative/path label``. Class ids follow the sorted
class-folder names, exactly as ``torchvision.datasets.ImageFolder`` assigns
them. The class-name-to-id mapping is written as a pickled dict beside the
list (``LIST.label_str2int.pkl``), or read from ``--label_str2int`` so that a
validation list gets the same ids as its training list.

Usage:
    python3 tiacc_training/tools/general_image_list.py --img_dir train/ --img_list train_list
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections.abc import Sequence

from tiacc_training.tools._cli import UsageError, die, warn

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def is_image_file(name: str) -> bool:
    """Whether ``name`` has one of the image extensions (case-insensitive)."""
    return name.lower().endswith(IMAGE_EXTENSIONS)


def find_classes(img_dir: str) -> list[str]:
    """Sorted class-folder names of ``img_dir`` (hidden folders excluded).

    Raises:
        UsageError: ``img_dir`` is missing, not a directory, or has no
            class folders.
    """
    if not os.path.exists(img_dir):
        raise UsageError(f"--img_dir {img_dir!r} does not exist")
    if not os.path.isdir(img_dir):
        raise UsageError(f"--img_dir {img_dir!r} is not a directory")
    classes = sorted(
        e.name for e in os.scandir(img_dir) if e.is_dir() and not e.name.startswith(".")
    )
    if not classes:
        raise UsageError(f"--img_dir {img_dir!r} has no class folders (expected DIR/CLASS/IMAGE)")
    return classes


def load_mapping(path: str) -> dict[str, int]:
    """Loads a pickled ``{class_name: class_id}`` dict.

    Only load mapping files you trust: pickle can run code.

    Raises:
        UsageError: The file is missing or is not such a dict.
    """
    try:
        with open(path, "rb") as f:
            mapping = pickle.load(f)
    except FileNotFoundError:
        raise UsageError(f"--label_str2int {path!r} does not exist") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise UsageError(f"--label_str2int {path!r} is not a readable pickle: {e}") from None
    if not isinstance(mapping, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
        for k, v in mapping.items()
    ):
        raise UsageError(f"--label_str2int {path!r} must hold a dict of str -> int")
    return mapping


def list_images(
    img_dir: str, mapping: dict[str, int] | None = None
) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """Collects ``(relative_path, label)`` for every image under ``img_dir``.

    Args:
        img_dir: Folder with one sub-folder per class.
        mapping: Class-name-to-id mapping to use; by default ids follow the
            sorted class names (torchvision's ``ImageFolder`` order).

    Returns:
        The entries in class then path order, and the mapping used.

    Raises:
        UsageError: Bad ``img_dir``, a class missing from ``mapping``, a file
            name that cannot be written on one line, or no images at all.
    """
    classes = find_classes(img_dir)
    if mapping is None:
        mapping = {name: i for i, name in enumerate(classes)}
    else:
        unknown = [c for c in classes if c not in mapping]
        if unknown:
            raise UsageError(
                f"class folder {unknown[0]!r} in {img_dir!r} is not in the --label_str2int "
                f"mapping ({len(unknown)} unknown class(es): {', '.join(unknown[:5])})"
            )
    entries: list[tuple[str, int]] = []
    for name in classes:
        class_dir = os.path.join(img_dir, name)
        found = 0
        # The walk order of torchvision's ImageFolder: folders sorted by path.
        for root, _, files in sorted(os.walk(class_dir, followlinks=True)):
            for file_name in sorted(files):
                if not is_image_file(file_name):
                    continue
                rel = os.path.relpath(os.path.join(root, file_name), img_dir)
                if "\n" in rel or "\r" in rel:
                    raise UsageError(f"file name with a line break cannot be listed: {rel!r}")
                entries.append((rel, mapping[name]))
                found += 1
        if found == 0:
            warn(f"class folder {class_dir!r} has no images")
    if not entries:
        raise UsageError(
            f"--img_dir {img_dir!r} has no images ({', '.join(IMAGE_EXTENSIONS)}) in its "
            "class folders"
        )
    return entries, mapping


def write_atomic(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file and a rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def default_mapping_path(img_list: str) -> str:
    """Where the mapping is written when ``--label_str2int`` is not given."""
    return f"{img_list}.label_str2int.pkl"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    p = argparse.ArgumentParser(
        prog="general_image_list",
        description="List the images of a class-per-folder directory as `path label` lines.",
    )
    p.add_argument("--img_dir", required=True, help="folder with one sub-folder per class")
    p.add_argument("--img_list", required=True, help="list file to write")
    p.add_argument(
        "--label_str2int",
        default=None,
        help="pickled {class_name: id} mapping to use (default: sorted class names, "
        "written to IMG_LIST.label_str2int.pkl)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        mapping = load_mapping(args.label_str2int) if args.label_str2int else None
        entries, mapping = list_images(args.img_dir, mapping)
        text = "".join(f"{path} {label}\n" for path, label in entries)
        out_dir = os.path.dirname(os.path.abspath(args.img_list))
        os.makedirs(out_dir, exist_ok=True)
        write_atomic(args.img_list, text.encode("utf-8"))
        mapping_note = ""
        if not args.label_str2int:
            mapping_path = default_mapping_path(args.img_list)
            write_atomic(mapping_path, pickle.dumps(mapping, protocol=4))
            mapping_note = f", mapping in {mapping_path}"
    except UsageError as e:
        die("general_image_list", str(e))
    except OSError as e:
        die("general_image_list", f"{e.filename or ''}: {e.strerror or e}", status=1)
    classes = len({label for _, label in entries})
    print(f"listed {len(entries)} images of {classes} classes in {args.img_list}{mapping_note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
