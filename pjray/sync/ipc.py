"""The colocated transport: learner rank i streams its weights to the engine on its GPU through a
few reused CUDA buffers ("slots"), shared once per sync as CUDA IPC handles.

Each bucket is packed into one of the slots and the engine is told to load it from there
(`IpcReceiver.load`); a slot is packed again only after the engine has loaded the bucket it
last held. With two slots the learner packs bucket k+1 while the engine loads bucket k, and the
learner's GPU holds two buckets of extra memory, not a packed copy of the whole model: on a GPU
shared with a sleeping engine, that copy was the sync's peak.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor

from pjray.sync.buckets import Bucket, pack

__all__ = ["IpcReceiver", "ipc_handle", "open_ipc_handle", "slot_view", "stream_buckets"]


class IpcReceiver(Protocol):
    """The engine's side of a stream, as the learner rank sees it."""

    def begin(self, handles: list[Any]) -> None:
        """Map the slots (one handle each) and start an update."""

    def load(self, bucket: Bucket, slot: int) -> Any:
        """Start loading `bucket` from `slot`; returns what `wait` takes."""

    def wait(self, pending: Any) -> None:
        """Return once the load `pending` has read its slot."""

    def finish(self) -> None:
        """End the update (every bucket loaded) and drop the mappings."""


def slot_view(slot: Tensor, bucket: Bucket) -> Tensor:
    """The first `bucket.nbytes` of a uint8 slot, as the bucket's flat buffer."""
    return slot[: bucket.nbytes].view(bucket.dtype)


def stream_buckets(
    buckets: Iterable[tuple[Bucket, dict[str, Tensor]]],
    slots: list[Tensor],
    receiver: IpcReceiver,
    share: Callable[[Tensor], Any] | None = None,
) -> int:
    """Hand every bucket to `receiver` through `slots` (uint8 buffers, each at least as large as
    the largest bucket); returns the number of buckets sent.

    `share` makes a slot's handle (default `ipc_handle`). Bucket k goes to slot k % len(slots),
    after the receiver has loaded bucket k - len(slots) from it.
    """
    share = share or ipc_handle
    receiver.begin([share(slot) for slot in slots])
    in_slot: list[Any] = [None] * len(slots)  # the load still reading each slot
    sent = 0
    for bucket, tensors in buckets:
        slot = sent % len(slots)
        if in_slot[slot] is not None:
            receiver.wait(in_slot[slot])
        if bucket.nbytes > slots[slot].numel():
            raise ValueError(
                f"stream_buckets: a {bucket.nbytes}-byte bucket does not fit a {slots[slot].numel()}-byte slot"
            )
        flat = pack(bucket, tensors, out=slot_view(slots[slot], bucket))
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()  # written before another process reads it
        in_slot[slot] = receiver.load(bucket, slot)
        sent += 1
    for k in range(len(slots)):  # the loads still running, oldest first
        pending = in_slot[(sent + k) % len(slots)]
        if pending is not None:
            receiver.wait(pending)
    receiver.finish()
    return sent


def ipc_handle(slot: Tensor) -> Any:
    """A CUDA IPC handle of `slot` (picklable), for the process of the engine on the same GPU."""
    from torch.multiprocessing.reductions import reduce_tensor

    if slot.device.type != "cuda":
        raise ValueError("ipc_handle: CUDA IPC needs the learner's weights on a GPU")
    return reduce_tensor(slot)


def open_ipc_handle(handle: Any, device_index: int) -> Tensor:
    """Receiver side: map a handle from `ipc_handle` as a tensor on this process's GPU.

    The handle records the sender's device index; both processes see the shared GPU, but
    possibly under different indices, so the receiver's own index is put in its place.
    """
    rebuild, args = handle
    args = list(args)
    args[6] = device_index  # rebuild_cuda_tensor(..., storage_device, ...)
    return rebuild(*args)
