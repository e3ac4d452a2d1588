"""Bucketing of parameters for learner -> rollout weight sync, and checksums to verify it.

Sending one tensor per call costs one RPC (and one collective) per parameter, which dominates
sync time at scale. Instead the learner packs parameters, in order, into a few flat buffers of
at most `bucket_bytes` each and sends one buffer per transfer; the receiver unpacks views with
the original names and shapes. This module is the pure part: planning, packing, unpacking and
checksums. The transport lives with the actors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class BucketEntry:
    """Where one parameter lives inside its bucket's flat buffer."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int  # first element in the flat buffer
    numel: int


@dataclass(frozen=True)
class Bucket:
    """A flat buffer of `numel` elements of one dtype holding `entries` back to back."""

    dtype: torch.dtype
    entries: tuple[BucketEntry, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _element_size(self.dtype)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_buckets(named_shapes: list[tuple[str, torch.Size, torch.dtype]], bucket_bytes: int) -> list[Bucket]:
    """Group parameters, keeping their order, into buckets of at most `bucket_bytes`.

    A bucket holds one dtype, so a dtype change starts a new one. A parameter larger than
    `bucket_bytes` gets a bucket of its own (the only case a bucket exceeds the limit).

    Args:
        named_shapes: (name, shape, dtype) per parameter, in sync order; names must be unique.
        bucket_bytes: size limit per bucket, > 0.

    Returns:
        buckets in order; concatenating their entries gives `named_shapes` back.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[Bucket] = []
    seen: set[str] = set()
    entries: list[BucketEntry] = []
    current_dtype: torch.dtype | None = None
    current_numel = 0

    def close() -> None:
        nonlocal entries, current_numel
        if entries:
            assert current_dtype is not None
            buckets.append(Bucket(current_dtype, tuple(entries), current_numel))
        entries, current_numel = [], 0

    for name, shape, dtype in named_shapes:
        if name in seen:
            raise ValueError(f"parameter {name!r} appears twice")
        seen.add(name)
        shape = torch.Size(shape)
        numel = shape.numel()
        item = _element_size(dtype)
        fits = (current_numel + numel) * item <= bucket_bytes
        if entries and (dtype != current_dtype or not fits):
            close()
        current_dtype = dtype
        entries.append(BucketEntry(name, shape, dtype, current_numel, numel))
        current_numel += numel
        if current_numel * item > bucket_bytes:
            close()  # an oversize parameter alone: nothing else may join it
    close()
    return buckets


def pack(bucket: Bucket, tensors: Mapping[str, Tensor], out: Tensor | None = None) -> Tensor:
    """Copy the bucket's parameters into one flat buffer: `out` when given (reused), else a new one.

    Args:
        bucket: from `plan_buckets`.
        tensors: name -> tensor for (at least) every entry; shapes and dtypes must match.
        out: [bucket.numel] contiguous tensor of bucket.dtype to write into.

    Returns:
        [bucket.numel] contiguous tensor of bucket.dtype (`out`, or new on the device of the
        first entry).
    """
    first = bucket.entries[0].name
    if first not in tensors:
        raise KeyError(f"pack: parameter {first!r} is missing")
    if out is None:
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=tensors[first].device)
    elif out.dim() != 1 or out.numel() != bucket.numel or out.dtype != bucket.dtype or not out.is_contiguous():
        raise ValueError(f"pack: out is {tuple(out.shape)} {out.dtype}, bucket needs ({bucket.numel},) {bucket.dtype}")
    else:
        flat = out
    for entry in bucket.entries:
        if entry.name not in tensors:
            raise KeyError(f"pack: parameter {entry.name!r} is missing")
        tensor = tensors[entry.name]
        if tensor.shape != entry.shape or tensor.dtype != entry.dtype:
            # Never cast or reshape silently: the receiver would load wrong weights.
            raise ValueError(
                f"pack: parameter {entry.name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                f"planned as {tuple(entry.shape)} {entry.dtype}"
            )
        flat[entry.offset : entry.offset + entry.numel].copy_(tensor.detach().reshape(-1))
    return flat


def unpack(bucket: Bucket, flat: Tensor) -> dict[str, Tensor]:
    """Views into `flat` with each entry's name and shape (no copy).

    Args:
        bucket: the plan `flat` was packed with.
        flat: [bucket.numel] tensor of bucket.dtype.
    """
    if flat.dim() != 1 or flat.numel() != bucket.numel or flat.dtype != bucket.dtype:
        raise ValueError(
            f"unpack: buffer is {tuple(flat.shape)} {flat.dtype}, bucket expects ({bucket.numel},) {bucket.dtype}"
        )
    return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in bucket.entries}


def flat_bytes(flat: Tensor) -> bytes:
    """The raw bytes of a packed bucket (one copy), for transports that carry only plain
    types: vLLM's engine core, in a process of its own, decodes an RPC's tensor arguments
    as lists."""
    return flat.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def from_bytes(bucket: Bucket, data: bytes | bytearray | memoryview) -> Tensor:
    """The flat buffer of `bucket` from `flat_bytes` (a copy: writable, its own memory)."""
    if len(data) != bucket.nbytes:
        raise ValueError(f"from_bytes: {len(data)} bytes, bucket needs {bucket.nbytes}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(bucket.dtype)


def tensor_checksum(t: Tensor) -> str:
    """sha256 hex digest of a tensor's dtype, shape and raw bytes.

    Bytes are read from a contiguous CPU copy viewed as uint8, which works for every dtype
    (bfloat16 included, which numpy cannot represent). Equal digests mean bit-identical tensors.
    """
    data = t.detach().contiguous().cpu().reshape(-1)
    digest = hashlib.sha256(f"{data.dtype}|{tuple(t.shape)}|".encode())
    digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def state_checksums(
    named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
) -> dict[str, str]:
    """name -> `tensor_checksum`, from a state dict or `model.named_parameters()`."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return {name: tensor_checksum(t) for name, t in items}
