"""metrics.jsonl (one JSON object per event) and the loss-curve PNG drawn from it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from atomtrain.errors import AtomError
from atomtrain.values import atomic_write_text


class MetricsLog:
    def __init__(self, path: Path, tensorboard_dir: Path | None = None) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.board = _board(tensorboard_dir) if tensorboard_dir is not None else None

    def write(self, record: dict[str, Any]) -> None:
        """Appends `record`, stamped with "time" (unix seconds) when it has none, so a
        benchmark can time every event from process launch. With TensorBoard on, every number
        in it becomes a scalar at its step."""
        if "time" not in record:
            record = {**record, "time": time.time()}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.board is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                if key in ("step", "time") or isinstance(value, bool):
                    continue
                if isinstance(value, int | float):
                    self.board.add_scalar(_tag(key), value, step, walltime=record["time"])

    def close(self) -> None:
        if self.board is not None:
            self.board.close()

    def truncate_after(self, step: int) -> None:
        """Drop records past `step`, so a resumed run does not log steps twice.

        A torn last line (the process was killed mid-write) is dropped; the file is replaced in
        one step, so a kill during the rewrite loses nothing.
        """
        if not self.path.exists():
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a torn last line (a kill mid-write) is left out."""
    if not path.exists():
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise AtomError(f"{path} is unreadable ({type(e).__name__})") from None
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
            if i == len(lines) - 1:
                break  # torn by a kill during the last write
            raise AtomError(f"{path} line {i + 1} is not a metrics record")
        records.append(record)
    return records


def plot_losses(metrics_path: Path, out: Path, title: str = "") -> Path:
    """Training and validation loss against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1.0, alpha=0.8)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return out


def _tag(key: str) -> str:
    """TensorBoard groups tags by their prefix: validation apart from training."""
    return f"val/{key}" if key.startswith("val_") else f"train/{key}"


def _board(directory: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise AtomError(
            "--log.tensorboard needs the tensorboard package: pip install 'atomtrain[tensorboard]'"
        ) from None
    return SummaryWriter(log_dir=str(directory), flush_secs=10)
