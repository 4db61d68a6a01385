"""``bench.py --device cuda`` and ``--fake-world N``: one process, frameworks one after another.

    python benchmarks/bench.py --device cuda --model gpt-1.3b --batch 4 --seq 2048 --mixed-precision bf16
    python benchmarks/bench.py --device cuda --fake-world 8 --model gpt-7b --batch 1 --seq 2048 --mixed-precision bf16
    python benchmarks/bench.py --device cpu --fake-world 8 --model gpt-tiny --steps 1   # smoke check, no GPU

World 1 runs over NCCL (gloo on CPU) in this process; ``--fake-world N`` runs
this process as rank 0 of N on torch's fake process group (every kernel runs,
collectives move no data: values and losses are meaningless, times and memory
are a rank's). Frameworks run one after another (each built, warmed up,
measured and freed before the next), since on a GPU several copies of a large
model do not fit at once. The model is built on the meta device and
materialised after sharding, so a rank never holds the whole model; every
framework gets the same initial values (a seeded normal per parameter at world
1; per shard under the fake group). Reported per framework:

- step time: median wall time of forward + backward + AdamW step, with a
  device synchronisation before and after;
- peak memory: ``torch.cuda.max_memory_allocated`` over the measured steps
  (on CPU: not measured, 0);
- copy/cast device time: the device time of the copy and cast ops of one
  profiled step (``COPY_OPS``: aten copies, casts, split-copies, chunk-cats,
  cats and FSDP2's fused ops), and their number of calls;
- ``--frameworks fullshard,fullshard-int8`` (or ``-float8``) adds fully_shard with its
  weights gathered as block-wise codes, and its step time against ``fullshard``: at a
  fake world the codec's kernels run on the device, so this is where one GPU runs them;
- tokens/s and model FLOPs utilisation (6 x parameters + attention FLOPs per
  token, over ``--peak-tflops``, default by GPU: H100/H200 989 bf16, 494 tf32).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fullshard.models import ModelArgs, Transformer, TransformerBlock

DEVICE_FRAMEWORKS = ("fullshard", "fsdp2", "fullshard-wrapper", "fsdp1", "local")
# fully_shard with its weights gathered as block-wise codes (rows on request only): at a fake
# world the codec's kernels run on the device even though the collective moves nothing
DEVICE_QUANTIZED = {"fullshard-int8": torch.int8, "fullshard-float8": torch.float8_e4m3fn}
COPY_OPS = (
    "aten::copy_",
    "aten::_to_copy",
    "aten::clone",
    "aten::split_with_sizes_copy",
    "aten::_chunk_cat",
    "aten::cat",
    "aten::_foreach_copy_",
)


@contextlib.contextmanager
def process_group(device: torch.device, fake_world: int | None) -> Iterator[None]:
    """World 1 over the device's backend, or rank 0 of a fake group of ``fake_world``."""
    if fake_world:
        from fullshard.testing.fake_group import fake_world as fake

        with fake(fake_world):
            yield
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(name: str, model_args: ModelArgs, device: torch.device, mixed: bool) -> nn.Module:
    """``name``'s model on ``device``, sharded over the whole (pinned) mesh.

    World 1: the seeded model (same values for every framework, so losses
    compare). Fake world: built on meta and materialised after sharding, so no
    rank holds the whole model (values do not matter there).
    """
    real = dist.get_world_size() == 1
    torch.manual_seed(0)
    with torch.device("cpu" if real else "meta"):
        model = Transformer(model_args)
    if real and name not in ("fullshard-wrapper", "fsdp1"):
        model = model.to(device)
    bf16 = torch.bfloat16
    if name in ("fullshard", "fsdp2", *DEVICE_QUANTIZED):
        if name != "fsdp2":
            from fullshard import MixedPrecisionPolicy, fully_shard
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if name in DEVICE_QUANTIZED:
            from fullshard import AllGatherQuantization, set_all_gather_quantization

            set_all_gather_quantization(model, AllGatherQuantization(dtype=DEVICE_QUANTIZED[name]))
    elif name in ("fullshard-wrapper", "fsdp1"):
        if name == "fullshard-wrapper":
            from fullshard import FSDP, MixedPrecision
            from fullshard.wrap import ModuleWrapPolicy
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import MixedPrecision
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        policy = MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32) if mixed else None
        model = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
            device_id=device,
            mixed_precision=policy,
            param_init_fn=lambda module: module.to_empty(device=device, recurse=False),
        )
    if not real:
        if name not in ("fullshard-wrapper", "fsdp1"):
            model.to_empty(device=device)
        initialise(model)
    return model


@torch.no_grad()
def initialise(model: nn.Module) -> None:
    """Finite values after ``to_empty``: a seeded normal (std 0.02) per local tensor."""
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        local.copy_(torch.randn(local.shape, generator=generator) * 0.02)


def flops_per_token(model_args: ModelArgs, num_params: int, seq: int) -> float:
    """Training FLOPs per token: 6 per parameter plus attention's 12 x layers x dim x seq."""
    return 6 * num_params + 12 * model_args.n_layers * model_args.dim * seq


def default_peak_tflops(device: torch.device, mixed: bool) -> float:
    if device.type != "cuda":
        return float("nan")
    name = torch.cuda.get_device_name(device)
    if "H100" in name or "H200" in name:
        return 989.0 if mixed else 494.0
    if "A100" in name:
        return 312.0 if mixed else 156.0
    return float("nan")


def copy_time(step, device: torch.device) -> tuple[float, int]:
    """(device seconds, calls) of the copy and cast ops of one profiled ``step()``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        synchronize(device)
    seconds, calls = 0.0, 0
    for event in prof.key_averages():
        if event.key in COPY_OPS or event.key.startswith("fsdp::"):
            seconds += event.self_device_time_total / 1e6 if device.type == "cuda" else event.self_cpu_time_total / 1e6
            calls += event.count
    return seconds, calls


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results: dict = {}
    with process_group(device, args.fake_world):
        world = dist.get_world_size()
        tokens = torch.randint(
            args.model_args.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)
        )
        for name in [f for f in args.frameworks if f != "local" or world == 1]:  # no plain model at a fake world
            results[name] = measure(name, args, device, tokens.to(device))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report(results, args, world)
    return results


def measure(name: str, args: argparse.Namespace, device: torch.device, tokens: torch.Tensor) -> dict:
    """Builds ``name``'s model and optimizer, warms up, measures; the row of the table."""
    mixed = bool(args.mixed_precision)
    model = build(name, args.model_args, device, mixed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed and name == "local")
    losses: list[torch.Tensor] = []

    def step() -> None:
        with autocast:
            logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for _ in range(args.warmup):
        step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        synchronize(device)
        began = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    copy_s, copy_calls = copy_time(step, device)
    step_s = statistics.median(times)
    tokens_per_s = tokens.numel() / step_s
    with torch.device("meta"):
        num_params = sum(p.numel() for p in Transformer(args.model_args).parameters())
    peak_flops = (args.peak_tflops or default_peak_tflops(device, mixed)) * 1e12
    return {
        "step_s": step_s,
        "peak_gib": peak / 2**30,
        "copy_ms": copy_s * 1e3,
        "copy_calls": copy_calls,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token(args.model_args, num_params, args.seq) / peak_flops,
        "losses": [float(loss) for loss in losses],
    }


def report(results: dict, args: argparse.Namespace, world: int) -> None:
    where = f"fake world {world}" if args.fake_world else f"world 1 ({'NCCL' if args.device == 'cuda' else 'gloo'})"
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"\n{args.model} on {name}, {where}, {args.batch}x{args.seq} tokens, {args.mixed_precision or 'fp32'}, "
        f"torch {torch.__version__}"
    )
    print(
        f"{'framework':<18} {'step (s)':>9} {'peak (GiB)':>11} {'copy+cast (ms)':>15} {'calls':>6} "
        f"{'tokens/s':>10} {'MFU':>6}  losses"
    )
    for framework, row in results.items():
        losses = " ".join(f"{loss:.5f}" for loss in row["losses"][: args.warmup + 1])
        print(
            f"{framework:<18} {row['step_s']:>9.4f} {row['peak_gib']:>11.2f} {row['copy_ms']:>15.2f} "
            f"{row['copy_calls']:>6} {row['tokens_per_s']:>10.0f} {row['mfu']:>6.3f}  {losses}"
        )
    pairs = [("fullshard", "fsdp2"), ("fullshard-wrapper", "fsdp1"), ("fullshard", "local")]
    for ours, theirs in pairs + [(name, "fullshard") for name in DEVICE_QUANTIZED]:
        if ours in results and theirs in results:
            a, b = results[ours], results[theirs]
            peak = a["peak_gib"] / b["peak_gib"] if b["peak_gib"] else float("nan")
            copies = a["copy_ms"] / b["copy_ms"] if b["copy_ms"] else float("nan")
            print(
                f"  {ours} / {theirs}: step time {a['step_s'] / b['step_s']:.3f}x, peak {peak:.3f}x, "
                f"copy+cast time {copies:.3f}x"
            )
