"""Chart of benches/results/bench_scaling.json: each row's efficiency against its bound, per model.

Drawn with Pillow (already a dependency), as the other charts. One column
of panels per model. The top panel: each row's efficiency against its
physical bound (the bound over the row's median step, see bench_scaling.py)
on the y axis from 0 to 1.05, a dashed line at the 0.9 goal; the bottom
panel: the same against the larger of that bound and the CPU bound (the
4 ranks' CPU time a step packed onto the machine's cores: what the cores
alone allow). The x axis holds the link rates as categories,
the unshaped link last. One line per row (native DDP, the tiacc rows, any
other row the sweep ran), in the same colour in every panel.

    python benches/plot_scaling.py [--input benches/results/bench_scaling.json] [--out ...png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parent.parent
PANEL_WIDTH, PANEL_HEIGHT = 460, 260
LEFT, RIGHT, TOP, GAP, BOTTOM = 60, 220, 50, 70, 20
BOUND_GOAL = 0.9
BOUND_TOP = 1.05
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
# (the line's value, the panel's title, the y axis's top, or None: fit the data).
PANELS: tuple[tuple[str, str, float | None], ...] = (
    ("efficiency_vs_bound", "efficiency against the bound (bound / step)", BOUND_TOP),
    (
        "efficiency_vs_cpu_and_link_bound",
        "against the bound or the ranks' CPU packed on the cores",
        BOUND_TOP,
    ),
)


def check_format(data: dict, source: Path) -> None:
    """Exits with a message when ``data`` is not bench_scaling's per-model JSON with bounds."""
    models = data.get("setup", {}).get("models")
    rows = data.get("rows") or []
    if not isinstance(models, dict) or any(
        "efficiency_vs_bound" not in x for x in rows if x.get("rate_mbit") is not None
    ):
        sys.exit(
            f"{source}: an older bench_scaling.py format (one model, no bound per row); "
            "rerun benches/bench_scaling.py to write one this chart reads"
        )
    if not any(x.get("rate_mbit") is not None for x in rows):
        sys.exit(f"{source}: no row at any link rate yet")


def rate_order(rates: set[float]) -> list[float]:
    """The rates left to right: shaped ones ascending, the unshaped link (0) last."""
    return sorted(r for r in rates if r > 0) + ([0.0] if 0 in rates else [])


def rate_label(rate: float) -> str:
    """``1 Gbit/s``, ``500 Mbit/s`` or ``unshaped``."""
    if rate == 0:
        return "unshaped"
    return f"{rate / 1000:g} Gbit/s" if rate >= 1000 else f"{rate:g} Mbit/s"


def dashed_line(
    pen: ImageDraw.ImageDraw, start: tuple[float, float], end_x: float, color: tuple
) -> None:
    """A horizontal dashed line from ``start`` to ``end_x``."""
    x, y = start
    while x < end_x:
        pen.line([(x, y), (min(x + 8, end_x), y)], fill=color, width=2)
        x += 14


def draw_panel(
    pen: ImageDraw.ImageDraw,
    origin: tuple[float, float],
    lines: list[dict],
    metric: str,
    title: str,
    top: float,
    colors: dict[str, tuple],
) -> None:
    """One panel: ``metric`` of every row of ``lines`` (one model) against the rate."""
    font = ImageFont.load_default()
    left, upper = origin
    right, lower = left + PANEL_WIDTH, upper + PANEL_HEIGHT
    rates = rate_order({x["rate_mbit"] for x in lines})
    step = PANEL_WIDTH / len(rates)
    xs = {rate: left + step * (i + 0.5) for i, rate in enumerate(rates)}

    def y(value: float) -> float:
        return lower - PANEL_HEIGHT * min(value, top) / top

    pen.text((left, upper - 16), title, fill="black", font=font)
    for tick in range(0, int(top * 10) + 1, 2):
        value = tick / 10
        pen.line([(left, y(value)), (right, y(value))], fill=(230, 230, 230))
        pen.text((left - 30, y(value) - 6), f"{value:.1f}", fill="black", font=font)
    for rate, x in xs.items():
        pen.line([(x, upper), (x, lower)], fill=(240, 240, 240))
        pen.text((x - 22, lower + 6), rate_label(rate), fill="black", font=font)
    if metric == "efficiency_vs_bound":
        dashed_line(pen, (left, y(BOUND_GOAL)), right, (200, 40, 40))
    pen.rectangle([left, upper, right, lower], outline="black")
    for label, color in colors.items():
        points = [
            (xs[x["rate_mbit"]], y(x[metric]))
            for rate in rates
            for x in lines
            if x["pipeline"] == label and x["rate_mbit"] == rate and x.get(metric) is not None
        ]
        if len(points) > 1:
            pen.line(points, fill=color, width=3)
        for px, py in points:
            pen.ellipse([px - 4, py - 4, px + 4, py + 4], fill=color)


def panel_origin(column: int, row: int) -> tuple[float, float]:
    """The top left corner of the panel in ``column`` (a model) and ``row`` (a metric)."""
    return LEFT + column * (PANEL_WIDTH + LEFT), TOP + 20 + row * (PANEL_HEIGHT + GAP)


def _panel_top(lines: list[dict], metric: str, fixed: float | None) -> float:
    """The y axis's top: ``fixed``, else 1.05 or the data's largest value, whichever is more."""
    if fixed is not None:
        return fixed
    return max([BOUND_TOP] + [x[metric] for x in lines if x.get(metric) is not None])


def draw(data: dict, out: Path) -> None:
    """Renders the chart of ``data`` (bench_scaling's JSON) into ``out``."""
    models = list(data["setup"]["models"])
    shaped = [x for x in data["rows"] if x["rate_mbit"] is not None]
    labels = list(dict.fromkeys(x["pipeline"] for x in shaped))
    colors = {label: COLORS[i % len(COLORS)] for i, label in enumerate(labels)}
    width = LEFT + len(models) * (PANEL_WIDTH + LEFT) + RIGHT
    height = TOP + len(PANELS) * (PANEL_HEIGHT + GAP) + BOTTOM
    image = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    setup = data["setup"]
    pen.text(
        (LEFT, 10),
        f"2 nodes x {setup.get('ranks_per_node', 2)} ranks, {setup.get('native', 'gloo')}: "
        "each row against its bound (max(compute floor, forward + link time one way)) "
        f"and against the CPU bound too; dashed: the {BOUND_GOAL} goal",
        fill="black",
        font=font,
    )
    for col, model in enumerate(models):
        own = [x for x in shaped if x["model"] == model]
        if not own:
            continue
        about = setup["models"][model]
        for row, (metric, title, fixed) in enumerate(PANELS):
            heading = f"{model} (batch {about['batch_per_rank']}): {title}"
            top = _panel_top(own, metric, fixed)
            draw_panel(pen, panel_origin(col, row), own, metric, heading, top, colors)
    legend_x = LEFT + len(models) * (PANEL_WIDTH + LEFT)
    for index, (label, color) in enumerate(colors.items()):
        legend_y = TOP + 30 + index * 22
        pen.line([(legend_x, legend_y + 6), (legend_x + 30, legend_y + 6)], fill=color, width=3)
        pen.text((legend_x + 38, legend_y), label, fill="black", font=font)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--input",
        "--json",
        dest="input",
        type=Path,
        default=REPO / "benches/results/bench_scaling.json",
        help="bench_scaling.py's JSON",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benches/results/bench_scaling.png")
    args = parser.parse_args()
    data = json.loads(args.input.read_text())
    check_format(data, args.input)
    draw(data, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
