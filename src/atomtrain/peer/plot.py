"""One loss plot for a whole swarm: every peer's training and validation curves."""

from __future__ import annotations

from pathlib import Path


def plot_swarm(run_dirs: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from atomtrain.train.metrics import read_metrics

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for run in run_dirs:
        recs = read_metrics(run / "metrics.jsonl")
        train = [(r["step"], r["loss"]) for r in recs if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
        if train:
            ax.plot(*zip(*train, strict=True), linewidth=0.8, alpha=0.6, label=f"{run.name} train")
        if val:
            ax.plot(*zip(*val, strict=True), "o-", linewidth=1.5, label=f"{run.name} validation")
    ax.set_xlabel("local step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
