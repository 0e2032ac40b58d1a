"""`atomtrain plan` and `atomtrain profile` (filled in by the planner)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    pass
