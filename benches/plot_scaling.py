"""Line chart of benches/results/bench_scaling.json: scaling efficiency against link rate.

Drawn with Pillow (already a dependency), as the other charts. One line per
row (native DDP, torch's hooks, the tiacc rows), scaling efficiency against
the compute floor (the same 4 ranks with no gradient exchange, see
bench_scaling.py) on the y axis, the link rate on a log x axis with the
unshaped link drawn at the right end.

    python benches/plot_scaling.py [--json benches/results/bench_scaling.json] [--out ...png]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 1000, 560
LEFT, RIGHT, TOP, BOTTOM = 70, 300, 50, 60
COLORS = [
    (110, 110, 110),
    (90, 140, 210),
    (40, 90, 170),
    (240, 150, 60),
    (220, 90, 30),
    (170, 40, 20),
    (150, 90, 190),
    (30, 150, 80),
]


def _x_positions(rates: list[float]) -> dict[float, float]:
    """Pixel x of each rate: log scale, the unshaped link (0) one step past the fastest."""
    shaped = sorted(r for r in rates if r > 0)
    lo, hi = math.log10(shaped[0]), math.log10(shaped[-1])
    span = max(hi - lo, 1e-9)
    has_unshaped = 0 in rates
    width = WIDTH - LEFT - RIGHT
    usable = width * (0.85 if has_unshaped else 1.0)
    positions = {r: LEFT + (math.log10(r) - lo) / span * usable for r in shaped}
    if has_unshaped:
        positions[0.0] = LEFT + width
    return positions


def draw(data: dict, out: Path) -> None:
    """Renders the chart of ``data`` (bench_scaling's JSON) into ``out``."""
    lines = [x for x in data["rows"] if x["rate_mbit"] is not None]
    rates = sorted({x["rate_mbit"] for x in lines})
    labels = list(dict.fromkeys(x["pipeline"] for x in lines))
    xs = _x_positions(rates)
    top_eff = max(1.0, max(x["efficiency_vs_compute_floor"] for x in lines))
    height = HEIGHT - TOP - BOTTOM

    def y(eff: float) -> float:
        return TOP + height * (1 - eff / top_eff)

    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    pen = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    setup = data["setup"]
    pen.text(
        (LEFT, 12),
        f"{setup['description']}, batch {setup['batch_per_rank']} per rank, 2 nodes x 2 ranks: "
        "scaling efficiency (compute floor / step) against link rate",
        fill="black",
        font=font,
    )
    for tick in range(0, int(top_eff * 10) + 1, 2):
        eff = tick / 10
        pen.line([(LEFT, y(eff)), (WIDTH - RIGHT, y(eff))], fill=(230, 230, 230))
        pen.text((LEFT - 40, y(eff) - 6), f"{eff:.1f}", fill="black", font=font)
    for rate, x in xs.items():
        pen.line([(x, TOP), (x, TOP + height)], fill=(235, 235, 235))
        text = "unshaped" if rate == 0 else f"{rate / 1000:g} Gbit/s"
        pen.text((x - 20, TOP + height + 10), text, fill="black", font=font)
    pen.rectangle([LEFT, TOP, WIDTH - RIGHT, TOP + height], outline="black")
    for index, label in enumerate(labels):
        color = COLORS[index % len(COLORS)]
        points = sorted(
            (xs[x["rate_mbit"]], y(x["efficiency_vs_compute_floor"]))
            for x in lines
            if x["pipeline"] == label
        )
        pen.line(points, fill=color, width=3)
        for px, py in points:
            pen.ellipse([px - 4, py - 4, px + 4, py + 4], fill=color)
        legend_y = TOP + 10 + index * 22
        pen.line(
            [(WIDTH - RIGHT + 20, legend_y + 6), (WIDTH - RIGHT + 50, legend_y + 6)],
            fill=color,
            width=3,
        )
        pen.text((WIDTH - RIGHT + 58, legend_y), label, fill="black", font=font)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=REPO / "benches/results/bench_scaling.json")
    parser.add_argument("--out", type=Path, default=REPO / "benches/results/bench_scaling.png")
    args = parser.parse_args()
    draw(json.loads(args.json.read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
