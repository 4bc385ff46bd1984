"""Fidelity reports: rich tables for the terminal, JSON for records, PNG charts."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from kiln.quant.evaluate import Fidelity


@dataclass(frozen=True)
class SchemeRow:
    """One quantization scheme measured on one text."""

    name: str
    bits_per_weight: float  # average over the linear layers the scheme covers
    linear_bytes: int  # stored bytes of those layers
    fidelity: Fidelity


def fidelity_table(rows: Iterable[SchemeRow], title: str):
    from rich.table import Table

    rows = list(rows)
    ref_ppl = f", reference ppl {rows[0].fidelity.ref_ppl:.3f}" if rows else ""
    table = Table(title=title + ref_ppl)
    table.add_column("scheme", no_wrap=True)
    for col in ("bits/w", "linear MB", "mean KL", "p99 KL", "top-1", "ppl"):
        table.add_column(col, justify="right")
    for r in rows:
        f = r.fidelity
        table.add_row(r.name, f"{r.bits_per_weight:.3f}", f"{r.linear_bytes / 1e6:.1f}",
                      f"{f.mean_kl:.4f}", f"{f.p99_kl:.4f}", f"{f.top1_agreement:.1%}",
                      f"{f.ppl:.3f}")
    return table


def sensitivity_table(kl: Mapping[str, Mapping[str, float]], title: str, top: int | None = None):
    """Layers (most sensitive first, by their largest KL) x formats."""
    from rich.table import Table

    formats = sorted({f for row in kl.values() for f in row})
    order = sorted(kl, key=lambda name: -max(kl[name].values()))
    table = Table(title=title)
    table.add_column("layer")
    for fmt in formats:
        table.add_column(f"KL {fmt}", justify="right")
    for name in order[:top]:
        table.add_row(name, *(f"{kl[name][f]:.5f}" if f in kl[name] else "-" for f in formats))
    return table


def plan_summary(plan: Mapping[str, str]) -> dict[str, int]:
    """How many layers got each format."""
    counts: dict[str, int] = {}
    for fmt in plan.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    return dict(sorted(counts.items()))


def write_json(path: Path, payload: dict) -> None:
    def encode(obj):
        if isinstance(obj, (Fidelity, SchemeRow)):
            return asdict(obj)
        raise TypeError(f"cannot encode {type(obj).__name__}")

    path.write_text(json.dumps(payload, indent=2, default=encode) + "\n")


def plot_sensitivity(kl: Mapping[str, Mapping[str, float]], path: Path, title: str) -> None:
    """One bar group per layer in model order, one colour per format, log KL axis."""
    plt = _pyplot()
    names = list(kl)
    formats = sorted({f for row in kl.values() for f in row})
    width = 0.8 / max(1, len(formats))
    fig, ax = plt.subplots(figsize=(max(8, 0.12 * len(names) * len(formats)), 4.5))
    for i, fmt in enumerate(formats):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [max(kl[n].get(fmt, 0.0), 1e-7) for n in names], width=width, label=fmt)
    ax.set_yscale("log")
    ax.set_ylabel("mean KL, this layer alone (nats)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
    ax.set_xticklabels([_short(n) for n in names], rotation=90, fontsize=5)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_tradeoff(rows: Iterable[SchemeRow], path: Path, title: str) -> None:
    """Bits per weight vs mean KL, one labelled point per scheme."""
    plt = _pyplot()
    rows = list(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.scatter(r.bits_per_weight, max(r.fidelity.mean_kl, 1e-7), s=30)
        ax.annotate(r.name, (r.bits_per_weight, max(r.fidelity.mean_kl, 1e-7)), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (linear layers)")
    ax.set_ylabel("mean KL vs reference (nats)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _short(name: str) -> str:
    """model.layers.3.self_attn.qkv_proj -> 3.qkv"""
    parts = name.split(".")
    if len(parts) >= 5 and parts[1] == "layers":
        return f"{parts[2]}.{parts[-1].removesuffix('_proj')}"
    return name


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
