"""Bar charts of benches/results/bench_ddp.json: each row's step time over its floor.

Drawn with Pillow (already a dependency) so the benchmarks need no plotting
library. One panel per model, one bar per row (median step / (compute floor
+ link bound), see bench_ddp.py), labelled with that ratio, the median and
the floor (and the ratio to the DDP floor, where the row has one); a
vertical line marks the floor (1.0). The compute floor row is
the floor itself, so it is named in the panel's title instead of drawn.

    python benches/plot_ddp.py [--json benches/results/bench_ddp.json] [--out ...png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parent.parent

WIDTH = 1100
ROW = 30
LABEL_W = 290
RIGHT_PAD = 360
PANEL_HEAD = 56
PANEL_FOOT = 34
TOP = 46
COLORS = {
    "native": (150, 150, 150),
    "torch": (120, 160, 210),
    "tiacc": (230, 120, 40),
    "loopback": (120, 190, 120),
}


def bar_color(label: str) -> tuple[int, int, int]:
    """Grey for native DDP, blue for torch's hooks, orange for tiacc, green for loopback."""
    for prefix, color in COLORS.items():
        if label.startswith(prefix):
            return color
    return COLORS["native"]


def panel_rows(model: dict) -> list[dict]:
    """The rows drawn for one model (all but the compute floor)."""
    return [r for r in model["rows"] if r["mode"] != "none"]


def plot(result: dict, out: Path) -> None:
    """Writes the charts of one bench_ddp result to ``out``."""
    setup = result["setup"]
    models = result["models"]
    height = TOP + sum(PANEL_HEAD + ROW * len(panel_rows(m)) + PANEL_FOOT for m in models.values())
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=15)
    small = ImageFont.load_default(size=13)
    title = (
        f"DDP step time over its floor (compute floor + link bound), "
        f"{setup['nodes']} nodes x {setup['ranks_per_node']} ranks, "
        f"{setup['rate_mbit_each_way']:g} Mbit/s link"
    )
    draw.text((10, 12), title, fill="black", font=font)
    plot_w = WIDTH - LABEL_W - RIGHT_PAD
    y0 = TOP
    for name, model in models.items():
        rows = panel_rows(model)
        info = setup["models"][name]
        head = (
            f"{name}: {info['grad_bytes'] / 1e6:.1f} MB of gradients in "
            f"{info['parameter_tensors']} tensors ({info['params_under_4kb']} under 4 KB, "
            f"largest layer {info['largest_layer_share'] * 100:.0f}%), "
            f"compute floor {model['compute_floor_ms']:.0f} ms"
        )
        draw.text((10, y0 + 10), head, fill="black", font=font)
        speed = model.get("loopback_tiacc_speed_over_gloo")
        if speed is not None:
            draw.text(
                (10, y0 + 30),
                f"loopback: tiacc speed / gloo speed = {speed:.2f}",
                font=small,
                fill="black",
            )
        top_ratio = max([1.0, *(r["ratio_to_floor"] for r in rows)])

        def x_of(ratio: float, top: float = top_ratio) -> float:
            return LABEL_W + plot_w * ratio / top

        top_y = y0 + PANEL_HEAD
        base = x_of(1.0)
        bottom = top_y + ROW * len(rows)
        # The floor line first, so bars and labels stay readable over it.
        draw.line([base, top_y - 4, base, bottom], fill="black", width=1)
        draw.text((base - 20, bottom + 4), "floor", fill="black", font=small)
        for i, row in enumerate(rows):
            y = top_y + i * ROW
            draw.text((10, y + 6), row["pipeline"], fill="black", font=font)
            draw.rectangle(
                [LABEL_W, y + 4, x_of(row["ratio_to_floor"]), y + ROW - 6],
                fill=bar_color(row["pipeline"]),
            )
            note = (
                f"{row['ratio_to_floor']:.2f}x  {row['median_ms']:.0f} ms "
                f"(floor {row['floor_ms']:.0f} ms"
            )
            if row.get("ratio_to_ddp_floor") is not None:
                ddp = row["ratio_to_ddp_floor"]
                note += f"; DDP floor {row['ddp_floor_ms']:.0f} ms: {ddp:.2f}x"
            note += ")"
            at = (x_of(row["ratio_to_floor"]) + 6, y + 8)
            left, _, right, _ = draw.textbbox(at, note, font=small)
            draw.rectangle([left - 2, y, right + 2, y + ROW - 1], fill="white")
            draw.text(at, note, fill="black", font=small)
        y0 = bottom + PANEL_FOOT
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
