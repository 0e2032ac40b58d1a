"""Checkpoints written atomically and checked on load.

    step_000200/
        model.safetensors      master parameters by name
        optimizer.safetensors  optimizer state by parameter name, and the RNG state
        state.json             step, loader state, model shape, anything the caller adds
        manifest.json          size and sha256 of each file above

A checkpoint is written to a hidden temporary directory and renamed into place, so a crash mid-write
leaves the previous checkpoints intact and never a half-written one under a real name.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from atomtrain.data.shards import sha256_file
from atomtrain.errors import AtomError

FILES = ("model.safetensors", "optimizer.safetensors", "state.json")
EXTRA = "extra.safetensors"
"""Optional: state of other components (the peer runtime's synchronized parameters)."""


@dataclass
class Checkpoint:
    path: Path
    params: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    rng_state: torch.Tensor | None
    state: dict
    extra: dict[str, torch.Tensor]


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(
    directory: Path,
    params: dict[str, torch.Tensor],
    optimizer: dict[str, torch.Tensor],
    state: dict,
    overwrite: bool = False,
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a checkpoint at `directory` (its final name) and return it."""
    if directory.exists() and not overwrite:
        raise AtomError(f"checkpoint {directory} already exists; pass --overwrite to replace it")
    tmp = directory.parent / f".{directory.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in params.items()}, tmp / "model.safetensors"
    )
    rng = {"__rng_state__": torch.get_rng_state()}
    save_file(
        {**{k: v.cpu().contiguous() for k, v in optimizer.items()}, **rng},
        tmp / "optimizer.safetensors",
    )
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    files = list(FILES)
    if extra:
        save_file({k: v.detach().cpu().contiguous() for k, v in extra.items()}, tmp / EXTRA)
        files.append(EXTRA)
    manifest = {
        f: {"bytes": (tmp / f).stat().st_size, "sha256": sha256_file(tmp / f)} for f in files
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for f in (*files, "manifest.json"):
        with open(tmp / f, "rb") as fh:
            os.fsync(fh.fileno())
    if directory.exists():
        _remove(directory)
    os.replace(tmp, directory)
    _fsync_dir(directory.parent)
    return directory


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (a power cut must not undo it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(ckpt: Path) -> None:
    """Delete a checkpoint so that a kill at any moment leaves it whole or gone from view.

    It is first renamed to a hidden name (atomic), and only then deleted file by file; hidden
    leftovers of an interrupted delete are removed by the next prune.
    """
    aside = ckpt.parent / f".{ckpt.name}.deleting"
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(ckpt, aside)
    shutil.rmtree(aside, ignore_errors=True)


def verify_checkpoint(path: Path) -> None:
    """Raise AtomError unless every file is present, complete and matches its checksum."""
    if not path.is_dir():
        raise AtomError(f"checkpoint {path} does not exist")
    if not (path / "manifest.json").is_file():
        raise AtomError(f"checkpoint {path} is incomplete: manifest.json is missing")
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AtomError(f"checkpoint {path} has no readable manifest.json") from e
    if not isinstance(manifest, dict):
        raise AtomError(f"checkpoint {path} has a malformed manifest.json")
    required = [*FILES, *([EXTRA] if EXTRA in manifest else [])]
    for f in required:
        entry = manifest.get(f)
        fp = path / f
        if not isinstance(entry, dict) or not fp.is_file():
            raise AtomError(f"checkpoint {path} is incomplete: {f} is missing")
        if fp.stat().st_size != entry.get("bytes"):
            raise AtomError(
                f"checkpoint {path} is truncated: {f} has {fp.stat().st_size} bytes, "
                f"manifest says {entry.get('bytes')}"
            )
        if sha256_file(fp) != entry.get("sha256"):
            raise AtomError(f"checkpoint {path} is corrupt or tampered: checksum of {f} differs")


def load_checkpoint(path: Path) -> Checkpoint:
    verify_checkpoint(path)
    try:
        params = load_file(path / "model.safetensors")
        opt = load_file(path / "optimizer.safetensors")
        state = json.loads((path / "state.json").read_text())
        extra = load_file(path / EXTRA) if (path / EXTRA).exists() else {}
    except (SafetensorError, json.JSONDecodeError, OSError) as e:
        raise AtomError(f"checkpoint {path} cannot be read: {e}") from e
    rng = opt.pop("__rng_state__", None)
    return Checkpoint(path, params, opt, rng, state, extra)


def check_matches(ckpt: Checkpoint, params: Mapping[str, torch.Tensor]) -> None:
    """Raise AtomError when the checkpoint's tensors are not this model's."""
    missing = sorted(set(params) - set(ckpt.params))
    extra = sorted(set(ckpt.params) - set(params))
    if missing or extra:
        what = f"lacks {missing[0]!r}" if missing else f"has unknown {extra[0]!r}"
        raise AtomError(f"checkpoint {ckpt.path} is for another model: it {what}")
    for name, p in params.items():
        if tuple(ckpt.params[name].shape) != tuple(p.shape):
            raise AtomError(
                f"checkpoint {ckpt.path} is for another model: {name} has shape "
                f"{tuple(ckpt.params[name].shape)}, this model has {tuple(p.shape)}"
            )


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run (temporary directories never count)."""
    ckdir = run_dir / "checkpoints"
    found = sorted(p for p in ckdir.glob("step_*") if p.is_dir()) if ckdir.is_dir() else []
    return found[-1] if found else None


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    ckdir = run_dir / "checkpoints"
    found = sorted(p for p in ckdir.glob("step_*") if p.is_dir())
    for old in found[:-keep]:
        _remove(old)
    for left in ckdir.glob(".step_*.deleting"):  # a delete a kill interrupted
        shutil.rmtree(left, ignore_errors=True)
