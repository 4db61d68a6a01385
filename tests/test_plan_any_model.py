"""``fullshard.plan.plan`` for models that are not ours, against the real engine.

Three models: a tiny Llama and a tiny GPT-2 built from transformers configs
(their own loss through ``labels``), and a user-style convolutional network
written here (residual blocks with BatchNorm, the default loss: the output's
mean). Each is traced on fake tensors, then each choice is run for real on
2 and 4 gloo ranks (rank pool) and on torch's fake process group at 8 and 64
ranks; the predicted per-rank peak must be within 5% of the measured one and
the bytes per step equal. The order of predicted step times against measured
ones is a benchmark (benchmarks/bench_plan_any_model.py), not a test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import transformers

import fullshard
from fullshard.cli.__main__ import main
from fullshard.plan import Choice, plan
from fullshard.plan.apply import choice_code
from fullshard.plan.blocks import select_blocks
from fullshard.plan.measure import measure_choice
from fullshard.plan.playback import predict
from fullshard.plan.profiles import PROFILES, load_profile
from fullshard.plan.segments import fold
from fullshard.plan.step_time import StepClock
from fullshard.plan.trace import trace_step
from fullshard.testing import run_distributed
from fullshard.testing.fake_group import fake_world

VOCAB, SEQ = 67, 16  # 67 rows: padded at every world size


def llama(width: int = 32, layers: int = 2, vocab: int = VOCAB, seq: int = SEQ) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=width * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq, bos_token_id=0, eos_token_id=0,
        pad_token_id=None,
    )
    return transformers.LlamaForCausalLM(config)


def gpt2(width: int = 32, layers: int = 2, vocab: int = VOCAB, seq: int = SEQ) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=4, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def tokens(n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(VOCAB, (n, SEQ))
    return {"input_ids": ids, "labels": ids}


class Residual(nn.Module):
    """A ResNet-style block: conv, BatchNorm, ReLU twice, plus the input."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class ConvNet(nn.Module):
    """24 channels: a block's gathered parameters and gradients (42 KB) pass gloo's latency bound (32 KiB),
    so its collectives take the paths NCCL's memory behaviour matches (below it, gloo's all-gather and the
    gathered reduce-scatter hold temporaries of up to world x the unit, which the plan does not model)."""

    def __init__(self, channels: int = 24, blocks: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[Residual(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.stem(images))).mean((2, 3)))


def convnet() -> nn.Module:
    return ConvNet()


def images(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 12, 12)


MODELS = {"llama": (llama, tokens), "gpt2": (gpt2, tokens), "convnet": (convnet, images)}


# -- no ranks -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, block", [("llama", "LlamaDecoderLayer"), ("gpt2", "GPT2Block"), ("convnet", "Residual")]
)
def test_units_are_the_repeated_blocks(name, block):
    model_fn, batch_fn = MODELS[name]
    model = model_fn()
    chosen = select_blocks(model)
    assert [type(m).__name__ for _, m in chosen] == [block] * (3 if name == "convnet" else 2)
    trace = trace_step(model_fn, batch_fn, 2)
    assert [u.name for u in trace.units] == ["", *(n for n, _ in chosen)]
    assert sum(r * row for u in trace.units for r, row in u.shapes) == sum(p.numel() for p in model.parameters())


@pytest.mark.slow  # several traces and searches: >2 s
def test_trace_flops_are_torchs_flop_counter():
    """The trace counts what torch's FLOP counter counts for a real step (forward and backward)."""
    model = convnet()
    batch = images(2)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        model(batch).mean().backward()
    trace = trace_step(convnet, images, 2)
    assert trace.flops == counter.get_total_flops() > 0
    assert trace.backward_flops > trace.forward_flops


def test_trace_allocates_nothing():
    """A 1.1B-parameter Llama is traced without the memory it would take (fake tensors)."""
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=64,
    )

    def model_fn() -> nn.Module:
        return transformers.LlamaForCausalLM(config)

    def batch_fn(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(32000, (n, 64))
        return {"input_ids": ids, "labels": ids}

    trace = trace_step(model_fn, batch_fn, 1)
    assert sum(r * row for u in trace.units for r, row in u.shapes) > 2e8  # 800 MB of fp32 never allocated


class Alternating(nn.Module):
    """Blocks of one class and one shape whose work differs (every other one squares its input)."""

    def __init__(self, blocks: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(blocks)])
        for index, block in enumerate(self.blocks):
            block.register_forward_hook(lambda m, a, out, square=index % 2: out * out if square else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_long_stack_is_traced_as_four_blocks(monkeypatch):
    """A stack of five blocks traced as four, the middle one's events repeated, predicts what the
    whole trace does (checkpointing's saved inputs, freed as the graph dies, included); blocks
    whose events differ are traced whole."""
    import fullshard.plan.trace as trace_module

    cases = [
        (lambda: llama(layers=5), tokens, True),
        (Alternating, lambda n: torch.randn(n, 8, requires_grad=True), False),
    ]
    choices = [Choice(4, "full", micro_batch=2, device="cpu"),
               Choice(4, "grad-op", micro_batch=2, all_gather_dtype=torch.int8, mixed_precision=torch.bfloat16)]
    shortened = [trace_step(model_fn, batch_fn, 2, None, ac, device="cpu") for model_fn, batch_fn, ac in cases]
    monkeypatch.setattr(trace_module, "shorten", lambda *a: contextlib.nullcontext(False))
    for (model_fn, batch_fn, ac), short in zip(cases, shortened):
        whole = trace_step(model_fn, batch_fn, 2, None, ac, device="cpu")
        assert (short.forward_flops, short.backward_flops, short.saved_bytes) == (
            whole.forward_flops, whole.backward_flops, whole.saved_bytes)
        assert [u.name for u in short.units] == [u.name for u in whole.units] and len(short.units) == 6
        for choice in choices:
            a = predict(short, choice, StepClock(PROFILES["h100"], choice))
            b = predict(whole, choice, StepClock(PROFILES["h100"], choice))
            assert (a.peak, a.peak_breakdown) == (b.peak, b.peak_breakdown), choice.label()
            assert a.time.total == pytest.approx(b.time.total, rel=1e-12), choice.label()
    assert shortened[1].events == whole.events  # the alternating blocks: traced whole


def test_folded_playback_is_the_events_one_by_one():
    """Folding a run of the model's events into one segment changes no prediction."""
    trace = trace_step(convnet, images, 2, device="cpu")
    one_by_one = tuple(item for event in trace.events for item in fold((event,)))
    assert len(one_by_one) > 2 * len(trace.folded)
    for profile, choice in [(PROFILES["h100"], Choice(2, "full", micro_batch=2)),
                            (CPU_PROFILE, Choice(2, "no-shard", micro_batch=2, device="cpu"))]:
        folded = predict(trace, choice, StepClock(profile, choice))
        trace.__dict__["folded"] = one_by_one
        unfolded = predict(trace, choice, StepClock(profile, choice))
        del trace.__dict__["folded"]
        assert (folded.peak, folded.peak_phase, folded.peak_breakdown) == (
            unfolded.peak, unfolded.peak_phase, unfolded.peak_breakdown)
        assert folded.time.total == pytest.approx(unfolded.time.total, rel=1e-9)
        assert folded.time.compute == pytest.approx(unfolded.time.compute, rel=1e-9)


# A CPU profile as --calibrate writes one (collectives on the rank's cores), figures round.
CPU_PROFILE = dataclasses.replace(
    PROFILES["h100"], name="test cpu", device="cpu", matmul_flops={"float32": 40e9}, matmul_efficiency=1.0,
    memory_bandwidth=15e9, op_overhead=20e-6, unit_overhead=500e-6, optimizer_overhead=700e-6,
    collective_bandwidth={"all_gather": 0.8e9, "reduce_scatter": 0.4e9, "all_reduce": 0.8e9},
    collectives_overlap=False, collective_latency=400e-6, measured=True,
)


def test_step_time_counts_what_the_engine_does():
    """The clock's parts: collectives that cannot overlap are all exposed; reduce-scatter at its own
    rate; the engine's per-unit work per micro-batch; the optimizer's per tensor; the int8 codec's
    passes (eager on an accelerator: more bytes than the copy-out it replaces)."""
    trace = trace_step(convnet, images, 1, device="cpu")
    one = Choice(2, "full", micro_batch=1, device="cpu")

    def timed(choice, profile=CPU_PROFILE):
        return predict(trace, choice, StepClock(profile, choice)).time

    cpu = timed(one)
    assert cpu.exposed == pytest.approx(cpu.communication) and cpu.communication > 0
    assert cpu.total == pytest.approx(cpu.compute + cpu.communication + cpu.optimizer)
    overlapped = timed(one, dataclasses.replace(CPU_PROFILE, collectives_overlap=True))
    assert overlapped.exposed < overlapped.communication and overlapped.total < cpu.total
    slower_reduce = timed(one, dataclasses.replace(
        CPU_PROFILE, collective_bandwidth={**CPU_PROFILE.collective_bandwidth, "reduce_scatter": 0.1e9}))
    assert slower_reduce.communication > cpu.communication
    no_hooks = timed(one, dataclasses.replace(CPU_PROFILE, unit_overhead=0.0))
    assert cpu.engine - no_hooks.engine == pytest.approx(len(trace.units) * CPU_PROFILE.unit_overhead)
    tensors = sum(len(u.shapes) for u in trace.units)
    no_optim = timed(one, dataclasses.replace(CPU_PROFILE, optimizer_overhead=0.0))
    assert cpu.optimizer - no_optim.optimizer == pytest.approx(tensors * CPU_PROFILE.optimizer_overhead)
    gpu = [Choice(2, "full", micro_batch=1, all_gather_dtype=code) for code in (None, torch.int8)]
    plain, coded = (timed(c, PROFILES["h100"]) for c in gpu)
    assert coded.engine > plain.engine and coded.comm_bytes["all_gather"] < plain.comm_bytes["all_gather"]


@pytest.mark.slow  # several traces and searches: >2 s
def test_plan_picks_a_choice_that_fits_and_explains():
    space = {"micro_batches": [1, 2], "cpu_offload": (False,), "all_gather_dtypes": (None,)}  # 40 choices, 8 traces
    unlimited = plan(llama, tokens, world_size=8, global_batch=16, ranks_per_node=4, **space)
    peaks = sorted(p.peak for p in unlimited.predictions)
    limit = peaks[len(peaks) // 2] / 2**30  # half of the choices fit
    choices = [p.choice for p in unlimited.predictions]
    result = plan(llama, tokens, world_size=8, global_batch=16, memory_limit_gib=limit, ranks_per_node=4,
                  choices=choices)
    assert result.best is not None and result.best.time.total > unlimited.best.time.total  # the fastest did not fit
    best = result.best
    assert best is not None and best.peak <= result.memory_limit
    assert [p.choice for p in result.fitting][:1] == [best.choice]
    fitting_times = [p.time.total for p in result.fitting]
    assert fitting_times == sorted(fitting_times)
    assert any(not result.fits(p) for p in result.predictions)  # the limit bites
    report = result.report()
    assert "first choice: " + best.choice.label() in report and "for block in model.model.layers:" in report
    assert "does not fit" in report or "slower by" in report


def test_the_choices_code_runs():
    """The printed lines shard the model (on a fake group of 8, on CPU)."""
    choice = Choice(8, "hybrid", hybrid_shard_size=4, mixed_precision=torch.bfloat16, checkpointing=True)
    code = choice_code(choice, ["model.layers.0", "model.layers.1"], device_type="cpu")
    with fake_world(8):
        model = llama()
        exec(code, {"model": model})
        assert type(model).__name__.startswith("FSDP")


class Fp32Only(nn.Module):
    """A model whose forward refuses bf16 (as some custom kernels do)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layers[0].weight.dtype == torch.bfloat16:
            raise RuntimeError("Fp32Only runs in fp32 only")
        return self.layers[1](self.layers[0](x))


def test_a_setting_the_model_cannot_run_is_skipped_and_said():
    result = plan(Fp32Only, lambda n: torch.randn(n, 8), world_size=2, micro_batches=[1], checkpointing=(False,),
                  cpu_offload=(False,))
    assert result.predictions and all(p.choice.mixed_precision is None for p in result.predictions)
    said = "micro-batch 1, bfloat16 compute: the step fails on this model: Fp32Only runs in fp32 only"
    assert said in result.report()


def test_nothing_fits():
    result = plan(convnet, images, world_size=2, memory_limit_gib=1e-6, mixed_precision=(None,), checkpointing=(False,))
    assert result.best is None and "no choice fits" in result.report()


def test_profiles():
    assert PROFILES["h200"].memory_bandwidth > PROFILES["h100"].memory_bandwidth
    assert load_profile("H100") is PROFILES["h100"]
    for profile in PROFILES.values():  # says what its figures are, and how to replace them
        assert not profile.measured and "not measured" in profile.caveat and "--calibrate" in profile.caveat
    assert "measured" in CPU_PROFILE.caveat and "not measured" not in CPU_PROFILE.caveat
    with pytest.raises(ValueError, match="plan expects a device profile named h100 or h200"):
        load_profile("a100")


def test_bucket_default_is_the_engines():
    from fullshard._core.settings import DEFAULT_ALL_GATHER_BUCKET_BYTES
    from fullshard.plan.choice import DEFAULT_BUCKET_BYTES

    assert DEFAULT_BUCKET_BYTES == DEFAULT_ALL_GATHER_BUCKET_BYTES


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--hf-config", "meta-llama/Llama-2-7b"], "--hf-config meta-llama/Llama-2-7b: no such local file or folder"),
        (["--module", "nocolon"], "--module expects PKG.MOD:FACTORY but got 'nocolon'"),
        (["--module", "a:b", "--world-size", "2", "4"], "--world-size expects one value with --module"),
        (["--module", "a:b", "--profile", "tpu"], "--profile expects one of h100, h200 or a profile JSON"),
        # Flags the search does not read, and flags only the search reads (issue 39: never ignored).
        (["--module", "a:b", "--dim", "64", "--mixed-precision", "bf16"],
         "--dim 64, --mixed-precision bf16 apply only to the GPT presets (--model), not to --module/--hf-config"),
        (["--rows", "5", "--profile", "h100", "--micro-batch", "2", "4"],
         "--micro-batch 2 4, --rows 5, --profile h100 apply only to the search for your own model: add --module or "
         "--hf-config, or drop them"),
        (["--module", "a:b", "--world-size", "2", "--batch", "3"],
         "--batch 3 must be divisible by --world-size 2 (it is the global batch)"),
        (["--calibrate", "{tmp}/missing/c.json"], "--calibrate {tmp}/missing/c.json: the folder {tmp}/missing does not "
                                                  "exist"),
        (["--calibrate", "{tmp}/c.json", "--model", "gpt-7b"],
         "--model gpt-7b applies only to a plan, and --calibrate alone only measures"),
        (["--hf-config", "{tmp}"], "--hf-config {tmp}: the folder has no config.json"),
    ],
)
def test_cli_bad_flags(flags, line, capsys, tmp_path):
    assert main(["plan", *(flag.format(tmp=tmp_path) for flag in flags)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fullshard plan: " + line.format(tmp=tmp_path)), err
    assert not (tmp_path / "c.json").exists()  # nothing measured


def test_cli_a_module_that_fails_is_one_line(tmp_path, monkeypatch, capsys):
    """The user's module cannot be imported, or its factory fails in a way plan does not expect: one line
    naming --module and the cause (--debug: the traceback)."""
    (tmp_path / "broken_syntax.py").write_text("def build(:\n")
    (tmp_path / "lookup_fails.py").write_text("def build():\n    return {}['layers']\n\n\n"
                                              "def example_batch(n):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--module", "broken_syntax:build"]) == 2
    assert capsys.readouterr().err == (
        "fullshard plan: --module broken_syntax:build: importing broken_syntax raised SyntaxError: invalid syntax "
        "(broken_syntax.py, line 1)\n")
    assert main(["plan", "--module", "lookup_fails:build"]) == 2
    assert capsys.readouterr().err == "fullshard plan: --module lookup_fails:build: KeyError: 'layers'\n"
    with pytest.raises(KeyError):
        main(["plan", "--module", "lookup_fails:build", "--debug"])


def test_cli_module_that_does_not_import(capsys):
    assert main(["plan", "--module", "no_such_package.models:build"]) == 2
    assert "fullshard plan: --module no_such_package.models:build: cannot import" in capsys.readouterr().err


@pytest.mark.slow  # several traces and searches: >2 s
def test_cli_hf_config(tmp_path, capsys):
    llama().config.to_json_file(tmp_path / "config.json")
    code = main(["plan", "--hf-config", str(tmp_path), "--seq", "16", "--world-size", "4", "--batch", "8",
                 "--micro-batch", "2", "--memory-limit", "1", "--ranks-per-node", "2"])
    out = capsys.readouterr().out
    # a model this small steps fastest unsharded or sharded alike (near-ties): the first choice's
    # code is whichever front end its strategy takes, applied to the blocks and the root
    roots = [line for line in out.splitlines() if line.startswith(("fully_shard(model, mesh=mesh", "replicate(model, mesh=mesh"))]
    assert code == 0 and "first choice:" in out and len(roots) == 1, out


# -- against the engine -----------------------------------------------------------------------------
GLOO_CHOICES = {
    2: [
        Choice(2, "full", micro_batch=2),
        Choice(2, "grad-op", micro_batch=2, mixed_precision=torch.bfloat16),
        Choice(2, "no-shard", micro_batch=2),
        Choice(2, "full", micro_batch=2, checkpointing=True),
        Choice(2, "full", micro_batch=1, accumulation=2, cpu_offload=True),
    ],
    4: [
        Choice(4, "full", micro_batch=2),
        Choice(4, "hybrid", hybrid_shard_size=2, micro_batch=2, ranks_per_node=2),
        Choice(4, "full", reshard_to=2, micro_batch=2, ranks_per_node=2),
        Choice(4, "full", micro_batch=2, all_gather_dtype=torch.int8, mixed_precision=torch.bfloat16),
    ],
}
FAKE_CHOICES = {
    8: [Choice(8, "full", micro_batch=2), Choice(8, "hybrid", hybrid_shard_size=4, micro_batch=2)],
    64: [Choice(64, "full", micro_batch=2, mixed_precision=torch.bfloat16)],
}
TOLERANCE = 0.05


def predicted(name: str, choice: Choice):
    model_fn, batch_fn = MODELS[name]
    choice = Choice(**{**choice.__dict__, "device": "cpu"})
    trace = trace_step(
        model_fn, batch_fn, choice.micro_batch, choice.mixed_precision, choice.checkpointing, device="cpu"
    )
    return predict(trace, choice, StepClock(PROFILES["h100"], choice))


def runnable(name: str, choices: list[Choice]) -> list[Choice]:
    """The ConvNet's BatchNorm cannot compute in bf16 on the CPU (its fp32 running statistics with bf16
    inputs: torch's CPU kernel refuses them, sharded or not; the fake trace does not see it)."""
    if name != "convnet":
        return choices
    return [Choice(**{**c.__dict__, "mixed_precision": None}) for c in choices]


def measure_all(name: str, choices: list[Choice]) -> list[dict]:
    model_fn, batch_fn = MODELS[name]
    return [measure_choice(model_fn, batch_fn, choice) for choice in choices]


def check(name: str, choices: list[Choice], measured: list[list[dict]]) -> None:
    assert len(measured[0]) == len(choices)
    for index, choice in enumerate(choices):
        peak = max(rank[index]["peak"] for rank in measured)
        plan_ = predicted(name, choice)
        print(f"{name} {choice.label()} at {choice.world_size}: predicted {plan_.peak}, measured {peak} "
              f"({plan_.peak / peak - 1:+.2%})")
        assert plan_.peak == pytest.approx(peak, rel=TOLERANCE), choice.label()
        if not choice.all_gather_dtype:
            assert measured[0][index]["comm"] == plan_.comm, choice.label()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_predicted_peak_matches_gloo_ranks(name, world_size):
    choices = runnable(name, GLOO_CHOICES[world_size])
    measured = run_distributed(measure_all, world_size, name, choices, timeout=600)
    check(name, choices, measured)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [8, 64])
@pytest.mark.parametrize("name", list(MODELS))
def test_predicted_peak_matches_fake_group(name, world_size):
    choices = runnable(name, FAKE_CHOICES[world_size])
    with fake_world(world_size):
        measured = [measure_all(name, choices)]
    check(name, choices, measured)


@pytest.mark.slow  # several traces and searches: >2 s
def test_cli_frontier_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "frontier.png"
    code = main(["plan", "--module", "test_plan_any_model:convnet", "--batch-fn", "test_plan_any_model:images",
                 "--world-size", "2", "--batch", "4", "--micro-batch", "2", "--strategy", "full", "--plot", str(path)])
    assert code == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {path}" in capsys.readouterr().out


def run_fullshard(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(fullshard.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.dirname(__file__)])}
    return subprocess.run([sys.executable, "-m", "fullshard", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)


@pytest.mark.launch
def test_calibrate_saves_a_profile_plan_reads(tmp_path, capsys):
    """The command calibrates in a process of its own (its rank pool started from the command);
    the plan that reads the profile runs here, as the other plan tests do."""
    path = tmp_path / "cpu.json"
    result = run_fullshard("plan", "--calibrate", str(path))
    assert result.returncode == 0, result.stderr
    profile = load_profile(str(path))
    assert profile.device == "cpu" and profile.matmul_flops["float32"] > 0 and profile.intra_node_bandwidth > 0
    assert profile.op_overhead > 0 and profile.optimizer_overhead > 0 and profile.unit_overhead >= 0
    assert set(profile.collective_bandwidth) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert profile.measured and not profile.collectives_overlap
    code = main(["plan", "--module", "test_plan_any_model:convnet", "--batch-fn", "test_plan_any_model:images",
                 "--world-size", "2", "--batch", "4", "--profile", str(path), "--rows", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "profile calibrated (cpu, CPU): measured" in out, out


@pytest.mark.launch
def test_train_auto_prints_plan_and_measurement(tmp_path):
    """The first choice is trained; its measured peak is the predicted one (the table's ratio)."""
    result = run_fullshard("train", "--auto", "--nproc", "2", "--steps", "4", "--layers", "2", "--dim", "32",
                           "--seq", "16", "--batch", "4", "--memory-limit", "0.05", "--profile", "h100")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "first choice:" in out and "fullshard train --auto:" in out
    ratio = next(line for line in out.splitlines() if line.startswith("peak per rank")).split()[-1]
    assert abs(float(ratio) - 1) < 0.05, out
