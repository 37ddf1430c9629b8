"""The figure of `rlship bench loop`: loop lag over time, one panel per placement, ship
windows shaded, observations made between steps (loading the next step: not measured) in
grey; CPU per step by process kind; under `--workload moe` Redis's used memory over time.
matplotlib is optional (the `bench` extra); without it no PNG is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

FLOOR_MS = 0.01  # lags of zero drawn here, on the log axis
GOAL_MS = 20.0  # the bound on the celery placement's worst lag
# The ship path's kinds first, then what is not counted in its CPU.
CPU_COLORS = {
    "orchestrator": "tab:blue",
    "workers": "tab:orange",
    "redis": "tab:red",
    "trainers": "0.6",
    "others": "0.85",
}


def plot_lag(report: dict[str, Any], path: Path) -> bool:
    """Write the PNG; False (and nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    placements = report["placements"]
    memory = any("redis_memory" in result for result in placements.values())
    extra = [0.25 + 0.2 * len(placements)] + ([1.2] if memory else [])
    fig, all_axes = plt.subplots(
        len(placements) + len(extra),
        1,
        figsize=(11, 2.4 * len(placements) + 2.6 + 2.9 * memory),
        gridspec_kw={"height_ratios": [1] * len(placements) + extra},
    )
    axes, cpu_axis = list(all_axes[: len(placements)]), all_axes[len(placements)]
    for ax in axes[1:]:
        ax.sharey(axes[0])
    for ax, (name, result) in zip(axes, placements.items(), strict=True):
        for window in result["windows"]:
            ax.axvspan(window["start"], window["end"], color="0.85" if window["warmup"] else "tab:orange",
                       alpha=0.6 if window["warmup"] else 0.25, lw=0)  # fmt: skip
        t, ms = np.asarray(result["timeline"]["lag"]["t"]), np.asarray(result["timeline"]["lag"]["ms"])
        due = t - ms / 1000.0
        shipping = np.zeros(len(t), dtype=bool)
        for window in result["windows"]:
            shipping |= (due >= window["start"]) & (due <= window["end"])
        ms = np.maximum(ms, FLOOR_MS)
        ax.plot(t[~shipping], ms[~shipping], ".", ms=2, color="0.6", label="between steps (not measured)")
        ax.plot(t[shipping], ms[shipping], ".", ms=3, color="tab:blue", label="while shipping")
        ax.axhline(GOAL_MS, color="tab:red", lw=0.8, ls=":", label=f"{GOAL_MS:g} ms")
        ax.set_yscale("log")
        ax.set_ylabel("lag (ms)")
        figures = result["lag_ms"]
        ax.set_title(
            f"{name}: lag max {figures['max']:.1f} ms, p99 {figures['p99']:.2f} ms; "
            f"heartbeat max {result['heartbeat_max_ms']:.1f} ms",
            fontsize=10,
            loc="left",
        )
        end = max((w["end"] for w in result["windows"]), default=0.0)
        ax.set_xlim(-0.05 * end - 0.05, 1.05 * end + 0.05)
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].legend(handles, labels, loc="upper right", ncol=3, fontsize=8, frameon=False)
    axes[-1].set_xlabel("seconds since the placement's first cut (shaded: ship windows, grey: warm-up)")
    plot_cpu(cpu_axis, placements)
    if memory:
        plot_redis_memory(all_axes[-1], placements)
    settings, workload = report["settings"], report["workload"]
    fig.suptitle(
        f"Event-loop lag while shipping {workload['rollouts'][-1]} rollouts x {settings['ranks']} ranks "
        f"({workload['tokens'][-1]:,} tokens/step), 10 ms probe",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_cpu(ax: Any, placements: dict[str, Any]) -> None:
    """CPU milliseconds per shipped step by process kind, stacked, one bar per placement."""
    names = list(placements)
    left = np.zeros(len(names))
    for kind, color in CPU_COLORS.items():
        ms = np.array([1000 * placements[n]["cpu_seconds_per_step"].get(kind, 0.0) for n in names])
        ax.barh(names, ms, left=left, color=color, label=kind, height=0.6)
        left += ms
    ax.invert_yaxis()
    ax.set_xlabel("CPU ms per shipped step (step of median ship CPU; grey: trainer ranks, other programs)")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)


def plot_redis_memory(ax: Any, placements: dict[str, Any]) -> None:
    """Redis's used memory (sampled; solid) and the bytes under the payload directories
    (dashed) over time, one colour per placement, from its first cut."""
    for index, (name, result) in enumerate(placements.items()):
        if "redis_memory" not in result:
            continue
        color = f"C{index % 10}"
        redis, files = result["redis_memory"]["timeline"], result["directories"]["timeline"]
        peak = result["redis_peak_used_memory_bytes"] / 2**20
        ax.plot(redis["t"], redis["mib"], lw=1, color=color, label=f"{name} (Redis peak {peak:.0f} MiB)")
        if result["payload_directories_peak_bytes"]:
            ax.plot(files["t"], files["mib"], lw=1, ls="--", color=color)
    ax.set_xlabel("seconds since the placement's first cut (dashed: bytes under its payload directories)")
    ax.set_ylabel("MiB")
    ax.legend(loc="upper right", fontsize=8, frameon=False)
