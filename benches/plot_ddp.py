"""Bar chart of benches/results/bench_ddp.json: speed-up over native DDP.

Drawn with Pillow (already a dependency) so the benchmarks need no plotting
library. One bar per pipeline, labelled with its ratio, median step time and
link traffic; a vertical line marks native (1.0x).

    python benches/plot_ddp.py [--json benches/results/bench_ddp.json] [--out ...png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parent.parent

WIDTH = 1100
ROW = 34
LABEL_W = 260
RIGHT_PAD = 250
TOP = 70
COLORS = {"native": (150, 150, 150), "torch": (120, 160, 210), "tiacc": (230, 120, 40)}


def bar_color(label: str) -> tuple[int, int, int]:
    """Grey for native DDP, blue for torch's hooks, orange for tiacc."""
    if label.startswith("tiacc"):
        return COLORS["tiacc"]
    if label.startswith("torch"):
        return COLORS["torch"]
    return COLORS["native"]


def plot(result: dict, out: Path) -> None:
    """Writes the chart of one bench_ddp result to ``out``."""
    rows = result["rows"]
    setup = result["setup"]
    height = TOP + ROW * len(rows) + 40
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=15)
    small = ImageFont.load_default(size=13)
    title = (
        f"DDP step time, {setup['nodes']} nodes x {setup['ranks_per_node']} ranks, "
        f"{setup['rate_mbit_each_way']:g} Mbit/s link, "
        f"{result['grad_bytes'] / 1e6:.1f} MB of gradients: speed-up over native DDP (gloo)"
    )
    draw.text((10, 12), title, fill="black", font=font)
    top_ratio = max(r["native_over_this"] for r in rows)
    plot_w = WIDTH - LABEL_W - RIGHT_PAD

    def x_of(ratio: float) -> float:
        return LABEL_W + plot_w * ratio / top_ratio

    for i, row in enumerate(rows):
        y = TOP + i * ROW
        channels = "" if row["channels"] is None else f" ({row['channels']} ch)"
        draw.text((10, y + 6), row["pipeline"] + channels, fill="black", font=font)
        draw.rectangle(
            [LABEL_W, y + 4, x_of(row["native_over_this"]), y + ROW - 6],
            fill=bar_color(row["pipeline"]),
        )
        note = (
            f"{row['native_over_this']:.2f}x  {row['median_ms']:.0f} ms  "
            f"{row['link_bytes_per_step_per_rank'] / 1e6:.2f} MB/step/rank"
        )
        draw.text((x_of(row["native_over_this"]) + 6, y + 8), note, fill="black", font=small)
    base = x_of(1.0)
    draw.line([base, TOP - 6, base, TOP + ROW * len(rows)], fill="black", width=1)
    draw.text((base - 12, TOP + ROW * len(rows) + 6), "1.0x", fill="black", font=small)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=REPO / "benches/results/bench_ddp.json")
    parser.add_argument("--out", type=Path, default=REPO / "benches/results/bench_ddp.png")
    args = parser.parse_args()
    plot(json.loads(args.json.read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
