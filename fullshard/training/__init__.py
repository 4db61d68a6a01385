"""``fullshard train``: the ranks' side of the command (the launcher is ``fullshard/cli/train.py``).

- ``config.py``   the flags and ``TrainConfig``, validated once by the launcher
- ``corpus.py``   the embedded public-domain text, batches that depend only on (seed, step)
- ``model.py``    the GPT preset built on meta, sharded, initialised shard by shard
- ``loop.py``     one rank's run: steps, progress, checkpoints, the summary
- ``resume.py``   what a checkpoint holds besides the model; when a run may resume
- ``stop.py``     Ctrl-C: every rank stops after the same step
- ``metrics.py``  peak memory, bytes communicated, JSON lines
- ``summary.py``  the closing table
- ``__main__.py`` the entry point torchrun starts on every rank
"""

from .config import TrainConfig
from .loop import train

__all__ = ["TrainConfig", "train"]
