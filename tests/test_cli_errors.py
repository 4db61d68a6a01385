"""Bad input gets the truth (issue 39): library errors that name the real cause, and the
command line's argument errors, all at once, without a traceback.

``fullshard train`` and ``fullshard plan`` themselves are covered in ``tests/test_train.py``
and ``tests/test_plan.py``; this file holds what both share and the library's messages.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fullshard import fully_shard
from fullshard.testing import distributed

ROOT = Path(__file__).resolve().parents[1]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _two_blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block())


@distributed(world_size=1)
def test_torch_fsdp_below_names_torch_fsdp():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference, in a test only

    model = _two_blocks()
    for block in model:
        torch_fully_shard(block)
    with pytest.raises(
        ValueError,
        match=r"^fully_shard expects modules that torch's FSDP has not been applied to, but _Block \(0\) is "
        r"already sharded by torch's FSDP \(torch\.distributed\.fsdp\.[\w.]+\): use fullshard's fully_shard on "
        r"every module \(import it from fullshard, not from torch\), or torch's on every one$",
    ):
        fully_shard(model)


@distributed(world_size=1)
def test_optimizer_built_before_sharding_warns_at_its_first_step():
    model = _two_blocks()
    early = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the parameters sharding replaces
    for block in model:
        fully_shard(block)
    fully_shard(model)
    late = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        late.step()
        early.step()
        early.step()  # once per optimizer
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert re.match(
        r"^SGD holds 4 parameter\(s\) that fully_shard replaced \(e\.g\. [\w.]+\) and none of the sharded "
        r"model's: it steps nothing for them\. Build the optimizer after sharding",
        messages[0],
    ), messages[0]


def test_api_docs_do_not_refuse_dp_mesh_dims():
    text = (ROOT / "docs" / "api.md").read_text()
    assert "`dp_mesh_dims` is not accepted" not in text


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["train", "--stepz", "5"], "unrecognized arguments: --stepz (did you mean --steps?) 5"),
        (["plan", "--world-sise", "8"], "unrecognized arguments: --world-sise (did you mean --world-size?) 8"),
    ],
)
def test_an_unknown_flag_gets_the_subcommands_usage(argv, hint, capsys):
    from fullshard.cli.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: fullshard {argv[0]} [-h]"), err
    assert err.rstrip().endswith(f"fullshard {argv[0]}: error: {hint}"), err


@pytest.mark.parametrize(
    "argv, lines",
    [
        (["train", "--steps", "abc", "--strategy", "zero", "--lr", "-1", "--nproc", "x"], [
            "fullshard train: error: argument --steps: invalid int value: 'abc'",
            "fullshard train: error: argument --strategy: invalid choice: 'zero' (choose from 'full', 'grad-op', "
            "'no-shard', 'hybrid')",
            "fullshard train: error: argument --nproc/--nproc-per-node: invalid int value: 'x'",
            "fullshard train: --lr expects a positive number but got -1",
        ]),
        (["plan", "--world-size=0", "--batch", "q", "--batch-per-rank", "2", "--dim", "30", "--heads", "4"], [
            "fullshard plan: error: argument --world-size: expects 1 <= A <= B but got '0'",
            "fullshard plan: error: argument --batch: invalid int value: 'q'",
            "fullshard plan: --dim 30 must be divisible by --heads 4",
        ]),
        (["plan", "--batch", "2", "--batch-per-rank", "2", "--stepz"], [
            "fullshard plan: error: argument --batch-per-rank: not allowed with argument --batch",
            "fullshard plan: error: unrecognized arguments: --stepz (did you mean --seq?)",
        ]),
    ],
    ids=["train", "plan", "exclusive-and-unknown"],
)
def test_values_argparse_cannot_read_are_reported_with_every_other_problem(argv, lines, capsys, monkeypatch):
    monkeypatch.setattr("fullshard.cli.train.torchrun", lambda *_: pytest.fail("ranks were started"))
    from fullshard.cli.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: fullshard {argv[0]} [-h]"), err
    assert [line for line in err.splitlines() if line.startswith("fullshard ")] == lines


@distributed(world_size=1)
def test_torch_fsdp_below_the_wrapper_names_torch_fsdp():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fullshard import FullyShardedDataParallel

    model = _two_blocks()
    torch_fully_shard(model[1])
    with pytest.raises(ValueError, match=r"^FullyShardedDataParallel expects modules that torch's FSDP has not been "
                                         r"applied to, but _Block \(1\) is already sharded by torch's FSDP"):
        FullyShardedDataParallel(model)


def test_ctrl_c_outside_the_ranks_is_one_line(capsys, monkeypatch):
    from fullshard.cli import plan
    from fullshard.cli.__main__ import main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan, "run", interrupted)
    assert main(["plan"]) == 130
    assert capsys.readouterr().err == "\nfullshard plan: interrupted\n"


@pytest.mark.launch
def test_train_into_a_closed_pipe_succeeds_quietly(tmp_path):
    """``fullshard train ... | true``: the summary has no reader; the run still succeeds, without a
    traceback, and the metrics file still gets its summary line."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": ""}
    # One rank: rank 0 and the launcher are the ones that print (a second rank costs an import of torch).
    command = [sys.executable, "-m", "fullshard", "train", "--nproc", "1", "--steps", "2", "--layers", "1",
               "--dim", "32", "--seq", "16", "--batch", "4", "--metrics", str(tmp_path / "m.jsonl")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    process.stdout.close()  # as `| true` does
    err = process.stderr.read().decode()
    assert process.wait(180) == 0 and "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]
    last = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert "summary" in last


@pytest.mark.parametrize(
    "orig_argv, argv0, role",
    [
        (["python", "-m", "fullshard", "train"], "-m", "launcher"),
        (["/venv/bin/python", "/venv/bin/fullshard", "plan"], "/venv/bin/fullshard", "launcher"),
        (["python", "-u", "-m", "fullshard.training", "{}"], "-m", "rank"),  # what torchrun starts
        (["python", "train.py"], "train.py", None),  # a program that imports fullshard
        (["python", "-m", "pytest", "tests"], "-m", None),
        (["python", "-c", "import fullshard"], "-c", None),
    ],
)
def test_only_the_command_quiets_ctrl_c_while_it_starts(orig_argv, argv0, role, monkeypatch):
    from fullshard.cli import startup

    monkeypatch.setattr(sys, "orig_argv", orig_argv, raising=False)
    monkeypatch.setattr(sys, "argv", [argv0])
    assert startup._role() == role


def _sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.launch
def test_ctrl_c_while_the_command_starts_is_one_line():
    """SIGINT while torch is being imported (seconds, as the user may press Ctrl-C at once): the launcher
    says one line, a rank nothing (the launcher tells); both exit with 130, no traceback. Each process is
    signalled once its own handler is in place (``-X importtime`` reports fullshard.cli.startup), so
    during the import of torch."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    commands = {
        "launcher": [sys.executable, "-X", "importtime", "-m", "fullshard", "train", "--steps", "1"],
        "rank": [sys.executable, "-X", "importtime", "-m", "fullshard.training", "{}"],
    }
    processes = {
        # SIGINT as a terminal's foreground job has it: a suite run as a background job (`make test &`,
        # nohup) hands its children an ignored SIGINT, which the command rightly leaves alone
        role: subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True,
                               preexec_fn=_sigint_as_in_a_terminal)
        for role, command in commands.items()
    }
    said = {}
    for role, process in processes.items():
        lines = []
        for line in process.stderr:
            lines.append(line)
            if line.rstrip().endswith("fullshard.cli.startup"):
                process.send_signal(signal.SIGINT)
                break
        lines += process.stderr.readlines()
        assert process.wait(120) == 130, "".join(lines)
        said[role] = [line for line in lines if not line.startswith("import time:")]
    assert said == {"launcher": ["\n", "fullshard: interrupted while starting\n"], "rank": []}


def test_torchruns_log_lines_are_quiet_unless_debug():
    """torchrun's modules set their loggers' levels themselves: each is raised while the ranks run (the
    failure or Ctrl-C is said once, by fullshard train), and put back after."""
    import logging

    from fullshard.cli.train import _quiet_launcher

    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    agent.setLevel(logging.WARNING)
    with _quiet_launcher(True):
        assert not agent.isEnabledFor(logging.WARNING)
    assert agent.isEnabledFor(logging.WARNING)
    with _quiet_launcher(False):  # --debug
        assert agent.isEnabledFor(logging.WARNING)
