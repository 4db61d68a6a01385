"""A scenario's observable behaviour as a flat, ordered ``key -> value`` record, and the comparison of two.

Values are plain data: a tensor (compared with a tolerance), or a str / int / tuple (compared exactly). The
kind of a difference says how bad it is: ``value`` (numbers differ: never acceptable), ``type`` (value type,
shape or dtype), ``keys`` (a key only one side has), ``exception`` (one side raised, or another type),
``message`` (an API name of torch's message missing from ours), ``warning``, ``layout`` (what this rank's
shard holds: keys starting ``local:``), ``count`` (how many collectives of a kind: keys starting ``count:``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fullshard.testing import full_value

try:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
except ImportError:  # pragma: no cover - every supported torch has it
    ShardedTensor = ()  # type: ignore[assignment,misc]


def type_name(value: Any) -> str:
    if isinstance(value, DTensor):
        return f"DTensor{tuple(str(p) for p in value.placements)}"
    if isinstance(value, ShardedTensor):
        return "ShardedTensor"
    if isinstance(value, torch.nn.Parameter):
        return "Parameter"
    return type(value).__name__


def plain(value: Any) -> Any:
    """A comparable, picklable form of ``value`` (DTensors and ShardedTensors: this rank's local part)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    elif isinstance(value, ShardedTensor):
        shards = value.local_shards()
        value = torch.cat([s.tensor.flatten() for s in shards]) if shards else torch.empty(0)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


@dataclass
class Record:
    items: dict[str, Any] = field(default_factory=dict)

    def put(self, key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor) or isinstance(value, ShardedTensor):
            self.items[key + ":type"] = type_name(value)
            self.items[key + ":shape"] = (
                tuple(value.shape) if not isinstance(value, ShardedTensor) else tuple(value.size())
            )
        self.items[key] = plain(value)

    def put_flat(self, key: str, value: Any) -> None:
        """A flat parameter's value: type, global shape, this rank's elements (FSDP1's layout) and (a
        ShardedTensor, assembled: a collective) its global value."""
        self.put(key, value)
        if isinstance(value, ShardedTensor):
            self.items[key + ":global"] = plain(full_value(value))


_API_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def api_words(message: str) -> set[str]:
    """The API names in a message (snake_case with an underscore, or CamelCase): its key words. A tensor's
    repr in it (a message that is only the offending value) names nothing."""
    message = re.sub(r"tensor\(.*?\)", "", message, flags=re.S)
    words = {w.rpartition(".")[2] for w in _API_WORD.findall(message)}  # a class path: its name
    return {w for w in words if "_" in w.strip("_") or re.search(r"[a-z][A-Z]", w)}


@dataclass(frozen=True)
class Difference:
    kind: str
    key: str
    detail: str


def compare(theirs: Record, ours: Record, rtol: float, atol: float) -> list[Difference]:
    out: list[Difference] = []
    for key in theirs.items.keys() | ours.items.keys():
        if key.startswith("~"):
            continue
        if key not in ours.items or key not in theirs.items:
            side = "torch" if key in theirs.items else "fullshard"
            kind = "exception" if key in ("raised", "message") else "layout" if key.startswith("local:") else "keys"
            kind = "count" if key.startswith("count:") else kind
            out.append(Difference(kind, key, f"only {side} has it: {(theirs.items | ours.items)[key]!r}"[:300]))
            continue
        a, b = theirs.items[key], ours.items[key]
        if key.startswith("local:"):  # how this rank's shard is laid out, not a value
            if not _same(a, b, rtol, atol):
                out.append(Difference("layout", key, f"torch {_brief(a)} / ours {_brief(b)}"))
        elif key == "message":
            missing = api_words(a) - {w.rpartition(".")[2] for w in _API_WORD.findall(b)}
            if missing:
                out.append(Difference("message", key, f"ours lacks {sorted(missing)}: torch {a!r} / ours {b!r}"[:1200]))
        elif key == "raised":
            if a != b:
                out.append(Difference("exception", key, f"torch {a} / ours {b}"))
        elif key == "warnings":
            if a != b:
                texts = theirs.items.get("~warning_text"), ours.items.get("~warning_text")
                out.append(Difference("warning", key, f"torch {a} {texts[0]} / ours {b} {texts[1]}"[:400]))
        elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                out.append(Difference("type", key, f"torch {a.dtype}{tuple(a.shape)} / ours {b.dtype}{tuple(b.shape)}"))
            elif not torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True):
                err = (a.double() - b.double()).abs().max().item()
                out.append(Difference("value", key, f"max abs difference {err:.3g}"))
        elif a != b:
            out.append(Difference(_kind_of(key), key, f"torch {a!r} / ours {b!r}"[:300]))
    return sorted(out, key=lambda d: d.key)


def _kind_of(key: str) -> str:
    """The kind of a difference in a plain (not tensor) entry."""
    if key.endswith((":type", ":shape", ":dtype")):
        return "type"
    if key.startswith("count:"):
        return "count"
    if key in ("keys", "units", "group_params") or key.startswith("state_keys"):  # lists of names
        return "keys"
    return "value"


def _same(a: Any, b: Any, rtol: float, atol: float) -> bool:
    """Whether two local views hold the same elements (up to the scenario's tolerance: both sides
    compute them, e.g. a flat shard after optimizer steps)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True))
        )
    return type(a) is type(b) and a == b


def _brief(value: Any) -> str:
    return f"{value.dtype}{tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:120]
