"""A compiled block as a unit, next to eager: equal losses and parameters, compiled once. PASS or FAIL.

    python benchmarks/compile_parity.py                             # inductor on CUDA (NCCL, world 1)
    python benchmarks/compile_parity.py --device cpu                # inductor on the CPU (gloo; needs a C++ compiler)
    python benchmarks/compile_parity.py --device cpu --backend aot_eager --steps 2   # a quick CPU smoke check

One process at world 1 (NCCL on CUDA, gloo on the CPU). Two copies of one
seeded GPT: the eager one is ``fully_shard``-ed per block and at the root; in
the other each block is ``torch.compile``-d first and the compiled block is
made the unit (torchtitan's order), then the root. Both train ``--steps``
AdamW steps on the same tokens. PASS when every step's loss and every
parameter after the last step agree within ``--rtol`` / ``--atol`` (inductor
fuses and reorders float ops, so exact equality is not expected) and no graph
is compiled after the first step (the unit's hooks must not break the
guards). The exit status is 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.models import ModelArgs, Transformer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--mixed-precision", choices=["bf16"], default=None, help="bf16 compute, fp32 reduce")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rtol", type=float, default=None, help="default: 1e-4 in fp32, 2e-2 in bf16")
    parser.add_argument("--atol", type=float, default=None, help="losses; default: 1e-5 in fp32, 1e-2 in bf16")
    parser.add_argument("--param-atol", type=float, default=None,
                        help="parameters; default: 1e-4 in fp32, 1e-2 in bf16")
    args = parser.parse_args(argv)
    low = args.mixed_precision is not None
    args.rtol = args.rtol if args.rtol is not None else (2e-2 if low else 1e-4)
    args.atol = args.atol if args.atol is not None else (1e-2 if low else 1e-5)
    # AdamW scales each update to about lr, so a parameter whose gradient is near zero may move
    # differently by a fraction of lr (1e-3) when inductor rounds that gradient differently
    args.param_atol = args.param_atol if args.param_atol is not None else (1e-2 if low else 1e-4)
    return args


def build(model_args: ModelArgs, device: torch.device, mixed: bool, backend: str | None) -> torch.nn.Module:
    """The seeded model on ``device``, sharded per block (compiled first when ``backend``) and at the root."""
    torch.manual_seed(0)
    model = Transformer(model_args).to(device)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    kwargs = {"mesh": mesh} | ({"mp_policy": policy} if policy else {})
    for index, layer in enumerate(model.layers):
        if backend is not None:
            model.layers[index] = layer = torch.compile(layer, backend=backend)
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return compare(args, device)
    finally:
        dist.destroy_process_group()


def compare(args: argparse.Namespace, device: torch.device) -> int:
    model_args = ModelArgs(n_layers=args.layers, dim=args.dim, n_heads=max(args.dim // 64, 1), vocab_size=256,
                           max_seq_len=args.seq)
    mixed = args.mixed_precision is not None
    torch._dynamo.reset()
    models = {name: build(model_args, device, mixed, backend)
              for name, backend in (("eager", None), ("compiled", args.backend))}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    generator = torch.Generator().manual_seed(1)
    losses: dict[str, list[float]] = {name: [] for name in models}
    graphs = []
    for _ in range(args.steps):
        tokens = torch.randint(256, (args.batch, args.seq + 1), generator=generator).to(device)
        for name, model in models.items():
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
            losses[name].append(loss.item())
        graphs.append(graphs_compiled())
    return verdict(args, models, losses, graphs)


def verdict(args: argparse.Namespace, models: dict, losses: dict[str, list[float]], graphs: list[int]) -> int:
    eager, compiled = torch.tensor(losses["eager"]), torch.tensor(losses["compiled"])
    loss_ok = torch.allclose(compiled, eager, rtol=args.rtol, atol=args.atol)
    worst_param, worst_name = 0.0, ""
    params_ok = True
    # a compiled block's parameters sit under its _orig_mod
    compiled_params = {name.replace("._orig_mod", ""): p for name, p in models["compiled"].named_parameters()}
    for name, param in models["eager"].named_parameters():
        other = compiled_params[name]
        a, b = param.full_tensor().float(), other.full_tensor().float()
        diff = (a - b).abs().max().item()
        if diff > worst_param:
            worst_param, worst_name = diff, name
        params_ok &= torch.allclose(b, a, rtol=args.rtol, atol=args.param_atol)
    once = graphs[0] > 0 and all(count == graphs[0] for count in graphs)
    print(f"backend {args.backend} on {args.device}, {args.mixed_precision or 'fp32'}, torch {torch.__version__}")
    for step, (a, b) in enumerate(zip(losses["eager"], losses["compiled"]), 1):
        print(f"step {step}: eager {a:.6f}  compiled {b:.6f}  diff {abs(a - b):.2e}")
    print(f"graphs compiled after each step: {graphs}")
    print(f"largest parameter difference: {worst_param:.2e} ({worst_name})")
    passed = loss_ok and params_ok and once
    why = [label for label, ok in (("losses", loss_ok), ("params", params_ok), (f"graphs {graphs}", once)) if not ok]
    print(f"compile parity: {'PASS' if passed else 'FAIL (' + ', '.join(why) + ')'} "
          f"(max loss diff {(eager - compiled).abs().max().item():.2e}, rtol {args.rtol}, atol {args.atol}, "
          f"param atol {args.param_atol})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
