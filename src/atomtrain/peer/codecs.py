"""Wire formats for the pseudo-gradient below 16 bits, in hivemind's compression framework.

hivemind 1.1.12's 8-bit codecs fail to read their own messages under numpy 2 (`int()` of a
one-element array), and scale a whole part at once; Atom's peers use the uniform 8-bit slot
for a blockwise 8-bit codec instead.

hivemind ships float16 and 8-bit codecs, and tells codecs apart by a fixed protobuf enum. Its
BLOCKWISE_8BIT slot needs bitsandbytes, which Atom does not install; Atom's peers use that slot
for this 4-bit codec instead (registered when `atomtrain.peer.averaging` is imported, before any
averager process starts, so every Atom peer reads it the same way).

Each part is centred on its mean and cut into 16 equal bins over +-3 standard deviations (values
beyond land in the outer bins); the receiver gets the mean value of each bin (a 16-entry
codebook) and two 4-bit indices per byte: 0.5 byte an element. What the rounding loses stays in
the sender's model and goes with its next round (error feedback, rounds.py).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hivemind.compression import serialization
from hivemind.compression.base import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

BINS = 16
RANGE_IN_SIGMAS = 6.0
BLOCK = 1024
"""Elements of a block of the 8-bit codec."""


def dtype_name(tensor: torch.Tensor) -> str:
    """The tensor's dtype as hivemind's messages name it (a tensor that requires grad too)."""
    return "bfloat16" if tensor.dtype == torch.bfloat16 else tensor.detach().numpy().dtype.name


class Uniform4BitQuantization(CompressionBase):
    compression_type = runtime_pb2.BLOCKWISE_8BIT  # the reused slot (see the module docstring)

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        if not torch.is_floating_point(tensor):
            raise ValueError(f"4-bit quantization does not support {tensor.dtype} tensors")
        flat = tensor.detach().float().reshape(-1)
        index = quantize(flat)
        codebook = torch.zeros(BINS).scatter_add_(0, index, flat)
        codebook /= torch.bincount(index, minlength=BINS).clamp_min(1)
        packed = pack(index.to(torch.uint8).numpy())
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=codebook.numpy().astype(np.float32).tobytes() + packed.tobytes(),
            size=tensor.shape,
            dtype=dtype_name(tensor),
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        numel = math.prod(shape)
        buffer = serialized_tensor.buffer
        codebook = torch.from_numpy(np.frombuffer(buffer, count=BINS, dtype=np.float32).copy())
        packed = np.frombuffer(buffer, offset=4 * BINS, dtype=np.uint8)
        if packed.size != (numel + 1) // 2:
            raise ValueError(f"4-bit tensor of {numel} elements with {packed.size} bytes")
        index = torch.from_numpy(unpack(packed, numel).astype(np.int64))
        out = codebook[index].reshape(shape).to(getattr(torch, serialized_tensor.dtype))
        return out.requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 4 / torch.finfo(info.descriptor.dtype).bits


def quantize(flat: torch.Tensor) -> torch.Tensor:
    """Bin index (0..15) of each element."""
    centred = flat - flat.mean()
    std = float(centred.norm()) / math.sqrt(max(centred.numel() - 1, 1))
    scale = RANGE_IN_SIGMAS * std / BINS or 1.0
    return (centred / scale + BINS / 2).floor().clamp_(0, BINS - 1).long()


def pack(index: np.ndarray) -> np.ndarray:
    if index.size % 2:
        index = np.append(index, np.uint8(0))
    return (index[0::2] | (index[1::2] << 4)).astype(np.uint8)


def unpack(packed: np.ndarray, numel: int) -> np.ndarray:
    out = np.empty(packed.size * 2, dtype=np.uint8)
    out[0::2], out[1::2] = packed & 0x0F, packed >> 4
    return out[:numel]


class Blockwise8Bit(CompressionBase):
    """8 bits an element, in blocks of BLOCK elements, each with its own minimum and step (256
    levels between the block's minimum and maximum, rounded to the nearest): a round's chunk
    spans many parameters whose updates differ in size by orders of magnitude, and one scale for
    the whole part would round the small ones away. 1 byte an element plus 8 a block."""

    compression_type = runtime_pb2.UNIFORM_8BIT  # the slot of hivemind's (one-scale) 8-bit codec

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        if not torch.is_floating_point(tensor):
            raise ValueError(f"8-bit quantization does not support {tensor.dtype} tensors")
        flat = tensor.detach().float().reshape(-1)
        pad = -flat.numel() % BLOCK
        blocks = torch.cat([flat, flat[-1:].expand(pad)]).view(-1, BLOCK)  # edge value: no range
        low = blocks.amin(1)
        step = (blocks.amax(1) - low) / 255
        step = torch.where(step > 0, step, torch.ones_like(step))
        index = ((blocks - low[:, None]) / step[:, None]).round_().clamp_(0, 255)
        index = index.to(torch.uint8).reshape(-1)[: flat.numel()]
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=low.numpy().tobytes() + step.numpy().tobytes() + index.numpy().tobytes(),
            size=tensor.shape,
            dtype=dtype_name(tensor),
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        numel = math.prod(shape)
        nblocks = -(-numel // BLOCK)
        buffer = serialized_tensor.buffer
        if len(buffer) != 8 * nblocks + numel:
            raise ValueError(f"8-bit tensor of {numel} elements with {len(buffer)} bytes")
        low = torch.from_numpy(np.frombuffer(buffer, count=nblocks, dtype=np.float32).copy())
        step = np.frombuffer(buffer, offset=4 * nblocks, count=nblocks, dtype=np.float32)
        index = np.frombuffer(buffer, offset=8 * nblocks, dtype=np.uint8)
        values = torch.from_numpy(index.astype(np.float32))
        pad = -numel % BLOCK
        values = torch.cat([values, values.new_zeros(pad)]).view(-1, BLOCK)
        values = values.mul_(torch.from_numpy(step.copy())[:, None]).add_(low[:, None])
        out = values.reshape(-1)[:numel].reshape(shape).to(getattr(torch, serialized_tensor.dtype))
        return out.requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 8 / torch.finfo(info.descriptor.dtype).bits


def register() -> None:
    serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = Blockwise8Bit()
    serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = Uniform4BitQuantization()
