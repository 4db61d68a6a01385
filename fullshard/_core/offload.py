"""Side streams on accelerators, and the copies between host memory and the device.

[Note: CPU offload]
Under ``CPUOffloadPolicy`` a unit's shard buffer, its sharded gradients and so
the optimizer's states live in host memory (pinned when the compute device is
an accelerator, so that copies are asynchronous), and ``optimizer.step()``
runs on the CPU. The device sees a unit only while it is gathered:
  - host to device: the shards are copied onto the device on the all-gather
    stream and the all-gather is issued from that stream, so a prefetched
    unit's copy overlaps the compute of the unit running now;
  - device to host: a unit's reduced gradient shards are copied into pinned
    memory with one copy on the offload stream, without blocking the compute
    stream; ``wait_for_host_copies`` (end of backward) makes the gradients
    readable on the CPU before the optimizer steps.
On a CPU mesh the same code runs with no stream and plain copies: the logic
is one path, the device chosen by the mesh.

[Note: Streams]
What runs where on an accelerator (CUDA; on CPU everything is in order):
  - compute stream (the current stream): forward and backward, the all-gather
    copy-out (one fused split-copy per unit, layout.py), the reduce-scatter
    copy-in (one fused ``_chunk_cat``, reduction.py), the gradient copy-out;
  - all-gather stream (``ALL_GATHER``): the cast or host-to-device copy into a
    unit's all-gather input and the issue of the all-gather itself. It first
    waits for the compute stream (``on_stream``: memory that stream freed may
    be reused); the compute stream waits for it (``join_stream``) in
    ``wait_for_unshard``, before the copy-out reads the output: an event wait
    on the device, never a host sync;
  - NCCL's internal stream: every collective. An async collective waits for
    the stream it was issued from, and ``Work.wait()`` makes the *current*
    stream wait for it on the device (no host block). Reduce-scatters and
    all-reduces are issued from the compute stream after the copy-in and
    waited by the next unit's reduction (``make_room``), so they overlap the
    next unit's backward. The copy-in (one fused kernel per unit) stays on
    the compute stream on purpose: it reads the unsharded gradients that
    stream just produced, which can then be freed at once; on a side stream
    they would have to stay alive until it is done. There is no separate
    reduction stream: NCCL's own stream already takes the collective off the
    compute stream;
  - offload stream (``OFFLOAD``): device-to-host copies of reduced gradients.
Frees are ordered by where the tensor was allocated, never by
``record_stream``: buffers a side stream reads are allocated on the compute
stream before entering it and stay referenced until the compute stream has
waited for that side stream (all-gather input and output: ``wait_for_unshard``
drops them after ``join_stream``). A device tensor copied to the host on the
offload stream is kept in ``_in_flight`` with an event recorded after the
copy, and released once the event has completed: polled (never waited) at
every new copy, and waited at the end of backward, where the CPU needs the
gradients anyway. So the caching allocator gets every block back as soon as
its last reader is done, and at most what one backward offloads waits there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

_Result = TypeVar("_Result")

ALL_GATHER = "all_gather"
OFFLOAD = "offload"

_streams: dict[tuple[torch.device, str], Any] = {}
# (event recorded after the copy, the device tensor it reads, kept alive until then)
_in_flight: list[tuple[Any, torch.Tensor]] = []


def _device_module(device: torch.device) -> Any:
    return getattr(torch, device.type)


def pinned_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor for data bound to or from ``device`` (pinned for an accelerator)."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type != "cpu")


# Where a CPU device "switches" stream: nowhere, everything runs in order.
IN_ORDER: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def on_stream(device: torch.device, name: str) -> contextlib.AbstractContextManager[None]:
    """Runs the block on ``device``'s side stream ``name``, after the work the
    current stream has enqueued so far (memory it freed may be reused); CPU: as is
    (no generator to build: units enter this several times a step).

    Tensors allocated inside belong to the side stream: allocate outside.
    """
    return IN_ORDER if device.type == "cpu" else _on_side_stream(device, name)


def run_on_stream(device: torch.device, name: str, fn: Callable[..., _Result], *args: Any) -> _Result:
    """``fn(*args)`` under ``on_stream(device, name)``; on CPU a plain call (no context to
    enter and exit, twice per unit and step)."""
    if device.type == "cpu":
        return fn(*args)
    with _on_side_stream(device, name):
        return fn(*args)


@contextlib.contextmanager
def _on_side_stream(device: torch.device, name: str) -> Iterator[None]:
    module = _device_module(device)
    stream = _side_stream(device, name)
    stream.wait_stream(module.current_stream(device))
    with module.stream(stream):
        yield


def _side_stream(device: torch.device, name: str) -> Any:
    stream = _streams.get((device, name))
    if stream is None:
        stream = _streams[(device, name)] = _device_module(device).Stream(device)
    return stream


def wait_for_event(device: torch.device, name: str, event: Any) -> None:
    """Makes side stream ``name`` wait (on the device) for ``event`` besides the
    current stream it always waits for; CPU: in order already, nothing to wait for."""
    if device.type != "cpu":
        _side_stream(device, name).wait_event(event)


def join_stream(device: torch.device, name: str) -> None:
    """Makes the current stream wait (on the device) for the work issued so far on ``name``."""
    stream = _streams.get((device, name))
    if stream is not None:
        _device_module(device).current_stream(device).wait_stream(stream)


def to_host(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as ``dtype`` in host memory, copied without blocking the compute
    stream (readable on the CPU after ``wait_for_host_copies``)."""
    if tensor.device.type == "cpu":
        return tensor.to(dtype)
    _release_finished()
    host = pinned_empty(tensor.numel(), dtype, tensor.device).view(tensor.shape)
    with on_stream(tensor.device, OFFLOAD):
        host.copy_(tensor, non_blocking=True)
        event = _device_module(tensor.device).Event()
        event.record()
    _in_flight.append((event, tensor))  # freed once the copy is done: see [Note: Streams]
    return host


def _release_finished() -> None:
    """Drops the device tensors whose copies have completed (no waiting)."""
    while _in_flight and _in_flight[0][0].query():
        _in_flight.pop(0)


def wait_for_host_copies() -> None:
    """Blocks until every device-to-host copy issued so far has landed."""
    while _in_flight:
        _in_flight.pop(0)[0].synchronize()
