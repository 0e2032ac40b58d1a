"""How a model's parameters map onto the averaged vector, and fingerprints of that vector.

The averaged vector is the parameters in name order, read and written as *pieces*: every
parameter is cut into slices of at most total/pieces_hint elements. A piece belongs to exactly
one parameter, so a round reads and writes the model slice by slice, with no flat copy of the
whole model. How the vector travels in a round, one chunk and a probe per group member, is
`round_layout`'s (averaging.py checks the probes).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import CompressionInfo

SKETCH_SIZE = 64
"""Numbers in a sketch of the synchronized parameters."""


@dataclass(frozen=True)
class Piece:
    name: str
    """The parameter this piece is a slice of."""
    start: int
    """First element within the parameter (flattened)."""
    numel: int
    offset: int
    """First element within the whole flat vector (parameters in name order)."""


def cut_pieces(shapes: Mapping[str, int], pieces_hint: int = 32) -> list[Piece]:
    """Pieces of at most total/pieces_hint elements (parameters in name order)."""
    total = sum(shapes.values())
    most = max(1, math.ceil(total / max(pieces_hint, 1)))
    out, offset = [], 0
    for name in sorted(shapes):
        n = shapes[name]
        for start in range(0, n, most):
            k = min(most, n - start)
            out.append(Piece(name, start, k, offset))
            offset += k
    return out


def param_slice(params: Mapping[str, torch.Tensor], piece: Piece) -> torch.Tensor:
    """A view of the piece in the model's (host) parameter."""
    return params[piece.name].detach().view(-1)[piece.start : piece.start + piece.numel]


def flatten(params: Mapping[str, torch.Tensor], pieces: list[Piece]) -> torch.Tensor:
    """The parameters as one flat float32 vector (for start-up and state exchange only)."""
    out = torch.empty(sum(p.numel for p in pieces), dtype=torch.float32)
    for piece in pieces:
        out[piece.offset : piece.offset + piece.numel].copy_(param_slice(params, piece))
    return out


@torch.no_grad()
def assign(params: Mapping[str, torch.Tensor], pieces: list[Piece], flat: torch.Tensor) -> None:
    for piece in pieces:
        target = param_slice(params, piece)
        target.copy_(flat[piece.offset : piece.offset + piece.numel].to(target))


class Sketcher:
    """A small fingerprint of a flat vector: the sums of SKETCH_SIZE contiguous blocks, each
    divided by the square root of its length.

    For the difference of two vectors that differ by independent noise of RMS s, each number of
    the sketches' difference has about the spread s, so the RMS of a sketch difference estimates
    how far apart the vectors are. A systematic offset (a whole block moved one way, as a missed
    outer step moves it) shows larger still. Comparing sketches with a tolerance tells peers
    that hold the same synchronized parameters up to float16 rounding from peers that do not,
    which bit-exact digests cannot (each member's average differs in its last bits)."""

    def __init__(self, numel: int) -> None:
        self.bounds = [numel * i // SKETCH_SIZE for i in range(SKETCH_SIZE + 1)]

    def of(self, flat: torch.Tensor) -> list[float]:
        out = [0.0] * SKETCH_SIZE
        self.accumulate(out, 0, flat)
        return out

    def accumulate(self, sketch: list[float], offset: int, values: torch.Tensor) -> None:
        """Add `values` (elements offset.. of the vector) into `sketch`."""
        end = offset + values.numel()
        k = bisect.bisect_right(self.bounds, offset) - 1
        while k < SKETCH_SIZE and self.bounds[k] < end:
            lo, hi = max(self.bounds[k], offset), min(self.bounds[k + 1], end)
            norm = math.sqrt(max(self.bounds[k + 1] - self.bounds[k], 1))
            sketch[k] += float(values[lo - offset : hi - offset].double().sum()) / norm
            k += 1


def sketch_distance(a: list[float], b: list[float]) -> float:
    """RMS of the difference of two sketches (inf when they cannot be compared)."""
    if len(a) != len(b) or not a:
        return math.inf
    d = sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) / len(a)
    return math.sqrt(d) if math.isfinite(d) else math.inf


def digest(flat: torch.Tensor) -> str:
    """Exact fingerprint: equal only for bit-identical vectors (peers built from one seed)."""
    # the tensor's own memory, not a copy of it (hashlib reads any buffer)
    return hashlib.blake2b(flat.contiguous().numpy().data, digest_size=8).hexdigest()


def iter_chunks(numel: int, size: int = 1 << 20) -> Iterator[tuple[int, int]]:
    for lo in range(0, numel, size):
        yield lo, min(numel, lo + size)


def round_layout(
    held: torch.Tensor, probes: torch.Tensor, fractions: Sequence[float]
) -> tuple[list[torch.Tensor], list[CompressionInfo]]:
    """The round's tensors, views of the held vector and probes: for each member's span, its probe
    then its chunk, cut at the pivots hivemind's TensorPartContainer computes from the same
    fractions, so every part of the chunk and the probe in front of it go to that member. Keys
    pick the compression: 0 the wire codec (vector), 1 none (probes)."""
    total = held.numel() + len(fractions)
    pivots = (np.cumsum(fractions) / np.sum(fractions) * total).astype(np.int64)
    pivots[-1] = total
    tensors: list[torch.Tensor] = []
    infos: list[CompressionInfo] = []
    start = offset = 0
    for i, end in enumerate(pivots.tolist()):
        if end - start < 2:  # a member with (almost) nothing to reduce: hivemind gave it none
            raise AllreduceException(f"member {i}'s span of {end - start} elements is too small")
        chunk = held[offset : offset + end - start - 1]
        tensors += [probes[i : i + 1], chunk]
        infos += [
            CompressionInfo.from_tensor(probes[i : i + 1], key=1),
            CompressionInfo.from_tensor(chunk, key=0),
        ]
        offset += chunk.numel()
        start = end
    assert offset == held.numel()
    return tensors, infos
