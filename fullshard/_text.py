"""Text output shared by the ``fullshard`` commands and ``fullshard train``'s summary: sizes, model
descriptions, aligned tables (a module of its own so that ``training/`` need not import ``cli/``)."""

from __future__ import annotations

from .models import ModelArgs

__all__ = ["align", "describe_model", "human_bytes"]


def human_bytes(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            break
    return f"{nbytes:.2f} {unit}"


def describe_model(model: ModelArgs) -> str:
    count = model.num_params
    count_text = f"{count / 1e9:.3g}B" if count >= 1e9 else f"{count / 1e6:.3g}M"
    return (
        f"{count_text} parameters ({model.n_layers} blocks, dim {model.dim}, {model.n_heads} heads, "
        f"vocab {model.vocab_size}, seq {model.max_seq_len})"
    )


def align(rows: list[list[str]]) -> str:
    """Rows of cells as lines: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    )
