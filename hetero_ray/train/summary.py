"""How a run went, for people (a rich table) and machines (a dict)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hetero_ray.cluster.catalog import Catalog
from hetero_ray.plan.data_parallel import split_batch
from hetero_ray.plan.plan import Plan


def modelled_references(plan: Plan, dilation: float | None) -> dict[str, float]:
    """Modelled samples/s of the ideal (sum of each device alone) and of an equal split.

    Per-sample times are the plan's predictions, stretched by the emulation's
    dilation so they are comparable with what an emulated run measures.
    """
    per_sample = [r.predicted_compute_s / r.local_batch * (dilation or 1.0) for r in plan.roles]
    equal = split_batch(plan.global_batch, [1.0] * len(per_sample))
    return {
        "ideal_samples_per_s": sum(1 / t for t in per_sample),
        "equal_split_samples_per_s": plan.global_batch / max(n * t for n, t in zip(equal, per_sample)),
    }


def summarise(metrics: dict[str, Any], dilation: float | None) -> dict[str, Any]:
    """The final metrics plus throughput against the modelled ideal and equal split."""
    refs = modelled_references(Plan.from_dict(metrics["plan"]), dilation)
    measured = metrics["samples_per_s"]
    return {
        **refs,
        "samples_per_s": measured,
        "over_modelled_ideal": measured / refs["ideal_samples_per_s"],
        "over_modelled_equal_split": measured / refs["equal_split_samples_per_s"],
    }


def render(metrics: dict[str, Any], dilation: float | None, console: Console) -> None:
    """Per-device table, then throughput against the references; emulated figures say so."""
    emulated = metrics["emulated"]
    tag = " (emulated)" if emulated else ""
    evaluation = metrics.get("eval")
    held_out = f", held-out loss {evaluation['loss']:.3f}" if evaluation else ""
    table = Table(title=f"hetero-ray{tag}: step {metrics['step'] + 1}, loss {metrics['loss']:.3f}{held_out}")
    for col in ("rank", "GPU type", "prec.", "share", "micro", "step", "samples/s", "util."):
        table.add_column(col, justify="left" if col in ("GPU type", "prec.") else "right", no_wrap=True)
    for d in metrics["devices"]:
        table.add_row(
            str(d["rank"]),
            d["gpu_type"],
            d["precision"] or "-",
            f"{d['local_batch']} ({d['share']:.0%})",
            str(d["micro_batch"]),
            f"{d['step_s'] * 1000:.0f} ms",
            f"{d['samples_per_s']:.1f}",
            f"{d['utilisation']:.0%}",
        )
    console.print(table)
    s = summarise(metrics, dilation)
    console.print(
        f"throughput{tag}: {s['samples_per_s']:.1f} samples/s = {s['over_modelled_ideal']:.2f} × the modelled ideal "
        f"({s['ideal_samples_per_s']:.1f}, every device busy alone) and {s['over_modelled_equal_split']:.2f} × a "
        f"modelled equal split ({s['equal_split_samples_per_s']:.1f}, plain DDP)"
    )
    overruns = sum(d["overrun_steps"] for d in metrics["devices"])
    if overruns:
        console.print(
            f"[yellow]warning: {overruns} emulated steps took longer on this CPU than modelled; raise "
            "emulation.dilation so padding, not the CPU, sets step times[/yellow]"
        )


def breakdown(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """Where each device's step went: its compute, waiting for the slowest device's compute (the all-reduce
    cannot start before it), and communication after that."""
    busy = [d["utilisation"] * d["step_s"] for d in metrics["devices"]]
    slowest = max(busy)
    return [
        {
            "rank": d["rank"],
            "gpu_type": d["gpu_type"],
            "local_batch": d["local_batch"],
            "compute_s": b,
            "wait_s": slowest - b,
            "comm_s": max(0.0, d["step_s"] - slowest),
        }
        for d, b in zip(metrics["devices"], busy)
    ]


def plot_breakdown(runs: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """A PNG with one panel per run (label → metrics): a stacked bar per device of compute, waiting, communication."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.5), squeeze=False)
    colors = {"compute_s": "#4c72b0", "wait_s": "#dd8452", "comm_s": "#55a868"}
    names = {"compute_s": "compute", "wait_s": "waiting for the slowest", "comm_s": "communication"}
    for ax, (label, metrics) in zip(axes[0], runs.items()):
        rows = breakdown(metrics)
        ranks = range(len(rows))
        left = [0.0] * len(rows)
        for key, color in colors.items():
            widths = [r[key] * 1000 for r in rows]
            ax.barh(ranks, widths, left=left, color=color, label=names[key])
            left = [a + b for a, b in zip(left, widths)]
        ax.set_yticks(
            ranks, [f"{r['rank']}: {r['gpu_type']}, {r['local_batch']} samples" for r in rows], fontsize="small"
        )
        ax.set_title(f"{label}: {metrics['samples_per_s']:.1f} samples/s")
        ax.set_xlabel("ms per step")
        ax.invert_yaxis()
    axes[0][0].legend(loc="lower right", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_speeds(metrics: dict[str, Any], catalog: Catalog, console: Console, *, profiled: bool) -> None:
    """Per device: the catalog's guess of its relative speed, the speed the plan used (measured by the profile,
    or the catalog's when there is none), its share and what it did in the run."""
    plan = Plan.from_dict(metrics["plan"])
    rate: dict[str, float] = {}
    for r in plan.roles:
        rate.setdefault(r.gpu_type, r.local_batch / r.predicted_compute_s)
    guess = {r.gpu_type: catalog.get(r.gpu_type).peak_flops(r.precision) for r in plan.roles}
    slow_rate, slow_guess = min(rate.values()), min(guess.values())
    source = "profiled" if profiled else "modelled"
    table = Table(title=f"speeds per device (emulated, {source} speeds planned the split)")
    # Speeds relative to the slowest type: the catalog's guess (peak FLOP/s) and what the plan used.
    for col in ("rank", "GPU type", "catalog", source, f"{source}/s", "share", "run/s"):
        table.add_column(col, justify="left" if col == "GPU type" else "right", no_wrap=True)
    for d in metrics["devices"]:
        t = d["gpu_type"]
        table.add_row(
            str(d["rank"]),
            t,
            f"{guess[t] / slow_guess:.2f} ×",
            f"{rate[t] / slow_rate:.2f} ×" if t in rate else "-",
            f"{rate[t]:.1f}" if t in rate else "-",
            f"{d['local_batch']} ({d['share']:.0%})",
            f"{d['samples_per_s']:.1f}",
        )
    console.print(table)
