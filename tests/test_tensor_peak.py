"""``TensorPeak``: the bytes a block holds at most in live CPU tensors, without the profiler's chatter."""

import os

import torch

from fullshard.training.tensor_peak import TensorPeak


def test_rise_counts_the_largest_live_tensor():
    with TensorPeak() as peak:
        kept = torch.empty(1 << 20, dtype=torch.uint8)
        del kept
        torch.empty(1 << 16, dtype=torch.uint8)
    assert 1 << 20 <= peak.rise < (1 << 20) + (1 << 17)


def test_profiler_chatter_is_dropped_and_everything_else_kept(capfd):
    with TensorPeak():
        os.write(2, b"USDT:2026-11-24 10:33:46 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a line of the step\n")
        os.write(
            2,
            b"[rank1]:[W1124 10:33:46.025038787 CPUAllocator.cpp:245] Memory block of unknown size was allocated "
            b"before the profiling started, profiler results will not include the deallocation event\n",
        )
    assert capfd.readouterr().err == "a line of the step\n"
