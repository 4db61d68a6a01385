"""One rank of ``fullshard train``: build, resume, train with progress, checkpoint, summarise.

Runs inside a process group that the caller set up (``fullshard.training.__main__``
under torchrun). Every rank runs the same steps; rank 0 alone prints and writes
the metrics file. Once per step one small all-reduce gathers the loss, the
Ctrl-C flags and each rank's peak memory, so that all ranks agree on what to
report and on when to stop.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from .._core import comm
from .._core.mesh import devices_per_node
from ..clip import clip_grad_norm_
from ..fully_shard import FSDPModule
from ..grad_scaler import ShardedGradScaler
from ..models import next_token_loss
from ..wrapper import FullyShardedDataParallel
from .config import TrainConfig
from .corpus import Corpus
from .metrics import CommTally, MetricsFile, PeakMemory, model_state_bytes
from .model import build_sharded_model
from .resume import resume, save
from .stop import StopRequest
from .summary import CLIP_LABEL, RunResult, print_summary

__all__ = ["learning_rate", "make_optimizer", "train"]

_MIN_LR_FRACTION = 0.1
_VALIDATION_BATCHES = 4


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warm-up to ``config.lr``, then cosine decay to a tenth of it at the last step.

    A function of the step alone, so a resumed run needs no scheduler state.
    """
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (_MIN_LR_FRACTION + (1 - _MIN_LR_FRACTION) * cosine)


@dataclass
class _StepStats:
    loss: float
    stop: bool
    peaks: list[int]
    model_states: list[int]


def _agree(loss: torch.Tensor, stop: bool, peak: int, model_states: int) -> _StepStats:
    """One all-reduce: the mean loss, whether any rank was interrupted, every rank's peak
    memory and model-state bytes."""
    world, rank = dist.get_world_size(), dist.get_rank()
    stats = torch.zeros(2 + 2 * world, dtype=torch.float64)
    stats[0], stats[1] = loss.item(), float(stop)
    stats[2 + rank], stats[2 + world + rank] = float(peak), float(model_states)
    stats = stats.to(comm.device_for(None, stats.device))  # NCCL takes no CPU tensors
    dist.all_reduce(stats)
    stats = stats.cpu()
    values = [int(v) for v in stats[2:].tolist()]
    return _StepStats(stats[0].item() / world, stats[1].item() > 0, values[:world], values[world:])


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with GPT-style betas and weight decay (the learning rate is set every step)."""
    return torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1)


def _clip(model: torch.nn.Module, max_norm: float) -> None:
    """The gradient norm over all ranks' shards: the wrapper's flat shards need its own method."""
    if isinstance(model, FullyShardedDataParallel):
        model.clip_grad_norm_(max_norm)
    else:
        clip_grad_norm_(model.parameters(), max_norm)


def _train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: ShardedGradScaler | None,
    config: TrainConfig,
    lr: float,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    tally: CommTally,
) -> torch.Tensor:
    """Forward, backward, clip, step; returns the detached loss of this rank's slice. The clip's
    collectives count apart in ``tally`` (fullshard plan predicts the sharding's alone)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = next_token_loss(model(inputs), targets)
    scaled = scaler.scale(loss) if scaler else loss
    if not isinstance(scaled, torch.Tensor):  # a tensor in, a tensor out
        raise AssertionError(f"rank {dist.get_rank()}: the scaler returned {type(scaled).__name__} for a tensor")
    scaled.backward()
    if scaler:
        scaler.unscale_(optimizer)
    if config.clip:
        with tally.labelled(CLIP_LABEL):
            _clip(model, config.clip)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@torch.no_grad()
def _validation_loss(model: torch.nn.Module, corpus: Corpus, config: TrainConfig, device: torch.device) -> float:
    """The mean loss on fixed validation batches (each rank its slice; averaged over ranks)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = config.batch // world
    total = torch.zeros((), dtype=torch.float64, device=comm.device_for(None, torch.device("cpu")))
    for index in range(_VALIDATION_BATCHES):
        inputs, targets = corpus.batch(
            index, config.seed, config.batch, config.model_args().max_seq_len, validation=True
        )
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = next_token_loss(model(inputs[mine].to(device)), targets[mine].to(device))
        total += loss.double().to(total.device)
    dist.all_reduce(total)
    return total.item() / (world * _VALIDATION_BATCHES)


@torch.no_grad()
def _sample(model: torch.nn.Module, corpus: Corpus, config: TrainConfig, device: torch.device) -> str:
    """``config.sample`` bytes the model writes after a fixed prompt. All ranks run the same
    forward passes (they are collectives) and draw the same tokens from one seed."""
    prompt = b"Alice "
    tokens = list(prompt)
    generator = torch.Generator().manual_seed(config.seed)
    seq_len = config.model_args().max_seq_len
    for _ in range(config.sample):
        context = torch.tensor([tokens[-seq_len:]], device=device)
        logits = model(context)[0, -1].float().cpu() / 0.8
        top = torch.topk(logits, 10)
        choice = torch.multinomial(torch.softmax(top.values, dim=0), 1, generator=generator)
        tokens.append(int(top.indices[choice]))
    return corpus.decode(tokens)


def train(config: TrainConfig) -> RunResult:
    """Trains ``config`` on this rank; rank 0 shows progress and prints the summary."""
    world, rank = dist.get_world_size(), dist.get_rank()
    config.validate_world(world, devices_per_node())
    device = comm.bind_local_device(int(os.environ.get("LOCAL_RANK", 0)))
    memory = PeakMemory(device)
    corpus = Corpus()
    model = build_sharded_model(config, device)
    optimizer = make_optimizer(model, config)
    scaler = ShardedGradScaler(device=device.type) if config.mixed_precision == "fp16" else None
    start = resume(config, model, optimizer, scaler)
    metrics = MetricsFile(config.metrics if rank == 0 else None, resumed_at=start)
    per_rank = config.batch // world
    seq_len = config.model_args().max_seq_len
    tally = CommTally()
    result = RunResult(
        config=config,
        world_size=world,
        start_step=start,
        steps_done=start,
        device=device.type,
        shard_size=config.shard_group_size(world, devices_per_node()),
    )
    stop = StopRequest()
    # Redrawn in place on a terminal; in a log file, one line every half minute.
    progress = tqdm(
        total=config.steps,
        initial=start,
        desc="fullshard train",
        unit="step",
        disable=rank != 0,
        dynamic_ncols=True,
        mininterval=0.2 if sys.stderr.isatty() else 30,
    )
    probe_step = start + 1 if config.steps > start + 1 else start  # the first step pays for warm-up
    states = 0
    try:
        with tally.listening():
            for step in range(start, config.steps):
                began = time.perf_counter()
                lr = learning_rate(config, step)
                inputs, targets = corpus.batch(step, config.seed, config.batch, seq_len)
                mine = slice(rank * per_rank, (rank + 1) * per_rank)
                probe = memory.probe(states) if step == probe_step else contextlib.nullcontext()
                with probe:
                    loss = _train_step(
                        model, optimizer, scaler, config, lr, inputs[mine].to(device), targets[mine].to(device), tally
                    )
                if step == start:  # AdamW's states exist from the first step on
                    held = model_state_bytes(model, optimizer)
                    states = held["params"] + held["optimizer"]  # between steps; gradients are freed
                result.comm = tally.reset()
                # With gradients (sharded like their parameters) for the table:
                stats = _agree(loss, stop.requested, memory.peak() or 0, states + held["params"])
                seconds = time.perf_counter() - began
                result.record_step(stats.loss, seconds, stats.peaks, stats.model_states)
                metrics.write(
                    {
                        "step": step + 1,
                        "loss": stats.loss,
                        "lr": lr,
                        "step_time_s": seconds,
                        "tokens_per_s": config.batch * seq_len / seconds,
                        "peak_memory": stats.peaks,
                        "comm_bytes": sum(result.comm.values()),
                    }
                )
                progress.set_postfix_str(result.progress_text(), refresh=False)
                progress.update()
                finished = step + 1 == config.steps
                if config.checkpoint_dir and (stats.stop or finished or (step + 1) % config.checkpoint_every == 0):
                    with stop.deferring_termination():  # a second signal waits for the save
                        save(config, model, optimizer, scaler, step + 1)
                    result.checkpoint_step = step + 1
                if stats.stop:
                    result.interrupted = True
                    break
    finally:
        progress.close()
        stop.restore()
    if not result.interrupted:
        result.validation_loss = _validation_loss(model, corpus, config, device)
        if config.sample:
            result.sample = _sample(model, corpus, config, device)
        if isinstance(model, FSDPModule):  # it is: build_sharded_model applied fully_shard
            model.reshard()  # the root keeps its parameters after a forward without backward
    if rank == 0:
        print_summary(result)
    metrics.write({"summary": result.as_json()})
    metrics.close()
    return result
