"""Bar chart of benches/results/bench_input.json: images/s of each input pipeline.

Drawn with Pillow (already a dependency), like ``plot_ddp.py``. One bar per
pipeline (median of the repeats, with a whisker from the slowest to the
fastest repeat), labelled with images/s and the ratio to the stock
pipeline; vertical lines mark what the engine alone and PIL's decode alone
reach on the machine's cores. ``bench_input.py`` draws it after each run.

    python benches/plot_input.py [--json benches/results/bench_input.json] [--out ...png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parent.parent

LABELS = {
    "a_imagefolder": "(a) ImageFolder + PIL, torch DataLoader (stock)",
    "b_per_item": "(b) IndexTFRDataset, PIL path (fused=False)",
    "c_fused": "(c) IndexTFRDataset fused, torch DataLoader",
    "c_fused_uint8": "(c) fused, uint8, torch DataLoader",
    "d_dropin": "(d) fused, drop-in DataLoader",
    "d_dropin_uint8": "(d) drop-in DataLoader, uint8",
    "e_dali_cpu": "(e) NVIDIA DALI CPU pipeline",
}
COLORS = {"a": (150, 150, 150), "b": (230, 170, 110), "c": (230, 140, 60), "d": (220, 100, 20)}
OTHER = (120, 160, 210)
WIDTH, ROW, LABEL_W, RIGHT_PAD, TOP = 1100, 30, 380, 190, 70


def plot(result: dict, out: Path) -> None:
    """Writes the chart of one bench_input result to ``out``."""
    rows = [(key, value) for key, value in result["results"].items()]
    engine, decode = result["engine_bound"], result["decode_bound"]
    top = max([engine["bound"], decode["bound"], *(r["max"] for _, r in rows)]) * 1.05
    height = TOP + ROW * len(rows) + 60
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=15)
    small = ImageFont.load_default(size=13)
    config, machine = result["config"], result["machine"]
    draw.text(
        (10, 12),
        f"Input pipeline, images/s ({config['images']} ImageNet-sized JPEGs, batch "
        f"{config['batch']}, {config['workers']} workers, RandomResizedCrop(224) + flip + "
        "ToTensor + Normalize)",
        fill="black",
        font=font,
    )
    draw.text(
        (10, 34),
        f"{machine.get('logical_cores', '?')} cores ({machine.get('cpu_model', '?')}), "
        f"median of {config['repeats']} repeats, whisker: slowest to fastest",
        fill="black",
        font=small,
    )
    plot_w = WIDTH - LABEL_W - RIGHT_PAD

    def x_of(rate: float) -> float:
        return LABEL_W + plot_w * rate / top

    bottom = TOP + ROW * len(rows)
    for bound, name in ((engine, "engine alone"), (decode, "PIL decode alone")):
        x = x_of(bound["bound"])
        draw.line([x, TOP - 6, x, bottom], fill=(90, 90, 90), width=1)
        draw.text((x - 40, bottom + 6 + (18 if name.startswith("PIL") else 0)),
                  f"{name} {bound['bound']:.0f}/s", fill="black", font=small)  # fmt: skip
    for i, (key, row) in enumerate(rows):
        y = TOP + i * ROW
        draw.text((10, y + 6), LABELS.get(key, key), fill="black", font=font)
        color = COLORS.get(key[0], OTHER)
        draw.rectangle([LABEL_W, y + 4, x_of(row["median_images_per_s"]), y + ROW - 6], fill=color)
        mid = y + ROW // 2 - 1
        draw.line([x_of(row["min"]), mid, x_of(row["max"]), mid], fill="black", width=2)
        note = f"{row['median_images_per_s']:.0f}/s  {row['ratio_vs_stock']:.2f}x stock"
        at = (x_of(max(row["max"], row["median_images_per_s"])) + 6, y + 8)
        left, _, right, _ = draw.textbbox(at, note, font=small)
        draw.rectangle([left - 2, y, right + 2, y + ROW - 1], fill="white")  # over the lines
        draw.text(at, note, fill="black", font=small)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=REPO / "benches/results/bench_input.json")
    parser.add_argument("--out", type=Path, default=REPO / "benches/results/bench_input.png")
    args = parser.parse_args()
    plot(json.loads(args.json.read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
