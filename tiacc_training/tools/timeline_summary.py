"""Read the engine's timelines (``TIACC_TRAINING_TIMELINE``): where each step's time went.

Each rank writes its own Chrome trace; give this tool every rank's file.
It prints, per training step (a step starts where a rank hands DDP's bucket
0 over again):

- ``span``: from the first hand-over of the step on any rank to rank 0's
  last bucket done;
- ``skew``: how far apart the ranks handed the step's last bucket over (a
  bucket cannot leave before every rank has it: time the fastest rank
  spends waiting for the slowest);
- ``tail``: from the last rank's hand-over of the last bucket to rank 0's
  last bucket done (what communication adds after backward);
- ``link``: how long any rank given had a step across nodes running
  (inter-node steps of 2D, or world steps when the job runs flat) within
  the span, and that as a share of the span;
- the step's time per phase on rank 0.

``--merge FILE`` also writes every rank's events into one trace (one row
per rank; the files of one host share a clock).

Usage:
    python -m tiacc_training.tools.timeline_summary tl.rank*.json --merge all.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from tiacc_training.tools._cli import die

Event = dict


@dataclass
class Step:
    """One training step as one rank's timeline shows it."""

    handed: dict[int, float]  # bucket -> when DDP handed it over (us)
    done: float  # when its last bucket finished (us)
    events: list[Event]


def load(path: str) -> list[Event]:
    """The events of one timeline file.

    Raises:
        ValueError: the file is not a JSON array of trace events.
    """
    try:
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable timeline: {e}") from e
    if not isinstance(trace, list):
        raise ValueError(f"{path}: a timeline is a JSON array of events")
    return trace


def steps(trace: Sequence[Event]) -> list[Step]:
    """The trace's training steps, in order (see the module doc)."""
    done = sorted((e for e in trace if e.get("ph") == "X"), key=lambda e: e["ts"])
    found: list[Step] = []
    previous = None
    for e in done:
        if e["name"] != "queued":
            if found:
                found[-1].events.append(e)
            continue
        bucket = e["args"]["bucket"]
        if previous is None or bucket <= previous:
            found.append(Step(handed={}, done=e["ts"] + e["dur"], events=[]))
        found[-1].handed.setdefault(bucket, e["ts"])
        found[-1].events.append(e)
        previous = bucket
    for step in found:
        ends = [e["ts"] + e["dur"] for e in step.events if e["name"] == "bucket"]
        step.done = max(ends, default=step.done)
    return found


def crosses_nodes(event: Event, two_d: bool) -> bool:
    """Whether a step of the trace moved bytes between nodes."""
    group = event.get("args", {}).get("group")
    if event["name"] not in ("allreduce", "reduce-scatter", "allgather"):
        return False
    return group == "inter-node" or (not two_d and group == "world")


def busy(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(traces: Sequence[Sequence[Event]]) -> list[dict]:
    """One line per step of rank 0's timeline, across the ranks given."""
    per_rank = [steps(t) for t in traces]
    count = min(len(s) for s in per_rank)
    lines = []
    for k in range(count):
        mine = per_rank[0][k]
        last = max(mine.handed)
        handed = [s[k].handed.get(last) for s in per_rank]
        handed_known = [t for t in handed if t is not None]
        first = min(min(s[k].handed.values()) for s in per_rank)
        span = mine.done - first
        two_d = any(e.get("args", {}).get("group") == "inter-node" for e in mine.events)
        link = busy(
            [
                (max(e["ts"], first), min(e["ts"] + e["dur"], mine.done))
                for s in per_rank
                for e in s[k].events
                if crosses_nodes(e, two_d) and e["ts"] < mine.done
            ]
        )
        phases: dict[str, float] = defaultdict(float)
        for e in mine.events:
            if e["name"] in ("bucket", "chunk"):
                continue
            group = e.get("args", {}).get("group")
            phases[f"{e['name']} {group}" if group else e["name"]] += e["dur"] / 1e3
        lines.append(
            {
                "step": k,
                "buckets": len(mine.handed),
                "span_ms": round(span / 1e3, 1),
                "skew_ms": round((max(handed_known) - min(handed_known)) / 1e3, 1),
                "tail_ms": round((mine.done - max(handed_known)) / 1e3, 1),
                "link_ms": round(link / 1e3, 1),
                "link_share": round(link / span, 3) if span > 0 else None,
                "phases_ms": {k: round(v, 1) for k, v in sorted(phases.items())},
            }
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="timeline_summary", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="every rank's timeline, rank 0 first")
    parser.add_argument("--merge", metavar="FILE", help="also write one trace of every rank")
    parser.add_argument("--json", action="store_true", help="print the lines as JSON")
    args = parser.parse_args(argv)
    try:
        traces = [load(p) for p in args.files]
    except ValueError as e:
        die(parser.prog, str(e))
    if args.merge:
        with open(args.merge, "w", encoding="utf-8") as f:
            json.dump([e for t in traces for e in t], f)
    lines = summarize(traces)
    if not lines:
        die(parser.prog, f"{args.files[0]}: no DDP bucket in this timeline", status=1)
    if args.json:
        print(json.dumps(lines, indent=1))
        return 0
    for line in lines:
        top = sorted(line["phases_ms"].items(), key=lambda kv: -kv[1])[:4]
        share = "" if line["link_share"] is None else f" ({line['link_share']:.0%})"
        print(
            f"step {line['step']}: {line['buckets']} buckets, span {line['span_ms']} ms, "
            f"skew {line['skew_ms']} ms, tail {line['tail_ms']} ms, "
            f"link {line['link_ms']} ms{share}; " + ", ".join(f"{name} {ms} ms" for name, ms in top)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
