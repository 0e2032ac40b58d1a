"""The terminal side of training: a progress bar with step, loss, tokens/s and ETA."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class ProgressBar:
    def __init__(self, total: int, initial: int, desc: str) -> None:
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5,
        )
        self.val: float | None = None

    def update(self, record: dict[str, Any]) -> None:
        if "val_loss" in record:
            self.val = record["val_loss"]
        post = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
        if self.val is not None:
            post["val"] = f"{self.val:.3f}"
        for key in ("echo", "round"):
            if key in record:
                post[key] = f"{record[key]}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
