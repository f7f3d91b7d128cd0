"""DiLoCo (arXiv 2311.08105): data-parallel replicas that train on their own and meet every ``H`` steps.

With ``--dp-sync-every H`` (H > 1) the replicas of a stage do not average their gradients at every step.
Each runs its own optimizer (the *inner* one, ``--optimizer``) on its own batches; after every ``H``-th
step (and after the last) they average their *pseudo-gradients*, the anchor (the parameters all replicas
had at the last meeting) minus where each replica went, with the same compressed all-reduce as the
per-step gradients (``--dp-codec``, :func:`~qwire.comm.ddp_hooks.allreduce_gradients`), and an *outer*
SGD with Nesterov momentum (``--outer-lr``, ``--outer-momentum``: qwire's default 0.5 and 0.5, the paper's
0.7 and 0.9) moves the anchor by that average. Every replica
then continues from the new anchor, with its own inner optimizer state.
The data-parallel traffic is one all-reduce of the parameters every ``H`` steps instead of one of the
gradients every step: ``H`` times less.

Each replica keeps the anchor and the outer momentum, up to two more copies of its stage's parameters, in host
memory (pinned when the stage is on a GPU), where the outer step runs: a meeting copies the parameters to the
host and back once.
"""

from __future__ import annotations

from typing import Any

import torch

from qwire.codecs import Codec
from qwire.comm.ddp_hooks import QuanGradState, allreduce_gradients


class OuterSync:
    """The outer loop of DiLoCo over one stage's data-parallel group (see the module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter], group: Any, codec: str | Codec, every: int, lr: float,
                 momentum: float) -> None:
        if every < 2:
            raise ValueError(f"OuterSync needs every >= 2 (1 is a gradient all-reduce at every step), got {every}")
        self.params, self.every = params, int(every)
        self.state = QuanGradState(process_group=group, codec=codec)
        pin = any(p.is_cuda for p in params)
        self.anchors = [p.detach().to("cpu", copy=True) for p in params]
        if pin:
            self.anchors = [a.pin_memory() for a in self.anchors]
        self.outer = torch.optim.SGD(self.anchors, lr=lr, momentum=momentum, nesterov=momentum > 0)

    def due(self, step: int, last: int) -> bool:
        """Whether the replicas meet after ``step`` (1-based): every ``every`` steps, and after the last."""
        return step % self.every == 0 or step == last

    @torch.no_grad()
    def sync(self) -> float:
        """Average the pseudo-gradients (collective over the group), take the outer step from the anchor;
        every replica then holds the new anchor. Returns the seconds the all-reduce took."""
        for p, a in zip(self.params, self.anchors):
            p.grad = a.to(p.device, non_blocking=True) - p  # how far the anchor is from where this replica went
        seconds = allreduce_gradients(self.params, self.state)
        for p, a in zip(self.params, self.anchors):
            a.grad = p.grad.to("cpu")
            p.grad = None
        self.outer.step()
        for p, a in zip(self.params, self.anchors):
            p.copy_(a, non_blocking=True)
            a.grad = None
        return seconds

    def state_dict(self) -> dict[str, Any]:
        """The anchor and the outer SGD's state, as they are (a checkpoint writes them at once)."""
        return {"anchors": self.anchors, "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        anchors = state["anchors"]
        if len(anchors) != len(self.anchors):
            raise ValueError(f"the checkpoint holds {len(anchors)} DiLoCo anchors, this stage has "
                             f"{len(self.anchors)} parameters")
        with torch.no_grad():
            for a, saved in zip(self.anchors, anchors):
                a.copy_(saved)
        self.outer.load_state_dict(state["outer"])
