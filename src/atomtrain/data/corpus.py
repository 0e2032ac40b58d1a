"""Where raw text comes from: a file, a directory, a glob, or `stdlib` (the embedded default)."""

from __future__ import annotations

import glob
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from atomtrain.errors import AtomError

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".c", ".h", ".toml", ".cfg", ".csv", ""}


def stdlib_dir() -> Path:
    """The running Python's standard library source: present wherever Python is."""
    return Path(sysconfig.get_paths()["stdlib"])


def resolve_sources(src: str) -> list[Path]:
    """The text files SRC names, sorted so that every machine sees the same order."""
    if src == "stdlib":
        root = stdlib_dir()
        # Skip vendored packages and tests so the corpus is the library's own code.
        skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
        files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    elif any(ch in src for ch in "*?["):
        files = [Path(p) for p in glob.glob(src, recursive=True) if Path(p).is_file()]
    else:
        path = Path(src)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = [p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
        else:
            raise AtomError(f"data source {src!r} does not exist")
    files = sorted(files)
    if not files:
        raise AtomError(f"data source {src!r} holds no text files")
    return files


def read_texts(files: list[Path]) -> Iterator[tuple[Path, str]]:
    """Each file's text; undecodable bytes become U+FFFD rather than stopping the run."""
    for f in files:
        try:
            yield f, f.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise AtomError(f"cannot read {f}: {e.strerror}") from e
