"""PNG figures of simulated rows (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["plot_rows", "pyplot"]


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported lazily: the CLI need not load it)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)


def plot_rows(rows: Sequence, path: str, title: str = "") -> None:
    """Speedup over NCCL per allocation (one size), or against the size (a sweep)."""
    plt = pyplot()
    sizes = sorted({r.size_bytes for r in rows})
    collectives = sorted({r.collective for r in rows})
    fig, ax = plt.subplots(figsize=(max(6.0, min(18.0, 0.06 * len(rows) + 5)), 4.2))
    if len(sizes) == 1:
        for k, c in enumerate(collectives):
            sel = [r for r in rows if r.collective == c]
            xs = [i + (k - (len(collectives) - 1) / 2) * 0.4 for i in range(len(sel))]
            ax.bar(xs, [r.speedup for r in sel], width=0.4 if len(collectives) > 1 else 0.8, label=c)
        labels = [",".join(map(str, r.gpus)) for r in rows if r.collective == collectives[0]]
        if len(labels) <= 40:
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=90, fontsize=7)
        else:
            ax.set_xlabel("allocation (smallest first)")
        ax.set_ylabel("speedup over NCCL (simulated)")
    else:
        groups: dict[tuple, list] = {}
        for r in rows:
            groups.setdefault((tuple(r.gpus), r.collective), []).append(r)
        for (gpus, c), sel in list(groups.items())[:12]:
            sel.sort(key=lambda r: r.size_bytes)
            ax.plot([r.size_bytes for r in sel], [r.speedup for r in sel], marker="o", label=f"{','.join(map(str, gpus))} {c}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("speedup over NCCL (simulated)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_title(title)
    ax.legend(fontsize=7)
    _save(fig, path)
    plt.close(fig)
