"""``MixedPrecision.cast_root_forward_inputs`` (torch's field): the wrapper's root casts its
floating-point inputs to ``param_dtype`` only while it is True (the default), as torch's FSDP1."""

import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

import fullshard
from fullshard.testing import distributed


class _RecordsInputDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return self.lin(x.to(self.lin.weight.dtype))


def _input_dtype(lib, cast_root: bool) -> torch.dtype:
    module = _RecordsInputDtype()
    precision = lib.MixedPrecision(param_dtype=torch.bfloat16, cast_root_forward_inputs=cast_root)
    model = lib.FullyShardedDataParallel(module, mixed_precision=precision, device_id=torch.device("cpu"))
    model(torch.randn(2, 4))
    return module.seen[-1]


@distributed(world_size=2)
def test_root_input_cast_follows_the_setting_like_torch():
    for cast_root, expected in ((True, torch.bfloat16), (False, torch.float32)):
        assert _input_dtype(fullshard, cast_root) == expected
        assert _input_dtype(torch_fsdp, cast_root) == expected
