"""Parsers and checks of single values a user types: sizes, ports, numbers in a range.

Each raises AtomError naming `where` (a field or an option) on anything it cannot accept, and
nothing else: the property tests in tests/test_fuzz.py feed them arbitrary text and numbers.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from atomtrain.errors import AtomError

SIZE_UNITS = {
    "TIB": 1 << 40,
    "GIB": 1 << 30,
    "MIB": 1 << 20,
    "KIB": 1 << 10,
    "TB": 10**12,
    "GB": 10**9,
    "MB": 10**6,
    "KB": 10**3,
    "B": 1,
}
MAX_SIZE_BYTES = 1 << 60
"""Sizes above an exabyte are typing mistakes, and they would overflow 64-bit byte counters."""
MAX_SEED = (1 << 63) - 1
"""torch and numpy generators both take seeds up to here."""


def parse_size(text: str, where: str) -> int:
    """`24GB`, `24GiB`, `512MB`, `1.5e9` as a positive whole number of bytes."""
    t = str(text).strip().upper().replace(" ", "")
    num, mult = t, 1
    for suffix, unit in SIZE_UNITS.items():
        if t.endswith(suffix):
            num, mult = t[: -len(suffix)], unit
            break
    try:
        value = float(num) * mult
    except (ValueError, OverflowError):
        raise AtomError(f"{where}: cannot read {text!r} as a size (e.g. 24GB, 512MiB)") from None
    if not math.isfinite(value) or not 1 <= value <= MAX_SIZE_BYTES:
        raise AtomError(f"{where}: size {text!r} must be at least 1 byte and at most 1 EiB")
    return int(value)


def check_port(port: int, where: str, zero_ok: bool = True) -> int:
    """A TCP port: 1-65535, or 0 (any free port) where `zero_ok`."""
    lo = 0 if zero_ok else 1
    if isinstance(port, bool) or not isinstance(port, int) or not lo <= port <= 65535:
        raise AtomError(f"{where} must be a port number in {lo}-65535, got {port!r}")
    return port


def check_number(
    value: float,
    where: str,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> float:
    """A finite number in [lo, hi] (or (lo, hi] with `lo_open`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AtomError(f"{where} must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise AtomError(f"{where} must be a finite number, got {value!r}")
    low_bad = lo is not None and (value <= lo if lo_open else value < lo)
    if low_bad or (hi is not None and value > hi):
        left = "(" if lo_open else "["
        bounds = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise AtomError(f"{where} must be in {bounds}, got {value!r}")
    return value


def check_choice(value: str, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise AtomError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
    return value


def check_seed(value: int, where: str) -> int:
    check_number(value, where, 0, MAX_SEED)
    return int(value)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step: a reader sees the old file or the new, never half.

    The text goes to a temporary file in the same directory, is flushed to disk, and is renamed
    over `path` (rename is atomic within one filesystem).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
