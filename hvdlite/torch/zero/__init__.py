"""``ZeroRedundancyOptimizer``: the optimizer's state sharded across the ranks
(optimizer.py), its flat layout (layout.py), its chunks on lanes (lanes.py, reduced in
backward: overlap.py) or negotiated (rounds.py), its whole state gathered and loaded
(state.py), and its ``clip_grad_norm_`` (clip.py) and ``GradScaler`` support (amp.py)."""
from hvdlite.torch.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
