"""`rlship report RUN_DIR`: a run's `metrics.jsonl` as PNG charts and one `report.html`.

People read charts, not JSON lines: the per-step time of each ship stage (stacked), the
orchestrator's event-loop lag, reward and token statistics of `all` against `effective`
rollouts, and the share of arrived rollouts that never trained, by reason. The page
references the PNGs beside it, so the run directory can be copied or served as it is.
Needs matplotlib (the `charts` extra: `pip install -e '.[charts]'` in a checkout), imported
only when a report is made.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.run_info import RunInfo
from tasks.stages.record_names import agg_statistic, total_shipped_tokens

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Record = dict[str, float]

# Pipeline order, bottom of the stack first; stages not listed here are stacked after them.
STAGE_ORDER = ("finalize", "prune", "metrics", "pack", "encode", "send", "publish")
# Not ship stages: `ship` is wall time from cut to publish, `wait_for_policy` is before the cut.
TIME_LINES = ("ship", "wait_for_policy", "wait_for_ckpt")  # wait_for_ckpt: prime-rl's name of the policy wait
SUBSETS = (("all", "tab:gray"), ("effective", "tab:blue"))
BAR_STEPS = 60  # beyond this many steps, stacked areas read better than bars


def load_records(path: Path) -> list[Record]:
    """The records in step order. A torn last line (the run is still writing, or stopped
    mid-write) is left out, and said so on stderr; a record of the wrong shape stops the
    report naming its line, key and value."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number < len(lines):
                raise SystemExit(f"rlship report: {path}: record {number} is not JSON: {exc}") from exc
            said = f"rlship report: {path}: the last line (record {number}) is cut short; left out"
            print(said, file=sys.stderr)
            continue
        problem = record_problem(record)
        if problem:
            raise SystemExit(f"rlship report: {path}: record {number} is not a metrics record: {problem}")
        records.append(record)
    return sorted(records, key=lambda record: record["step"])


def record_problem(record: object) -> str | None:
    """Why a parsed line is not a record of numbers with a `step`, or None."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    if "step" not in record:
        return "it has no 'step'"
    for key, value in record.items():
        if not isinstance(value, int | float):
            return f"{key}: {value!r} is not a number"
    return None


def series(records: Sequence[Record], key: str) -> list[float]:
    """One value per step; NaN where a record lacks the key (matplotlib leaves a gap)."""
    return [float(record.get(key, math.nan)) for record in records]


def stage_names(records: Sequence[Record]) -> list[str]:
    present = {key.removeprefix("time/") for record in records for key in record if key.startswith("time/")}
    stages = [stage for stage in STAGE_ORDER if stage in present]
    return stages + sorted(present - set(STAGE_ORDER) - set(TIME_LINES))


def discard_reasons(records: Sequence[Record]) -> list[str]:
    prefix = "accounting/discarded/"
    keys = {key for record in records for key in record}
    return sorted(key.removeprefix(prefix) for key in keys if key.startswith(prefix))


WAITING = "waiting (queues, hand-offs)"


def stage_stack(records: Sequence[Record]) -> tuple[list[str], list[list[float]]]:
    """The stacked per-step seconds: each stage in pipeline order, then the rest of cut →
    publish (`WAITING`: time in Celery queues and between tasks, which no stage counts), so
    the stack reaches the step's wall time."""
    stages = stage_names(records)
    values = [[0.0 if math.isnan(v) else v for v in series(records, f"time/{s}")] for s in stages]
    in_stages = [sum(column) for column in zip(*values, strict=True)] if values else [0.0] * len(records)
    wall = [0.0 if math.isnan(v) else v for v in series(records, "time/ship")]
    return [*stages, WAITING], [*values, [max(0.0, w - s) for w, s in zip(wall, in_stages, strict=True)]]


def plot_stage_times(ax: Axes, steps: list[float], records: Sequence[Record]) -> None:
    stages, values = stage_stack(records)
    if len(steps) <= BAR_STEPS:
        bottom = [0.0] * len(steps)
        for stage, seconds in zip(stages, values, strict=True):
            color = "lightgray" if stage == WAITING else None
            ax.bar(steps, seconds, bottom=bottom, label=stage, width=0.8, color=color)
            bottom = [b + s for b, s in zip(bottom, seconds, strict=True)]
    elif stages:
        ax.stackplot(steps, values, labels=stages)
    ax.plot(steps, series(records, "time/ship"), "k.-", label="cut → publish (wall)")
    ax.plot(steps, series(records, "time/wait_for_policy"), "r--", label="wait for policy")
    ax.set(title="Time per step, by ship stage", ylabel="seconds")
    ax.text(
        0.0, -0.16, "per-rank stages count as their slowest rank; metrics and pack run side by side",
        transform=ax.transAxes, fontsize=8, color="dimgray",
    )  # fmt: skip


def plot_loop_lag(ax: Axes, steps: list[float], records: Sequence[Record]) -> None:
    for stat, style in (("p50", "g.-"), ("p99", "b.-"), ("max", "r.-")):
        ax.plot(steps, series(records, f"event_loop_lag/{stat}_ms"), style, label=stat)
    ax.set(title="Orchestrator event-loop lag (10 ms probe)", ylabel="ms late", ylim=(0, None))


def spread(records: Sequence[Record], key: str) -> tuple[list[float], list[float], str]:
    """The band drawn around `key`'s mean. p10-p90, unless every value is 0 or 1 (a pass/fail
    reward), where that band covers 0-1 and says nothing: then the 95% interval of the mean
    (normal approximation from the mean and the count)."""
    quantiles = [v for stat in ("min", "p10", "p50", "p90", "max") for v in series(records, f"{key}/{stat}")]
    if quantiles and all(math.isnan(v) or v in (0.0, 1.0) for v in quantiles):
        counts = series(records, f"{key.rsplit('/', 1)[0]}/count")
        half = [
            1.96 * math.sqrt(m * (1 - m) / n) if n and n > 0 and not math.isnan(m) else math.nan
            for m, n in zip(series(records, f"{key}/mean"), counts, strict=True)
        ]
        means = series(records, f"{key}/mean")
        return (
            [m - h for m, h in zip(means, half, strict=True)],
            [m + h for m, h in zip(means, half, strict=True)],
            "95% interval of the mean",
        )
    return series(records, f"{key}/p10"), series(records, f"{key}/p90"), "p10-p90"


def stat_plotter(name: str, title: str, unit: str) -> Callable[[Axes, list[float], Sequence[Record]], None]:
    """Mean and spread of `name` (`spread`), for `all` and `effective`, on one axes."""

    def plot(ax: Axes, steps: list[float], records: Sequence[Record]) -> None:
        for subset, color in SUBSETS:
            plain = f"train/agg/{subset}/{name}"  # rlship-1's, else the first other name found
            key = next((k for k in (agg_statistic(r, subset, name) for r in records) if k != plain), plain)
            low, high, band = spread(records, key)
            ax.fill_between(steps, low, high, color=color, alpha=0.2, label=f"{subset} {band}")
            ax.plot(steps, series(records, f"{key}/mean"), ".-", color=color, label=f"{subset} mean")
        ax.set(title=title, ylabel=unit)

    return plot


def plot_discarded(ax: Axes, steps: list[float], records: Sequence[Record]) -> None:
    """Run totals over arrivals, so the last step reads as the share of the whole run."""
    arrived = series(records, "accounting/arrived")
    reasons = discard_reasons(records)
    shares = [
        [100.0 * c / a if a > 0 and not math.isnan(c) else 0.0 for c, a in zip(counts, arrived, strict=True)]
        for counts in (series(records, f"accounting/discarded/{reason}") for reason in reasons)
    ]
    if reasons:
        ax.stackplot(steps, shares, labels=reasons, alpha=0.8)
    else:
        ax.text(0.5, 0.5, "nothing discarded", transform=ax.transAxes, ha="center", color="dimgray")
    ax.set(title="Discarded share of arrived rollouts, by reason (run totals)", ylabel="% of arrived")


VERSUS = "all finalized vs shipped (effective)"
CHARTS: dict[str, tuple[str, Callable[[Axes, list[float], Sequence[Record]], None]]] = {
    "stage_times.png": ("Time per step", plot_stage_times),
    "loop_lag.png": ("Event-loop lag", plot_loop_lag),
    "reward.png": ("Reward", stat_plotter("reward", f"Reward: {VERSUS}", "reward")),
    "tokens.png": ("Tokens", stat_plotter("num_total_tokens", f"Tokens per rollout: {VERSUS}", "tokens")),
    "discarded.png": ("Discarded", plot_discarded),
}


def write_charts(records: Sequence[Record], out_dir: Path) -> list[Path]:
    # Figure without pyplot: no global state, no GUI backend, nothing to close.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = series(records, "step")
    paths = []
    for filename, (_, plot) in CHARTS.items():
        figure = Figure(figsize=(9, 4.5), dpi=100, layout="constrained")
        ax = figure.add_subplot()
        plot(ax, steps, records)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        path = out_dir / filename
        figure.savefig(path)
        paths.append(path)
    return paths


def summary_rows(records: Sequence[Record]) -> list[tuple[str, str]]:
    last = records[-1]
    ship = [v for v in series(records, "time/ship") if not math.isnan(v)]
    lag = [v for v in series(records, "event_loop_lag/max_ms") if not math.isnan(v)]
    discarded = {r: int(last.get(f"accounting/discarded/{r}", 0)) for r in discard_reasons(records)}
    balanced = last.get("accounting/balanced")
    return [
        ("steps", f"{len(records)} (steps {int(records[0].get('step', 0))} to {int(last.get('step', 0))})"),
        ("rollouts arrived", f"{int(last.get('accounting/arrived', 0)):,}"),
        ("rollouts shipped", f"{int(last.get('accounting/shipped', 0)):,}"),
        ("discarded", ", ".join(f"{r} {n:,}" for r, n in discarded.items()) or "none"),
        ("rejected", f"{int(last.get('accounting/rejected', 0)):,}"),
        ("tokens shipped", f"{int(total_shipped_tokens(last)):,}"),
        ("cut → publish", f"mean {sum(ship) / len(ship):.3f} s, max {max(ship):.3f} s" if ship else "n/a"),
        ("event-loop lag", f"max {max(lag):.1f} ms" if lag else "n/a"),
        ("accounting", "n/a" if balanced is None else ("balanced" if balanced else "NOT balanced")),
    ]


def render_html(title: str, records: Sequence[Record], charts: Sequence[Path]) -> str:
    rows = "\n".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary_rows(records)
    )
    figures = "\n".join(
        f'<figure><img src="{html.escape(path.name)}" alt="{html.escape(CHARTS[path.name][0])}"></figure>'
        for path in charts
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>rlship report: {html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ text-align: left; padding: 0.2em 1em 0.2em 0; }}
figure {{ margin: 0 0 1.5em 0; }}
img {{ max-width: 100%; border: 1px solid #ddd; }}
</style>
</head>
<body>
<h1>rlship report: {html.escape(title)}</h1>
<table>
{rows}
</table>
{figures}
</body>
</html>
"""


def run_title(run_dir: Path) -> str:
    """The run's id, from the `run.json` its orchestrator writes; else the directory's name."""
    info = RunInfo.of_directory(run_dir)
    return run_dir.resolve().name if info is None else info.run_id


def write_report(run_dir: Path) -> Path:
    """Charts and `report.html` in `run_dir`, from its `metrics.jsonl`; returns the page."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"rlship report: {metrics} does not exist (is {run_dir} a run's output directory?)")
    records = load_records(metrics)
    if not records:
        raise SystemExit(f"rlship report: {metrics} holds no records yet")
    charts = write_charts(records, run_dir)
    page = run_dir / "report.html"
    page.write_text(render_html(run_title(run_dir), records, charts))
    return page


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run's output directory")


def main(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "rlship report needs matplotlib: pip install -e '.[charts]' in the checkout"
        ) from None
    page = write_report(args.run_dir)
    print(page)
    for filename in CHARTS:
        print(page.parent / filename)
    return 0
