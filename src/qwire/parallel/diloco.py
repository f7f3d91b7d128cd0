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

With ``overlap`` (``--dp-sync-overlap K``, ``0 < K < H``) a replica does not wait for a meeting: the
pseudo-gradients are all-reduced in a thread of their own, over a process group of their own, while the
replica takes its next ``K`` inner steps; then the outer step lands. The replica keeps what those ``K`` steps
did on top of the new anchor (parameters = new anchor + (parameters now - parameters at the meeting)), as
the overlapped variant of Streaming DiLoCo (arXiv 2501.18512) does with its mixing factor at 0. The
all-reduce's time is hidden behind ``K`` steps of compute; the price is one more copy of the parameters on
their device (the pseudo-gradients in flight) and one in host memory (the parameters at the meeting). The
last step's meeting is always waited for, so a run ends with every replica on the anchor.

With ``error_feedback`` (``--dp-error-feedback``) each rank keeps what the all-reduce's quantization lost of its
pseudo-gradient and adds it to the next meeting's (:func:`~qwire.comm.ddp_hooks.allreduce_gradients`' residuals,
saved in the checkpoint). Tensor-parallel parameters (DTensors) meet as their local shards, over the group of
the ranks with the same pipeline and tensor-parallel coordinates.

With ``fragments`` F > 1 (``--dp-sync-fragments``, Streaming DiLoCo's fragments) the parameters are cut into F
contiguous fragments of about equal size, each with its own anchor slice, outer SGD and residuals, and the
fragments meet in turn, one every ``every / F`` steps (fragment ``f`` after the steps ``(f + 1) * every / F``
modulo ``every``): every parameter still meets every ``every`` steps, but each meeting sends ``1 / F`` of the
bytes, which a shorter overlap hides. After the last step every fragment meets.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from qwire.codecs import Codec
from qwire.comm.collectives import sent_bytes
from qwire.comm.ddp_hooks import QuanGradState, allreduce_gradients


@dataclass
class Meeting:
    """A meeting whose outer step has not landed yet: its fragment, the pseudo-gradients (averaged in place once
    the thread is done), the parameters at the meeting (host), the step after which it lands, and what the
    thread did."""

    land_at: int
    deltas: list[torch.Tensor]
    snapshot: list[torch.Tensor]
    fragment: int = 0
    thread: threading.Thread | None = None
    sent_before: int = 0
    sent: int = 0
    error: BaseException | None = None


def split_fragments(sizes: list[int], n: int) -> list[list[int]]:
    """The indices of ``sizes`` cut into ``n`` contiguous, non-empty runs of about equal total size (each index
    goes where its middle falls; where that leaves a run empty, runs of about equal count instead). One run
    holds every index, none included."""
    if n == 1:
        return [list(range(len(sizes)))]
    if not 1 <= n <= len(sizes):
        raise ValueError(f"cannot cut {len(sizes)} parameters into {n} fragments: give at most {len(sizes)}")
    total, cum, out = sum(sizes), 0, [[] for _ in range(n)]
    for i, size in enumerate(sizes):
        out[min(n - 1, int((cum + size / 2) * n / total)) if total else i * n // len(sizes)].append(i)
        cum += size
    if any(not f for f in out):
        out = [list(range(k * len(sizes) // n, (k + 1) * len(sizes) // n)) for k in range(n)]
    return out


class OuterSync:
    """The outer loop of DiLoCo over one stage's data-parallel group (see the module docstring).
    ``overlap_group``: the group of the overlapped meetings (the same ranks as ``group``; needed with
    ``overlap``), so that their collectives run beside the step's own."""

    def __init__(self, params: list[torch.nn.Parameter], group: Any, codec: str | Codec, every: int, lr: float,
                 momentum: float, overlap: int = 0, overlap_group: Any = None, error_feedback: bool = False,
                 fragments: int = 1) -> None:
        if every < 2:
            raise ValueError(f"OuterSync needs every >= 2 (1 is a gradient all-reduce at every step), got {every}")
        if fragments < 1 or every % fragments:
            raise ValueError(f"OuterSync needs fragments >= 1 that divide every ({every}), got {fragments}")
        self.gap = every // fragments  # steps between two meetings (of two fragments)
        if not 0 <= overlap < self.gap:
            raise ValueError(f"OuterSync needs 0 <= overlap < every / fragments ({self.gap}), got {overlap}")
        if overlap and overlap_group is None:
            raise ValueError("OuterSync with overlap needs an overlap_group of its own")
        self.params, self.overlap = list(params), int(overlap)  # (a generator would be used up below)
        self.group = overlap_group if overlap else group
        self.pin = any(p.is_cuda for p in self.params)
        local = self._locals()
        if fragments > max(1, len(local)):
            raise ValueError(f"--dp-sync-fragments {fragments}: this stage has {len(local)} parameters, and every "
                             f"fragment needs one; give at most {len(local)}")
        self.fragments = split_fragments([p.numel() for p in local], fragments)
        self.states = [QuanGradState(process_group=self.group, codec=codec, error_feedback=error_feedback)
                       for _ in self.fragments]
        self.anchors = [self._host(p) for p in local]
        self.outers = [torch.optim.SGD([self.anchors[i] for i in f], lr=lr, momentum=momentum, nesterov=momentum > 0)
                       for f in self.fragments]
        self.pending: Meeting | None = None
        self.anchors_checked = False
        self.met_at = 0  # the last step after which a meeting started, was held or landed

    @torch.no_grad()
    def _locals(self) -> list[torch.Tensor]:
        """The parameters as this rank holds them: a tensor-parallel parameter (a DTensor) as its local shard,
        which shares its storage (the data-parallel group holds the ranks with the same tensor-parallel
        coordinate, so the shards of one group match)."""
        return [p.to_local() if hasattr(p, "to_local") else p for p in self.params]

    def _check_anchors(self) -> None:
        """Once, before the first meeting (collective over the group): every replica must start from the same
        anchor, or the meetings average pseudo-gradients of models that never meet (each keeps its own anchor)."""
        if self.anchors_checked:
            return
        from qwire.parallel.mesh import ranks_differing, tensors_digest

        differ = ranks_differing(tensors_digest((str(i), a) for i, a in enumerate(self.anchors)), self.group)
        if differ:
            raise ValueError(f"OuterSync: the replicas of group ranks {differ} started from other weights than "
                             "group rank 0's, so their meetings would never bring them together; give every replica "
                             "the same weights before building OuterSync (the same seed or checkpoint, or "
                             "dist.broadcast each parameter from the group's first rank)")
        self.anchors_checked = True

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        h = t.detach().to("cpu", copy=True)
        return h.pin_memory() if self.pin else h

    def _deltas(self, fragment: int, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """The fragment's pseudo-gradients: how far the anchor is from where this replica went (``local``: all
        of :meth:`_locals`)."""
        return [self.anchors[i].to(local[i].device, non_blocking=True) - local[i] for i in self.fragments[fragment]]

    def _outer_step(self, fragment: int, averaged: list[torch.Tensor]) -> None:
        """The fragment's outer SGD step on its anchor slice, with the averaged pseudo-gradients as gradients."""
        idx = self.fragments[fragment]
        for i, d in zip(idx, averaged):
            self.anchors[i].grad = d.to("cpu")
        self.outers[fragment].step()
        for i in idx:
            self.anchors[i].grad = None

    def due(self, step: int, last: int) -> list[int]:
        """The fragments that meet after ``step`` (1-based): one every ``every / fragments`` steps, in turn (with
        one fragment: every ``every`` steps), and all of them after the last."""
        if step == last:
            return list(range(len(self.fragments)))
        return [] if step % self.gap else [(step // self.gap - 1) % len(self.fragments)]

    def after_step(self, step: int, last: int) -> tuple[bool, float, int]:
        """What the replicas do after ``step`` (collective over the group when a meeting starts or is waited
        for): land an overlapped meeting that is due (or any, after the last step), then start or hold this
        step's meeting. Returns whether an outer step landed, the seconds this rank waited for meetings, and
        the payload bytes it sent for the meetings that landed."""
        landed, waited, sent = False, 0.0, 0
        if self.pending is not None and (step >= self.pending.land_at or step == last):
            w, b = self._land()
            landed, waited, sent = True, w, b
            self.met_at = step
        due = self.due(step, last)
        if due:
            self.met_at = step  # (a step whose time holds a meeting: `auto` leaves it out of its step-time level)
            if self.overlap and step < last:
                self._start(due[0], step + self.overlap)
            else:
                w, b = self.sync(due)
                landed, waited, sent = True, waited + w, sent + b
        return landed, waited, sent

    @torch.no_grad()
    def sync(self, fragments: list[int] | None = None) -> tuple[float, int]:
        """Average the pseudo-gradients of ``fragments`` (default: all; collective over the group), take their
        outer steps from the anchor; every replica then holds the new anchor there. Returns the seconds the
        all-reduces took and the bytes this rank sent."""
        self._check_anchors()
        before, seconds, local = sent_bytes(self.group), 0.0, self._locals()
        for f in range(len(self.fragments)) if fragments is None else fragments:
            grads = [SimpleNamespace(grad=d) for d in self._deltas(f, local)]  # averaged in place, as gradients are
            seconds += allreduce_gradients(grads, self.states[f])
            self._outer_step(f, [g.grad for g in grads])
            for i in self.fragments[f]:
                local[i].copy_(self.anchors[i], non_blocking=True)
        return seconds, sent_bytes(self.group) - before

    @torch.no_grad()
    def _start(self, fragment: int, land_at: int) -> None:
        """The fragment's pseudo-gradients and parameters as they are now; their all-reduce in a thread."""
        self._check_anchors()
        held = self._locals()
        m = Meeting(land_at, self._deltas(fragment, held), [self._host(held[i]) for i in self.fragments[fragment]],
                    fragment=fragment, sent_before=sent_bytes(self.group))
        grads = [SimpleNamespace(grad=d) for d in m.deltas]  # averaged in place, as gradients are
        state = self.states[fragment]

        def exchange() -> None:
            try:
                if self.pin:  # a new thread starts on GPU 0: the collectives' events and copies go to the stage's
                    torch.cuda.set_device(self.params[0].device)
                with torch.no_grad():
                    allreduce_gradients(grads, state)
            except BaseException as e:  # noqa: BLE001  (raised in the training thread when the meeting lands)
                m.error = e

        m.thread = threading.Thread(target=exchange, name=f"qwire-diloco-meeting-{land_at - self.overlap}",
                                    daemon=True)
        self.pending = m
        m.thread.start()

    def _finish(self) -> float:
        """Wait for the pending meeting's all-reduce (re-raising its error); returns the seconds waited."""
        m, t0 = self.pending, time.perf_counter()
        assert m is not None
        if m.thread is not None:
            m.thread.join()
            m.thread = None
            m.sent = sent_bytes(self.group) - m.sent_before
        if m.error is not None:
            raise m.error
        return time.perf_counter() - t0

    @torch.no_grad()
    def _land(self) -> tuple[float, int]:
        """The pending meeting's outer step, with the inner steps taken since it started kept on top."""
        waited = self._finish()
        m, self.pending = self.pending, None
        assert m is not None
        self._outer_step(m.fragment, m.deltas)
        local = self._locals()
        for i, snap in zip(self.fragments[m.fragment], m.snapshot):  # new anchor + (now - at the meeting)
            local[i].add_((self.anchors[i] - snap).to(local[i].device, non_blocking=True))
        return waited, m.sent

    def state_dict(self) -> dict[str, Any]:
        """The anchor and the outer SGDs' states, as they are (a checkpoint writes them at once); with a
        meeting in flight, it is waited for and saved with its averaged pseudo-gradients, so that a resumed
        run lands it at the same step with the same values."""
        state: dict[str, Any] = {"anchors": self.anchors, "outer": [o.state_dict() for o in self.outers]}
        if self.pending is not None:
            self._finish()  # (its all-reduce also updates the error-feedback residuals saved below)
            m = self.pending
            state["pending"] = {"land_at": m.land_at, "deltas": [d.to("cpu") for d in m.deltas],
                                "snapshot": m.snapshot, "sent": m.sent, "fragment": m.fragment}
        if self.states[0].error_feedback:
            state["residuals"] = [{i: r.to("cpu") for i, r in st.residuals.items()} for st in self.states]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        anchors = state["anchors"]
        if len(anchors) != len(self.anchors):
            raise ValueError(f"the checkpoint holds {len(anchors)} DiLoCo anchors, this stage has "
                             f"{len(self.anchors)} parameters")
        outers = state["outer"] if isinstance(state["outer"], list) else [state["outer"]]  # (one, before fragments)
        if len(outers) != len(self.outers):
            raise ValueError(f"the checkpoint holds DiLoCo's outer state of {len(outers)} fragment(s), this run has "
                             f"{len(self.outers)} (--dp-sync-fragments)")
        with torch.no_grad():
            for a, saved in zip(self.anchors, anchors):
                a.copy_(saved)
        for o, saved in zip(self.outers, outers):
            o.load_state_dict(saved)
        got = state.get("pending")
        if got is None:
            self.pending = None
        else:
            f = int(got.get("fragment", 0))
            self.pending = Meeting(
                int(got["land_at"]), [d.to(self.params[i].device) for d, i in zip(got["deltas"], self.fragments[f])],
                [self._host(s) for s in got["snapshot"]], fragment=f, sent=int(got["sent"]))
        if self.states[0].error_feedback:  # (none in a checkpoint of a run without error feedback: they start at 0)
            device = self.params[0].device
            for st, res in zip(self.states, state.get("residuals", [])):
                st.residuals = {int(i): r.to(device) for i, r in res.items()}
