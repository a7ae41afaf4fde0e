"""Line chart of benches/results/bench_amp.json: held-out accuracy against wall time.

Drawn with Pillow (already a dependency), as the other charts. One line per
run kind (fp32, plain AMP, the policy with each schedule): at each epoch,
the mean over seeds of the wall time since the run started (x) and of the
held-out accuracy (y). Epochs the kind trained under autocast are drawn as
filled dots, fp32 epochs as open ones; the fp32 line is drawn wide, so a
kind that never turned autocast on shows inside it. With a stress section, a second
panel shows the stress case's runs the same way.

    python benches/plot_amp.py [--json benches/results/bench_amp.json] [--out ...png]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parent.parent
WIDTH, PANEL_HEIGHT = 1000, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 250, 40, 50
COLORS = [
    (110, 110, 110),
    (40, 90, 170),
    (240, 150, 60),
    (220, 90, 30),
    (30, 150, 80),
    (150, 90, 190),
    (170, 40, 20),
    (90, 140, 210),
]


def kind_name(run: dict[str, Any]) -> str:
    """The run kind's name, as bench_amp.py prints it."""
    return "fp32" if run["kind"] == "fp32" else f"{run['kind']}_{run['dtype']}"


def curves(runs: list[dict[str, Any]]) -> dict[str, list[tuple[float, float, bool]]]:
    """Per run kind, per epoch: mean elapsed wall time (s), mean accuracy, autocast on."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_kind.setdefault(kind_name(run), []).append(run)
    out = {}
    for name, mine in by_kind.items():
        epochs = min(len(r["epochs"]) for r in mine)
        points = []
        for e in range(epochs):
            elapsed = [sum(x["wall_s"] for x in r["epochs"][: e + 1]) for r in mine]
            accuracy = [r["epochs"][e]["heldout_accuracy"] for r in mine]
            on = any(r["epochs"][e]["autocast"] for r in mine)
            points.append((statistics.fmean(elapsed), statistics.fmean(accuracy), on))
        out[name] = points
    return out


def draw_panel(
    pen: ImageDraw.ImageDraw,
    top: int,
    title: str,
    lines: dict[str, list[tuple[float, float, bool]]],
) -> None:
    """One chart of ``lines`` with its title, axes and legend, ``top`` pixels down."""
    font = ImageFont.load_default()
    height = PANEL_HEIGHT - TOP - BOTTOM
    right_edge = WIDTH - RIGHT
    t_max = max(p[0] for points in lines.values() for p in points) * 1.05

    def xy(seconds: float, accuracy: float) -> tuple[float, float]:
        x = LEFT + (right_edge - LEFT) * seconds / t_max
        return x, top + TOP + height * (1 - accuracy)

    pen.text((LEFT, top + 12), title, fill="black", font=font)
    for tick in range(0, 11, 2):
        _, y = xy(0, tick / 10)
        pen.line([(LEFT, y), (right_edge, y)], fill=(230, 230, 230))
        pen.text((LEFT - 30, y - 6), f"{tick / 10:.1f}", fill="black", font=font)
    step = max(1, round(t_max / 8 / 5) * 5)
    for second in range(0, int(t_max) + 1, step):
        x, _ = xy(second, 0)
        pen.line([(x, top + TOP), (x, top + TOP + height)], fill=(240, 240, 240))
        pen.text((x - 8, top + TOP + height + 8), f"{second}", fill="black", font=font)
    pen.text(
        ((LEFT + right_edge) // 2 - 80, top + TOP + height + 26),
        "wall time since the run started (s)",
        fill="black",
        font=font,
    )
    pen.text((8, top + TOP - 16), "held-out accuracy", fill="black", font=font)
    pen.rectangle([LEFT, top + TOP, right_edge, top + TOP + height], outline="black")
    for index, (name, points) in enumerate(lines.items()):
        color = COLORS[index % len(COLORS)]
        pixels = [xy(s, a) for s, a, _ in points]
        if len(pixels) > 1:
            # fp32 wide, under the others: a kind that trained exactly as fp32
            # did (no epoch under autocast) shows as a line inside it.
            pen.line(pixels, fill=color, width=7 if name == "fp32" else 2)
        for (px, py), (_, _, on) in zip(pixels, points):
            box = [px - 4, py - 4, px + 4, py + 4]
            pen.ellipse(box, fill=color if on else "white", outline=color, width=2)
        legend_y = top + TOP + 10 + index * 22
        pen.line(
            [(right_edge + 20, legend_y + 6), (right_edge + 50, legend_y + 6)], fill=color, width=3
        )
        pen.text((right_edge + 58, legend_y), name, fill="black", font=font)
    note_y = top + TOP + 10 + len(lines) * 22 + 10
    pen.text((right_edge + 20, note_y), "filled dot: epoch under autocast", fill="black", font=font)


def draw(data: dict[str, Any], out: Path) -> None:
    """Renders the chart of ``data`` (bench_amp's JSON) into ``out``."""
    panels = []
    if data.get("runs"):
        task = data["setup"]["task"]
        seeds = data["setup"]["seeds"]
        panels.append(
            (
                f"{task['model']}, {task['image_size']}x{task['image_size']} images, "
                f"{data['device']}: held-out accuracy per epoch, mean of {seeds} seeds",
                curves(data["runs"]),
            )
        )
    stress = data.get("stress", {})
    if stress.get("runs"):
        task = stress["task"]
        panels.append(
            (
                f"stress case {stress['chosen']['name']}: {task['model']}, "
                f"{task['image_size']}x{task['image_size']} images, float16 autocast",
                curves(stress["runs"]),
            )
        )
    if not panels:
        raise SystemExit("no runs in the results file")
    image = Image.new("RGB", (WIDTH, PANEL_HEIGHT * len(panels)), "white")
    pen = ImageDraw.Draw(image)
    for index, (title, lines) in enumerate(panels):
        draw_panel(pen, index * PANEL_HEIGHT, title, lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)


def main() -> None:
    """Reads the JSON and writes the PNG."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=REPO / "benches/results/bench_amp.json")
    parser.add_argument("--out", type=Path, default=REPO / "benches/results/bench_amp.png")
    args = parser.parse_args()
    draw(json.loads(args.json.read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
