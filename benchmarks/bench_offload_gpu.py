"""CPU offload on one GPU: fully_shard next to PyTorch's FSDP2, both with CPUOffloadPolicy.

    python benchmarks/bench_offload_gpu.py                        # gpt-1.3b, bf16, 4 x 2048 tokens
    python benchmarks/bench_offload_gpu.py --model gpt-125m --batch 2 --seq 256
    python benchmarks/bench_offload_gpu.py --device cpu --model gpt-tiny --seq 32 --steps 1   # smoke check, gloo

NCCL at world 1 in this process. Both frameworks train an identical copy of
the model (built on the CPU: offloaded shards never need the whole model on
the GPU), with bf16 compute and fp32 reduction; their steps alternate so that
machine noise hits both alike. Reported per framework: the median step time
(forward, backward, AdamW step on the CPU), the peak GPU memory of a step
(``max_memory_allocated``, reset before each measured step) and the GPU
memory held between steps (``memory_allocated``: with offload, nothing of the
model). The acceptance for fullshard: peak <= FSDP2's, step time <= 1.1x.
``--device cpu`` runs the same steps over gloo with unpinned host memory (no
GPU memory to measure: peaks read 0), to check the script, not the figures.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fullshard.models import Transformer, get_preset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default="gpt-1.3b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per framework")
    return parser.parse_args(argv)


def shard(name: str, model: torch.nn.Module, mesh, pin_memory: bool) -> torch.nn.Module:
    if name == "fullshard":
        from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kwargs = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=pin_memory),
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def gpu_memory(cuda: bool, reset_peak: bool = False, peak: bool = False) -> int:
    """After a synchronisation: the GPU memory allocated now (or its peak); 0 on the CPU."""
    if not cuda:
        return 0
    torch.cuda.synchronize()
    held = torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
    if reset_peak:
        torch.cuda.reset_peak_memory_stats()
    return held


def main() -> None:
    args = parse_args()
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    torch.manual_seed(0)
    base = Transformer(get_preset(args.model, max_seq_len=args.seq))
    names = ["fullshard", "fsdp2"]
    models = {name: shard(name, copy.deepcopy(base), mesh, pin_memory=cuda) for name in names}
    vocab = base.args.vocab_size
    del base
    optims = {name: torch.optim.AdamW(models[name].parameters(), lr=1e-4) for name in names}
    tokens = torch.randint(0, vocab, (args.batch, args.seq), device=device)
    times: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, list[int]] = {name: [] for name in names}
    between: dict[str, int] = {}
    for step in range(args.warmup + args.steps):
        for name in names:  # interleaved
            held = gpu_memory(cuda, reset_peak=True)
            began = time.perf_counter()
            models[name].loss(tokens, tokens).backward()
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
            gpu_memory(cuda)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - began)
                peaks[name].append(gpu_memory(cuda, peak=True))
                between[name] = held
    for name in names:
        print(f"{name:>9}: step {statistics.median(times[name]):.3f} s, peak {max(peaks[name]) / 2**30:.2f} GiB, "
              f"between steps {between[name] / 2**30:.2f} GiB (all models' GPU memory)")
    ratio = statistics.median(times["fullshard"]) / statistics.median(times["fsdp2"])
    peak = max(peaks["fullshard"]) / max(peaks["fsdp2"]) if max(peaks["fsdp2"]) else float("nan")
    print(f"fullshard / fsdp2: step time {ratio:.2f}x, peak {peak:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
