"""``set_all_gather_quantization``: weights gathered as block-wise codes, for both front ends.

fullshard's addition: torch's FSDP gathers in fp8 only through torchao's float8
training weights. See [Note: Quantized all-gather] in ``_core/gather/codec/quantize.py``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._core.gather import ShardParam
from ._core.gather.codec import BlockQuantizer, QuantizedGather, QuantizedWire
from ._core.manage import states_below
from .api import AllGatherQuantization

__all__ = ["set_all_gather_quantization"]


def set_all_gather_quantization(module: nn.Module, quantization: AllGatherQuantization | None) -> None:
    """Makes every unit in ``module`` (``fully_shard`` units or ``FullyShardedDataParallel``
    instances, ``module`` included) gather its weights as ``quantization`` says from
    its next all-gather on; None gathers them as they are again.

    Only the gathered copy that forward and backward compute with is quantized:
    gradients are exact with respect to it, and the sharded weights the optimizer
    steps on keep their precision. A unit whose shard group has one rank gathers
    nothing, so it computes with its exact weights.

    Raises:
        ValueError: ``module`` holds no unit, or the settings are invalid.
        NotImplementedError: a unit mixes parameter dtypes (no one gather dtype to decode into), or
            holds tensor-subclass parameters (they gather in their own format).

    Under the FSDP1 wrapper's flat parameters (``use_orig_params=False``) each rank's piece of
    the flat parameter is coded as its own chunk (see [Note: Quantized flat chunks] in
    ``_core/gather/codec/quantized_gather.py``); ``keep_exact`` still decides per original parameter.
    """
    states = states_below(module)
    if not states:
        raise ValueError(
            "set_all_gather_quantization expects a module sharded by fully_shard or FullyShardedDataParallel "
            f"but got {type(module).__name__}, which holds no unit; shard it first"
        )
    quantizer = None if quantization is None else BlockQuantizer(quantization.dtype, quantization.block_size)
    for state in states:
        group = state.group
        if group is None:
            continue
        settings = group.settings
        if quantization is None or quantizer is None:
            settings.gather_wire = settings.gather_wire.carrier  # the chunks as they are, on the same collective
            continue
        if group.buffers.extended:
            names = ", ".join(p.fqn for p in group.buffers.extended)
            raise NotImplementedError(
                f"set_all_gather_quantization is not yet supported with tensor-subclass parameters, which gather "
                f"in their own format ({group.spec.name} holds {names}); leave this unit out of `module`"
            )
        other_dims = [p.fqn for p in group.spec.params if p.shard_dim != 0]
        if other_dims:
            raise NotImplementedError(
                f"set_all_gather_quantization is not yet supported with shard_placement_fn's dims other than 0 "
                f"({group.spec.name} shards {', '.join(other_dims)} so); return None for them"
            )
        if group.buffers.storage_layout.dtype == torch.uint8:
            dtypes = sorted({str(p.orig_dtype) for p in group.spec.params})
            raise NotImplementedError(
                f"set_all_gather_quantization is not yet supported with a unit of several dtypes ({group.spec.name}"
                f" holds {', '.join(dtypes)}); give its parameters one dtype"
            )
        exact = [_keeps_exact(param, quantization) for param in group.spec.params]
        pieces = group.spec.shard_layout.pieces  # under FSDP1's flat layout: every rank's piece of each
        codec = QuantizedGather(quantizer, exact, None if pieces is None else [list(ranges) for ranges in pieces])
        settings.gather_wire = QuantizedWire(codec, carrier=settings.gather_wire)


def _keeps_exact(param: ShardParam, quantization: AllGatherQuantization) -> bool:
    """Whether any module registering ``param`` asks for it to stay exact."""
    owners = param.module_info.owners()
    value = param.sharded_param
    if tuple(value.shape) != tuple(param.global_size):
        # The FSDP1 wrapper shows 1D shards (flat pieces, or its use_orig_params=True views): the rule
        # judges a stand-in of the parameter's own shape, as for fully_shard's DTensors.
        value = nn.Parameter(
            torch.empty(param.global_size, dtype=value.dtype, device="meta"), requires_grad=value.requires_grad
        )
    return any(quantization.keep_exact(module, name, value) for module, name in owners)
