"""The action sequences: each probe trains a little, acts, and records what a user could observe.

A probe reads the model only through public views (``named_parameters``, ``summon_full_params``,
state dicts, ``.grad``), so the record of torch's FSDP and of fullshard can be compared key by key.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .models import batch, build
from .record import Record
from .scenarios import SUMMON_FLAGS, Scenario


@dataclass
class Run:
    s: Scenario
    a: SimpleNamespace  # the framework's names (frontends.api)
    model: nn.Module
    optim: torch.optim.Optimizer
    rec: Record
    step_index: int = 0

    @property
    def wrapper(self) -> bool:
        return self.s.front == "wrapper"

    def loss(self, model_out: torch.Tensor | None = None) -> torch.Tensor:
        out = self.model(batch(self.step_index, dist.get_rank())) if model_out is None else model_out
        self.step_index += 1
        return out.float().pow(2).mean()

    def backward(self, key: str) -> None:
        loss = self.loss()
        self.rec.put(key, loss)
        loss.backward()

    def step(self, key: str, optims: tuple[torch.optim.Optimizer, ...] = ()) -> None:
        self.backward(key)
        for optim in optims or (self.optim,):
            optim.step()
            optim.zero_grad()

    def full_params(self, key: str = "param", grads: bool = False) -> None:
        """Every parameter's value (and gradient) under its original name: the wrapper's summoned full
        values, ``fully_shard``'s shards (see ``_full``)."""
        if self.wrapper:
            with self.a.FSDP.summon_full_params(self.model, with_grads=grads):
                for name, param in self.model.named_parameters():
                    self.rec.put(f"{key}:{name}", param)
                    if grads:
                        self.rec.put(f"{key}.grad:{name}", param.grad if param.grad is not None else "None")
        else:
            for name, param in self.model.named_parameters():
                self.rec.put(f"{key}:{name}", _full(param))
                if grads:
                    self.rec.put(f"{key}.grad:{name}", _full(param.grad) if param.grad is not None else "None")

    def put_after_forward(self, name: str, param: torch.Tensor) -> None:
        """A parameter read between forward and backward: a value where it has its full shape, else
        this rank's shard (a layout)."""
        clean = name.replace("_fsdp_wrapped_module.", "")
        full = dict(build(self.s.model).named_parameters()).get(clean)
        # A 1D shard can have the full 1D shape by chance (FSDP1's cut): only 2D values count as full.
        full_shape = full is not None and full.dim() > 1 and tuple(full.shape) == tuple(param.shape)
        self.rec.put(f"{'' if full_shape else 'local:'}after_forward:{clean}", param)

    def local_params(self) -> None:
        """What ``named_parameters`` shows outside forward: names, types, shapes; a flat parameter's values
        too (this rank's flat shard, FSDP1's element for element)."""
        for name, param in self.model.named_parameters():
            self.rec.put(f"local:{name}:type", type(param).__name__)
            self.rec.put(f"local:{name}:shape", tuple(param.shape))
            if name.endswith("_flat_param"):
                self.rec.put(f"flat:{name}", param)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A ``fully_shard`` parameter's value as this rank holds it: both frameworks place a parameter
    the same way (``local_params`` records the shapes), so equal shards on every rank are equal full
    values, read without a gather per parameter (about a millisecond each on gloo here). An ignored
    parameter is a plain tensor already."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


PROBES: dict[str, Callable[[Run], None]] = {}


def probe(*names: str) -> Callable:
    def register(fn: Callable[[Run], None]) -> Callable[[Run], None]:
        for name in names:
            PROBES[name] = fn
        return fn

    return register


@probe("train", "world_one")
def train(r: Run) -> None:
    for i in range(2):
        r.step(f"loss{i}")
    r.local_params()
    r.full_params()


@probe("grads_after_backward")
def grads_after_backward(r: Run) -> None:
    r.step("loss0")
    r.backward("loss1")
    if not r.wrapper or r.s.use_orig_params:
        r.full_params(grads=True)
    else:  # FSDP1 flat parameters: the flat gradient is this rank's public view, FSDP1's element for element
        for name, param in r.model.named_parameters():
            r.rec.put(f"flat.grad:{name}", param.grad if param.grad is not None else "None")


@probe("several_forwards")
def several_forwards(r: Run) -> None:
    loss = r.loss() + r.loss()
    r.rec.put("loss", loss)
    loss.backward()
    r.optim.step()
    r.full_params()


@probe("no_sync")
def no_sync(r: Run) -> None:
    if r.wrapper:
        with r.model.no_sync():
            r.backward("micro0")
    else:
        r.model.set_requires_gradient_sync(False)
        r.backward("micro0")
        r.model.set_requires_gradient_sync(True)
    r.backward("micro1")
    r.optim.step()
    r.full_params()


@probe("read_after_forward")
def read_after_forward(r: Run) -> None:
    loss = r.loss()
    for name, param in r.model.named_parameters():
        r.put_after_forward(name, param)
    loss.backward()
    r.optim.step()
    r.full_params()


def state_dict_of(r: Run, sd_type: str, config=None) -> dict:
    with r.a.FSDP.state_dict_type(r.model, getattr(r.a.StateDictType, sd_type), config):
        return r.model.state_dict()


def _load(r: Run, sd_type: str, sd: dict) -> None:
    with r.a.FSDP.state_dict_type(r.model, getattr(r.a.StateDictType, sd_type)):
        r.model.load_state_dict(sd)


@probe("sd_full", "sd_full_rank0_cpu", "sd_full_rank0", "sd_sharded", "sd_local")
def state_dict_round_trip(r: Run) -> None:
    r.step("loss0")
    sd_type = {"sd_full": "FULL_STATE_DICT", "sd_sharded": "SHARDED_STATE_DICT", "sd_local": "LOCAL_STATE_DICT"}
    config = None
    if r.s.probe.startswith("sd_full_rank0"):  # sd_full_rank0: the stand-in torch runs for the _cpu one
        config = r.a.FullStateDictConfig(offload_to_cpu=r.s.probe.endswith("_cpu"), rank0_only=True)
    kind = sd_type.get(r.s.probe, "FULL_STATE_DICT")
    sd = state_dict_of(r, kind, config)
    r.rec.put("keys", tuple(sorted(sd)))  # FSDP1's order puts a tied parameter's name where it was first seen
    for key, value in sd.items():
        (r.rec.put_flat if key.endswith("_flat_param") else r.rec.put)(f"sd:{key}", value)
    if config is not None:
        return
    saved = copy.deepcopy(sd)  # values may alias the shards (torch's local ShardedTensors do)
    r.step("loss1")
    _load(r, kind, saved)
    r.full_params("reloaded")
    r.step("loss2")


@probe("load_after_forward")
def load_after_forward(r: Run) -> None:
    r.step("loss0")
    sd = state_dict_of(r, "SHARDED_STATE_DICT") if r.wrapper else r.model.state_dict()
    r.loss()  # a forward with no backward: parameters may be unsharded now
    if r.wrapper:
        _load(r, "SHARDED_STATE_DICT", sd)
    else:
        r.model.load_state_dict(sd)
    r.full_params()


def _osd(r: Run, sd_type: str) -> dict:
    with r.a.FSDP.state_dict_type(r.model, getattr(r.a.StateDictType, sd_type)):
        return r.a.FSDP.optim_state_dict(r.model, r.optim)


@probe("osd_full", "osd_sharded", "osd_partly_wrapped")
def optim_state_dict(r: Run) -> None:
    r.step("loss0")
    kind = "SHARDED_STATE_DICT" if r.s.probe == "osd_sharded" else "FULL_STATE_DICT"
    osd = _osd(r, kind)
    model_keys = set(state_dict_of(r, kind))
    r.rec.put("state_keys", tuple(sorted(osd["state"])))
    r.rec.put("state_keys_in_model_sd", all(k in model_keys for k in osd["state"]))
    r.rec.put("group_params", tuple(tuple(g["params"]) for g in osd["param_groups"]))
    for fqn, state in sorted(osd["state"].items()):
        for name, value in sorted(state.items()):
            r.rec.put(f"osd:{fqn}:{name}", value)
    with r.a.FSDP.state_dict_type(r.model, getattr(r.a.StateDictType, kind)):
        to_load = r.a.FSDP.optim_state_dict_to_load(r.model, r.optim, osd)
    r.rec.put("local:to_load_keys", tuple(sorted(to_load["state"])))
    r.optim.load_state_dict(to_load)
    r.step("loss1")
    r.full_params()


@probe("osd_full_legacy", "osd_rekey")
def full_optim_state_dict(r: Run) -> None:
    r.step("loss0")
    osd = r.a.FSDP.full_optim_state_dict(r.model, r.optim)
    if r.s.probe == "osd_rekey" and dist.get_rank() == 0:
        osd = r.a.FSDP.rekey_optim_state_dict(osd, r.a.OptimStateKeyType.PARAM_ID, r.model)
    r.rec.put("state_keys", tuple(sorted(osd.get("state", {}), key=str)))
    for key, state in sorted(osd.get("state", {}).items(), key=lambda kv: str(kv[0])):
        for name, value in sorted(state.items()):
            r.rec.put(f"osd:{key}:{name}", value)


@probe("osd_optim_input", "osd_optim_input_default")
def osd_optim_input(r: Run) -> None:
    """``osd_optim_input_default``: without ``optim_input`` (the stand-in torch runs where it fails)."""
    r.step("loss0")
    optim_input = list(r.model.parameters()) if r.s.probe == "osd_optim_input" else None
    osd = r.a.FSDP.full_optim_state_dict(r.model, r.optim, optim_input=optim_input)
    r.rec.put("state_keys", tuple(sorted(osd.get("state", {}))))


@probe("osd_no_param_groups")
def osd_no_param_groups(r: Run) -> None:
    r.step("loss0")
    osd = _osd(r, "FULL_STATE_DICT")
    with r.a.FSDP.state_dict_type(r.model, r.a.StateDictType.FULL_STATE_DICT):
        r.a.FSDP.optim_state_dict_to_load(r.model, r.optim, {"state": osd["state"]})


@probe("osd_unmanaged_param")
def osd_unmanaged_param(r: Run) -> None:
    extra = nn.Parameter(torch.ones(3))
    optim = torch.optim.Adam([*r.model.parameters(), extra], lr=0.01)
    r.backward("loss0")
    extra.grad = torch.ones(3)
    optim.step()
    osd = full_osd_of(r, optim)
    r.rec.put("state_keys", tuple(sorted(osd["state"], key=str)))


def full_osd_of(r: Run, optim: torch.optim.Optimizer) -> dict:
    with r.a.FSDP.state_dict_type(r.model, r.a.StateDictType.FULL_STATE_DICT):
        return r.a.FSDP.optim_state_dict(r.model, optim)


@probe("clip_root", "clip_nonroot")
def clip(r: Run) -> None:
    r.step("loss0")
    r.backward("loss1")
    unit = r.model if r.s.probe == "clip_root" else r.model.module.block1
    r.rec.put("norm", unit.clip_grad_norm_(0.05))
    r.optim.step()
    r.full_params()


@probe("clip_composable")
def clip_composable(r: Run) -> None:
    r.backward("loss0")
    r.rec.put("norm", torch.nn.utils.clip_grad_norm_(r.model.parameters(), 0.05).full_tensor())
    r.optim.step()
    r.full_params()


@probe("sd_composable")
def sd_composable(r: Run) -> None:
    r.step("loss0")
    sd = r.model.state_dict()
    r.rec.put("keys", tuple(sd))
    for key, value in sd.items():
        r.rec.put(f"sd:{key}", value)
    r.model.load_state_dict({k: v.detach().clone() * 0.5 for k, v in sd.items()})
    r.full_params()


@probe("shared_across_units", "ignored_params")
def shared_across_units(r: Run) -> None:
    r.step("loss0")
    r.full_params()


def _original(r: Run) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in r.model.named_parameters() if p.requires_grad]


@probe("inplace_change", "data_assign", "replace_param", "shape_change", "grad_data_assign")
def change_parameters(r: Run) -> None:
    r.step("loss0")
    name, param = _original(r)[0]
    with torch.no_grad():
        if r.s.probe == "inplace_change":
            param.mul_(0.5)
        elif r.s.probe == "data_assign":
            param.data = param.data * 0.5
        elif r.s.probe == "shape_change":  # every parameter: each rank holds part of some (FSDP1 raises there)
            for _, each in _original(r):
                each.data = torch.zeros(each.numel() + 1, dtype=each.dtype)
    if r.s.probe == "replace_param":
        owner = r.model.get_submodule(name.rpartition(".")[0])
        setattr(owner, name.rpartition(".")[2], nn.Parameter(param.detach() * 0.5))
    r.backward("loss1")
    if r.s.probe == "grad_data_assign":
        for _, p in _original(r):
            if p.grad is not None:
                p.grad.data = p.grad.data * 3
    r.optim.step()
    r.full_params()


@probe("change_between_forward_backward")
def change_between_forward_backward(r: Run) -> None:
    loss = r.loss()
    with torch.no_grad():
        for _, param in r.model.named_parameters():
            param.data = param.data * 0.5
    loss.backward()
    r.full_params()


@probe("two_optimizers")
def two_optimizers(r: Run) -> None:
    params = [p for p in r.model.parameters() if p.requires_grad]
    optims = (
        torch.optim.SGD(params[: len(params) // 2], lr=0.1),
        torch.optim.Adam(params[len(params) // 2 :], lr=0.01),
    )
    r.step("loss0", optims)
    loss = r.loss()
    for name, param in r.model.named_parameters():
        r.put_after_forward(name, param)
    loss.backward()
    for optim in optims:
        optim.step()
    r.full_params()


def _fill(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        with torch.no_grad():
            module.weight.fill_(0.1)


@probe("apply")
def apply(r: Run) -> None:
    r.model.apply(_fill)
    r.full_params()
    r.step("loss0")


@probe("apply_in_summon")
def apply_in_summon(r: Run) -> None:
    with r.a.FSDP.summon_full_params(r.model):
        r.model.apply(_fill)
    r.full_params()


@probe("summon_in_forward")
def summon_in_forward(r: Run) -> None:
    def hook(*_):
        with r.a.FSDP.summon_full_params(r.model):
            pass

    r.model.module.block1.register_forward_pre_hook(hook)
    r.loss()


@probe("summon_in_backward")
def summon_in_backward(r: Run) -> None:
    loss = r.loss()

    def hook(grad):
        with r.a.FSDP.summon_full_params(r.model):
            pass
        return grad

    loss.register_hook(hook)
    loss.backward()


@probe("wrong_sd_config")
def wrong_sd_config(r: Run) -> None:
    r.a.FSDP.set_state_dict_type(r.model, r.a.StateDictType.SHARDED_STATE_DICT, r.a.FullStateDictConfig())


@probe("eval_full_precision")
def eval_full_precision(r: Run) -> None:
    r.step("loss0")
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        r.model.eval()
        with torch.no_grad():
            out = r.model(batch(7, dist.get_rank()))
        r.rec.put("eval_out", out)
        r.rec.put("eval_out:dtype", str(out.dtype))
    finally:
        del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]


@probe("autocast_loss")
def autocast_loss(r: Run) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = r.model(batch(0, dist.get_rank()))
        loss = out.pow(2).mean()
    r.rec.put("out:dtype", str(out.dtype))
    r.rec.put("loss", loss)
    loss.backward()
    r.optim.step()
    r.full_params()


def summon(r: Run) -> None:
    flags = {f: f in r.s.probe.partition(":")[2].split(",") for f in SUMMON_FLAGS}
    r.step("loss0")
    r.backward("loss1")
    # With rank0_only, the ranks other than the process group's first (the shard group's under the hybrid
    # strategies) keep their shards: a layout, not values.
    keeps = not flags["rank0_only"] or r.model.rank == 0
    where = "" if keeps else "local:"
    with r.a.FSDP.summon_full_params(r.model, **flags):
        for name, param in r.model.named_parameters():
            r.rec.put(f"{where}summoned:{name}", param)
            if flags["with_grads"]:
                r.rec.put(f"{where}summoned.grad:{name}", param.grad if param.grad is not None else "None")
            if keeps:  # elsewhere: this rank's shard
                with torch.no_grad():
                    param.add_(1.0)
    r.full_params()


def run_probe(r: Run) -> None:
    """Runs ``r``'s probe (those of ``probes_variants`` too, registered when runner imports it)."""
    fn = summon if r.s.probe.startswith("summon:") else PROBES[r.s.probe]
    fn(r)
