"""How a run went, for people (a rich table) and machines (a dict)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

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
    table = Table(title=f"hetero-ray{tag}: step {metrics['step'] + 1}, loss {metrics['loss']:.3f}")
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
