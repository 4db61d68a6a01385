"""CPU offload: the copies between host memory and the compute device.

[Note: CPU offload]
Under ``CPUOffloadPolicy`` a unit's shard buffer, its sharded gradients and so
the optimizer's states live in host memory (pinned when the compute device is
an accelerator, so that copies are asynchronous), and ``optimizer.step()``
runs on the CPU. The device sees a unit only while it is gathered:
  - host to device: the shards are copied onto the device on a side stream
    (``on_copy_stream``) and the all-gather is issued from that stream, so a
    prefetched unit's copy overlaps the compute of the unit running now;
  - device to host: each reduced gradient shard is copied into pinned memory
    on the side stream, without blocking the compute stream;
    ``wait_for_host_copies`` (end of backward) makes the gradients readable on
    the CPU before the optimizer steps.
On a CPU mesh the same code runs with no stream and plain copies: the logic
is one path, the device chosen by the mesh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_copy_streams: dict[torch.device, Any] = {}
_pending_events: list[Any] = []


def _device_module(device: torch.device) -> Any:
    return getattr(torch, device.type)


def pinned_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor for data bound to or from ``device`` (pinned for an accelerator)."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type != "cpu")


@contextlib.contextmanager
def on_copy_stream(device: torch.device) -> Iterator[None]:
    """Runs the block on ``device``'s copy stream, after the work the current
    stream has enqueued so far (memory it freed may be reused); CPU: as is.

    Tensors allocated inside belong to the copy stream: allocate outside.
    """
    if device.type == "cpu":
        yield
        return
    module = _device_module(device)
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = module.Stream(device)
    stream.wait_stream(module.current_stream(device))
    with module.stream(stream):
        yield


def join_copy_stream(device: torch.device) -> None:
    """Makes the current stream wait for the copies issued so far (before it reads them)."""
    stream = _copy_streams.get(device)
    if stream is not None:
        _device_module(device).current_stream(device).wait_stream(stream)


def to_host(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as ``dtype`` in host memory, copied without blocking the compute
    stream (readable on the CPU after ``wait_for_host_copies``)."""
    if tensor.device.type == "cpu":
        return tensor.to(dtype)
    host = pinned_empty(tensor.numel(), dtype, tensor.device).view(tensor.shape)
    with on_copy_stream(tensor.device):
        host.copy_(tensor, non_blocking=True)
        tensor.record_stream(_device_module(tensor.device).current_stream(tensor.device))  # the copy stream
        event = _device_module(tensor.device).Event()
        event.record()
    _pending_events.append(event)
    return host


def wait_for_host_copies() -> None:
    """Blocks until every device-to-host copy issued so far has landed."""
    while _pending_events:
        _pending_events.pop(0).synchronize()
