"""``fullshard plan``: the estimator's arithmetic, the CLI, and the prediction against measured steps.

The measured comparison runs the real engine (one unit per block plus the
root, as in test_fully_shard_comm.py) at world sizes 1, 2 and 4 and checks the
predicted peak memory per rank within 5% and the bytes per step exactly.
"""

import itertools
import os
import subprocess
import sys
import time

import pytest
import tomllib
import torch
import torch.nn as nn

import fullshard
from fullshard._text import human_bytes
from fullshard.cli import plan as plan_cli
from fullshard.cli.__main__ import main
from fullshard.models import PRESETS, ModelArgs, Transformer, get_preset
from fullshard.plan import STRATEGIES, PlanConfig, estimate
from fullshard.plan.units import model_units
from fullshard.testing import run_distributed
from fullshard.testing.memory import measure_step

# 66 and 253 rows do not split evenly over 4 ranks: padding is part of what is checked.
ARGS = ModelArgs(n_layers=3, dim=66, n_heads=6, vocab_size=253, max_seq_len=30)
BATCH = 2
RANKS_PER_NODE = 2  # hybrid at world size 4: two "nodes" of two


def meta_model(args: ModelArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def padded_bytes(model: torch.nn.Module, shard_size: int) -> int:
    """Bytes of all parameters, each padded to a multiple of shard_size rows (as fullshard pads)."""
    total = 0
    for param in model.parameters():
        rows = param.shape[0]
        total += -(-rows // shard_size) * shard_size * (param.numel() // rows) * param.element_size()
    return total


def root_padded_bytes(model: torch.nn.Module, shard_size: int) -> int:
    """The root unit's share of ``padded_bytes``: everything outside the blocks."""
    root = nn.Module()
    for i, (name, param) in enumerate(model.named_parameters()):
        if not name.startswith("layers."):
            root.register_parameter(f"p{i}", param)
    return padded_bytes(root, shard_size)


# -- the arithmetic ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("tied", [True, False])
def test_units_are_the_models_parameters(name, tied):
    args = get_preset(name, weight_tying=tied)
    model = meta_model(args)
    units = model_units(args, shard_size=1)
    assert sum(u.numel for u in units) == args.num_params == sum(p.numel() for p in model.parameters())

    def shapes(params):
        return sorted((p.shape[0], p.numel() // p.shape[0]) for p in params)

    root = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
    assert sorted(units[0].shapes) == shapes(root)
    assert all(sorted(u.shapes) == shapes(model.layers[0].parameters()) for u in units[1:])
    assert len(units) == args.n_layers + 1


@pytest.mark.parametrize("world_size", [2, 3, 7, 64, 10_000])
def test_bytes_per_step_are_padded_parameter_multiples(world_size):
    model = meta_model(ARGS)
    padded, params = padded_bytes(model, world_size), padded_bytes(model, 1)

    def comm_of(strategy, **kwargs):
        return estimate(PlanConfig(ARGS, world_size, strategy, **kwargs)).comm

    # Full sharding: the blocks all-gathered in forward and backward, the root once (it keeps its
    # parameters for backward, as the engine does); reduce-scatter once.
    root = root_padded_bytes(model, world_size)
    assert comm_of("full") == {"all_gather": 2 * padded - root, "reduce_scatter": padded}
    assert comm_of("grad-op") == {"all_gather": padded, "reduce_scatter": padded}
    assert comm_of("no-shard") == {"all_reduce": params}
    hybrid = comm_of("hybrid", ranks_per_node=world_size)  # one node: plain full sharding
    assert hybrid == comm_of("full")
    # bf16 gathers move half the bytes; gradients are still reduced in fp32.
    mixed = comm_of("full", param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert mixed == {"all_gather": padded - root // 2, "reduce_scatter": padded}


def test_hybrid_reduces_within_nodes_and_all_reduces_across():
    model = meta_model(ARGS)
    plan = estimate(PlanConfig(ARGS, 64, "hybrid", ranks_per_node=8))
    assert plan.comm == {
        "all_gather": 2 * padded_bytes(model, 8) - root_padded_bytes(model, 8),
        "reduce_scatter": padded_bytes(model, 8),
        "all_reduce": padded_bytes(model, 8) // 8,
    }
    # The root once, the three small blocks in one bucket (forward and backward); unbucketed: 1 + 2 x 3.
    assert plan.comm_calls == {"all_gather": 3, "reduce_scatter": 4, "all_reduce": 4}
    unbucketed = estimate(PlanConfig(ARGS, 64, "hybrid", ranks_per_node=8, all_gather_bucket_bytes=0))
    assert unbucketed.comm == plan.comm and unbucketed.comm_calls["all_gather"] == 7
    with pytest.raises(ValueError, match="multiple of ranks_per_node for hybrid, but got 12 and 8"):
        PlanConfig(ARGS, 12, "hybrid", ranks_per_node=8)


def test_sharded_state_shrinks_with_world_size():
    args = get_preset("gpt-125m")
    sizes = [1, 2, 3, 4, 8, 16, 100, 512, 768, 1000, 4096, 10_000]
    plans = [estimate(PlanConfig(args, size)) for size in sizes]
    assert plans[0].params == plans[0].grads == 4 * args.num_params
    assert plans[0].optimizer_states == 2 * plans[0].params
    for before, after in itertools.pairwise(plans):
        assert after.params <= before.params and after.optimizer_states <= before.optimizer_states
    # The peak falls while every parameter has at least one row per rank (dim = 768 rows) and the
    # root, gathered from forward to backward, pads little (its 1,024 positions: 2 rows a rank at 512) ...
    upto_dim = [p.peak for p in plans if p.config.world_size <= 512]
    assert upto_dim == sorted(upto_dim, reverse=True)
    # ... beyond that each (768, x) weight is padded to world-size rows: gathered units grow.
    at_dim = plans[sizes.index(args.dim)]
    assert plans[-1].largest_unit > at_dim.largest_unit and plans[-1].comm_bytes > 5 * at_dim.comm_bytes
    no_shard = [estimate(PlanConfig(args, size, "no-shard")).peak for size in sizes]
    assert no_shard == [no_shard[0]] * len(sizes)


def test_ten_thousand_ranks_is_instant():
    start = time.perf_counter()
    for strategy in STRATEGIES:
        plan = estimate(PlanConfig(get_preset("gpt-175b"), 10_000, strategy, ranks_per_node=8))
        assert plan.peak > 0
    assert time.perf_counter() - start < 1.0


def test_mixed_precision_and_offload():
    args = get_preset("gpt-1.3b")
    fp32 = estimate(PlanConfig(args, 64))
    bf16 = estimate(PlanConfig(args, 64, param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert bf16.largest_unit * 2 == fp32.largest_unit
    assert bf16.activations < fp32.activations and bf16.peak < fp32.peak
    assert bf16.params == fp32.params  # the shards and optimizer states stay fp32
    offload = estimate(PlanConfig(args, 64, cpu_offload=True))
    assert offload.host == fp32.params + fp32.grads + fp32.optimizer_states
    assert offload.peak < fp32.peak and fp32.host == 0
    assert not {"sharded params", "sharded grads", "optimizer states"} & set(offload.peak_breakdown)


def test_breakdown_adds_up():
    plan = estimate(PlanConfig(get_preset("gpt-7b"), 64, batch_size=2))
    assert sum(plan.peak_breakdown.values()) == plan.peak
    assert plan.peak_phase == "backward"
    assert plan.peak_breakdown["optimizer states"] == plan.optimizer_states


def test_bad_input():
    with pytest.raises(ValueError, match="strategy in"):
        PlanConfig(ARGS, 2, "zero-3")
    with pytest.raises(ValueError, match=r"seq_len in \[1, 30\] but got 31"):
        PlanConfig(ARGS, 2, seq_len=31)
    with pytest.raises(ValueError, match="get_preset expects one of gpt-tiny"):
        get_preset("gpt-5")
    assert get_preset("gpt-30m", n_layers=2, dim=None).n_layers == 2
    assert round(get_preset("gpt-30m").num_params / 1e6, 1) == 32.1  # benchmarks/bench.py's model


# -- the command line -------------------------------------------------------------------------
def test_cli_table(capsys):
    main(["plan", "--model", "gpt-tiny", "--world-size", "1-4", "--batch-per-rank", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("full ")]
    assert [row[1] for row in rows] == ["1", "2", "4"]
    for row in rows:
        plan = estimate(PlanConfig(get_preset("gpt-tiny"), int(row[1]), batch_size=2, device="cpu"))
        assert " ".join(row[-4:]) == human_bytes(plan.peak) + " " + human_bytes(plan.comm_bytes)


def test_cli_single_configuration_shows_its_peak(capsys):
    assert (
        main(["plan", "--model", "gpt-7b", "--world-size", "64", "--mixed-precision", "bf16", "--memory-limit", "80"])
        == 0
    )
    out = capsys.readouterr().out
    assert "6.66B parameters (32 blocks, dim 4096" in out
    assert "peak" in out and "during backward:" in out and "activations" in out
    assert "all_gather 65 x" in out and "reduce_scatter 33 x" in out  # the root once, each block twice
    assert out.splitlines()[4].split()[-1] == "yes"  # fits 80 GiB
    main(["plan", "--strategy", "hybrid", "--world-size", "4", "12", "--ranks-per-node", "8"])
    out = capsys.readouterr().out
    assert "(hybrid skips world sizes that are not multiples of 8: 12)" in out
    assert "(hybrid at world size 4: one shard group of every rank, no replicas: the same as full)" in out


def test_cli_flat_params(capsys):
    """``--flat-params``: FSDP1's flat layout, fewer padded elements per rank than rows at a large world."""
    main(["plan", "--model", "gpt-125m", "--world-size", "1024", "--flat-params"])
    out = capsys.readouterr().out
    assert "flat parameters (use_orig_params=False)" in out
    flat = estimate(PlanConfig(get_preset("gpt-125m"), 1024, flat_params=True))
    rows = estimate(PlanConfig(get_preset("gpt-125m"), 1024))
    assert human_bytes(flat.params) in out and flat.params < rows.params
    args = get_preset("gpt-125m")
    assert flat.params == sum(-(-unit.numel // 1024) for unit in model_units(args, 1024)) * 4  # fp32 pieces
    main(["plan", "--model", "gpt-125m", "--world-size", "1024", "--flat-params", "--all-gather-dtype", "int8"])
    out = capsys.readouterr().out
    assert "weights gathered as int8, flat parameters (use_orig_params=False)" in out
    coded = estimate(PlanConfig(args, 1024, flat_params=True, all_gather_dtype=torch.int8))
    # 1-byte codes for the blocks' weights; the embeddings (a third of gpt-125m) stay exact, in fp32
    assert 0.25 * flat.comm["all_gather"] < coded.comm["all_gather"] < 0.75 * flat.comm["all_gather"]


def test_cli_world_size_ranges():
    assert plan_cli.world_sizes("1-10") == [1, 2, 4, 8, 10]
    assert plan_cli.world_sizes("64") == [64]
    with pytest.raises(Exception, match="expects 1 <= A <= B"):
        plan_cli.world_sizes("8-2")
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["fullshard"] == "fullshard.cli.__main__:main"


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    main(["plan", "--model", "gpt-125m", "--world-size", "1-1024", "--plot", str(path), "--memory-limit", "24"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit, match=r"needs matplotlib: pip install 'fullshard\[plot\]'"):
        main(["plan", "--plot", str(tmp_path / "plan.png")])


@pytest.mark.parametrize(
    "flags, lines",
    [
        (["--strategy", "hybrid", "--ranks-per-node", "0"], ["--ranks-per-node expects a positive number but got 0"]),
        (["--ranks-per-node", "4"], ["--ranks-per-node 4 applies only to --strategy hybrid (or all), but got "
                                     "--strategy full: add hybrid, or drop --ranks-per-node"]),
        (["--batch", "0", "--layers", "0", "--dim", "30", "--heads", "4", "--memory-limit", "0"], [
            "--layers expects a positive number but got 0",
            "--batch expects a positive number but got 0",
            "--memory-limit expects a positive number of GiB but got 0",
            "--dim 30 must be divisible by --heads 4",
        ]),
        (["--plot", "{tmp}/missing/plan.png"], ["--plot {tmp}/missing/plan.png: the folder {tmp}/missing does not exist"]),
        (["--plot", "{tmp}/plan.xyz"], ["--plot {tmp}/plan.xyz: expects a file name ending in one of .png, .pdf"]),
        (["--batch", "3", "--world-size", "2", "4"], ["nothing to estimate (see the notes above)"]),
    ],
    ids=["ranks-per-node-0", "ranks-per-node-without-hybrid", "all-at-once", "plot-folder", "plot-format",
         "batch-divides-nothing"],
)
def test_cli_bad_flags_are_one_line_each_naming_the_flag(flags, lines, tmp_path, capsys):
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    assert main(["plan", *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == len(lines), err
    for said, line in zip(err, lines):
        assert said.startswith("fullshard plan: " + line.format(tmp=tmp_path)), said


def test_cli_batch_is_the_global_batch_as_in_train(capsys):
    """``--batch`` is sequences per step over all ranks, as ``fullshard train``'s; ``--batch-per-rank``
    the old meaning. World sizes the batch does not divide are skipped, and said so."""
    assert main(["plan", "--world-size", "1-8", "--batch", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "(--batch 4 (over all ranks) skips world sizes it does not divide: 8)" in out
    assert "4 x 64 tokens per step over all ranks (sequences per rank: 4 at 1, 2 at 2, 1 at 4)" in out
    rows = {row.split()[1]: " ".join(row.split()[-4:-2]) for row in out.splitlines() if row.startswith("full ")}
    for world, per_rank in (("1", 4), ("2", 2), ("4", 1)):
        plan = estimate(PlanConfig(get_preset("gpt-tiny"), int(world), batch_size=per_rank, device="cpu"))
        assert rows[world] == human_bytes(plan.peak)
    assert main(["plan", "--world-size", "4", "--batch-per-rank", "2"]) == 0
    assert "2 x 64 tokens per rank" in capsys.readouterr().out


def test_cli_labels_say_what_runs(capsys):
    main(["plan", "--strategy", "no-shard", "--world-size", "2", "--all-gather-dtype", "int8"])
    out = capsys.readouterr().out
    assert "(--all-gather-dtype int8 has no effect where no all-gather runs: no-shard at 2)" in out
    assert "gathered as" not in out
    main(["plan", "--world-size", "8"])
    out = capsys.readouterr().out
    assert "saved activations" in out.splitlines()[3]  # the table's column: what forward leaves for backward
    assert "  activations and their grads" in out  # the breakdown's: alive at the peak


@pytest.mark.launch
def test_cli_closed_pipe_is_quiet():
    root = os.path.dirname(os.path.dirname(fullshard.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "fullshard", "plan", "--world-size", "1-1024", "--strategy", "all"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    process.stdout.readline()
    process.stdout.close()  # as `| head -1` does
    err = process.stderr.read().decode()
    assert process.wait(120) in (0, 141) and "Traceback" not in err, err


# -- against the real engine (see [Note: Measured step memory on CPU]) --------------------------
# The plan's peak against the measured one: fp32 steps land within 0.03% (the tensors a step holds are
# modelled one by one), so 0.1% there; leaving out one category (the sharded gradients: -2%) fails. bf16
# compute and the fused codec's buffers are modelled coarser (measured -0.5% to -2.8%): 5% there.
EXACT_PEAK = 1e-3
COARSE_PEAK = 0.05


def peak_tolerance(bf16: bool, fused: bool = False) -> float:
    return COARSE_PEAK if bf16 or fused else EXACT_PEAK


@pytest.mark.parametrize(
    "strategy, world_size, bf16, front_end, offload",
    [
        ("full", 1, False, "fully_shard", False),
        ("full", 2, False, "fully_shard", False),
        ("full", 4, False, "fully_shard", False),
        ("grad-op", 2, False, "fully_shard", False),
        ("no-shard", 2, False, "fully_shard", False),
        ("hybrid", 4, False, "fully_shard", False),
        ("full", 4, True, "fully_shard", False),
        ("full", 2, False, "wrapper", False),
        ("full", 2, False, "wrapper-flat", False),
        ("full", 4, True, "wrapper-flat", False),
        ("full", 2, False, "fully_shard", True),
        ("full", 2, False, "wrapper", True),
    ],
)
def test_prediction_matches_measured_step(strategy, world_size, bf16, front_end, offload):
    measured = run_distributed(
        measure_step, world_size, ARGS, BATCH, strategy, bf16, RANKS_PER_NODE, front_end=front_end, offload=offload
    )
    config = PlanConfig(
        ARGS,
        world_size,
        strategy,
        ranks_per_node=RANKS_PER_NODE,
        batch_size=BATCH,
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
        cpu_offload=offload,
        flat_params=front_end == "wrapper-flat",
        device="cpu",
    )
    plan = estimate(config)
    peak = max(rank["peak"] for rank in measured)  # rank 0: with padding it holds the most rows
    late = max(rank["late_release"] for rank in measured)
    print(
        f"{front_end} {strategy} world {world_size}{' bf16' if bf16 else ''}{' offload' if offload else ''}: measured "
        f"{peak} B (up to {late} B more when gloo releases late), predicted {plan.peak} B "
        f"({plan.peak / peak - 1:+.4%}); bytes/step measured {sum(measured[0]['comm'].values())}, "
        f"predicted {plan.comm_bytes}"
    )
    units = model_units(ARGS, config.shard_size, config.flat_params)
    assert measured[0]["shard_numels"] == [u.shard_numel for u in units]
    assert measured[0]["comm"] == plan.comm  # both front ends keep the root gathered from forward to backward
    assert plan.peak == pytest.approx(peak, rel=peak_tolerance(bf16))


# Blocks of 98,304 coded values per rank at 2 ranks: the fused CPU codec's (see [Note: Fused codec]).
FUSED_ARGS = ModelArgs(n_layers=2, dim=128, n_heads=4, vocab_size=253, max_seq_len=30)


@pytest.mark.parametrize(
    "code, world_size, bf16, args, front_end",
    [
        (torch.int8, 2, False, ARGS, "fully_shard"),
        (torch.float8_e4m3fn, 2, True, ARGS, "fully_shard"),
        (torch.int8, 4, True, ARGS, "fully_shard"),
        (torch.int8, 2, True, FUSED_ARGS, "fully_shard"),
        (torch.int8, 2, False, ARGS, "wrapper-flat"),
        (torch.float8_e4m3fn, 4, True, ARGS, "wrapper-flat"),
        (torch.int8, 2, True, FUSED_ARGS, "wrapper-flat"),
    ],
    ids=["int8-2", "float8-2-bf16", "int8-4-bf16", "int8-2-bf16-fused", "flat-int8-2", "flat-float8-4-bf16",
         "flat-int8-2-bf16-fused"],
)
def test_prediction_matches_measured_step_with_quantized_all_gather(code, world_size, bf16, args, front_end):
    """Weights gathered as codes (per-parameter rows, or the wrapper's flat pieces): the plan's bytes
    are the comm spy's, its peak within ``peak_tolerance`` of the step's."""
    measured = run_distributed(
        measure_step, world_size, args, BATCH, "full", bf16, RANKS_PER_NODE, all_gather_dtype=code,
        front_end=front_end,
    )
    dtype = torch.bfloat16 if bf16 else None
    config = PlanConfig(
        args, world_size, "full", batch_size=BATCH, param_dtype=dtype, reduce_dtype=torch.float32 if bf16 else None,
        all_gather_dtype=code, flat_params=front_end == "wrapper-flat", device="cpu",
    )
    plan = estimate(config)
    peak = max(rank["peak"] for rank in measured)
    print(f"{code} world {world_size}: measured {peak} B, predicted {plan.peak} B ({plan.peak / peak - 1:+.4%})")
    assert measured[0]["comm"] == plan.comm  # both front ends gather the root once a step
    assert plan.peak == pytest.approx(peak, rel=peak_tolerance(bf16, fused=args is FUSED_ARGS))


def test_prediction_matches_the_demo_step():
    """``fullshard train``'s defaults (``make demo``) on 2 ranks: the tensors a step holds at its
    peak, as the profiler's allocation events count them (see [Note: Measured step memory on CPU])."""
    from fullshard.training import TrainConfig

    demo = TrainConfig()
    args, batch = demo.model_args(), demo.batch // 2
    measured = run_distributed(measure_step, 2, args, batch, "full", False, 2)
    plan = estimate(PlanConfig(args, 2, "full", batch_size=batch, device="cpu"))
    peak = max(rank["peak"] for rank in measured)
    print(f"demo: measured {peak} B, predicted {plan.peak} B ({plan.peak / peak - 1:+.4%})")
    assert plan.peak == pytest.approx(peak, rel=peak_tolerance(False))
