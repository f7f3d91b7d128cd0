"""Where each rank sits in a ``qwire train`` job: the (dp, pp, tp) layout, its process groups and DeviceMesh,
and the checks that every rank runs the same job.

Rank layout: ``rank = (dp_rank * stages + pp_rank) * tp + tp_rank``, so the tensor-parallel ranks of a
stage are neighbours (one machine), then the stages of a pipeline, then the data-parallel replicas.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from qwire.config import PER_RANK_FIELDS, TrainConfig
from qwire.procs import TrainError


@dataclass(frozen=True)
class Layout:
    """This rank's coordinates in the (dp, pp, tp) mesh."""

    rank: int
    stages: int
    tp: int
    dp: int

    @property
    def world(self) -> int:
        return self.stages * self.tp * self.dp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.stages * self.tp)

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp % self.stages

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.stages - 1

    @property
    def reports_loss(self) -> bool:
        """One rank per pipeline replica reports its loss: the last stage's first tensor-parallel rank."""
        return self.is_last and self.tp_rank == 0

    @classmethod
    def of(cls, rank: int, cfg: TrainConfig) -> Layout:
        return cls(rank, cfg.stages, cfg.tp, cfg.dp)


@dataclass
class Groups:
    """This rank's process groups, one per mesh dimension (all None for a pure pipeline, which uses the
    default group), and the DeviceMesh built from them."""

    pp: Any = None
    tp: Any = None
    dp: Any = None
    mesh: DeviceMesh | None = None
    dp_outer: Any = None  # the same ranks as dp, for DiLoCo's meetings in a thread of their own


def build_groups(layout: Layout, device: torch.device, timeout: float, outer: bool = False) -> Groups:
    """One ``DeviceMesh`` of shape (dp, pp, tp) over the job's ranks, from process groups that each have
    ``timeout`` seconds. Collective: every rank creates every group (``new_group`` is collective).
    ``outer``: a second group per data-parallel group (``dp_outer``), so that DiLoCo's overlapped meetings
    cross on their own connections and counters while the step's collectives go on."""
    P, T, D = layout.stages, layout.tp, layout.dp
    if T == 1 and D == 1:
        return Groups()
    families = {  # dimension -> the rank lists of its groups
        "pp": [[(d * P + p) * T + t for p in range(P)] for d in range(D) for t in range(T)],
        "tp": [[(d * P + p) * T + t for t in range(T)] for d in range(D) for p in range(P)],
        "dp": [[(d * P + p) * T + t for d in range(D)] for p in range(P) for t in range(T)],
    }
    if outer:
        families["dp_outer"] = families["dp"]
    mine: dict[str, Any] = {}
    for dim, rank_lists in families.items():
        for ranks in rank_lists:
            g = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout))
            if layout.rank in ranks:
                mine[dim] = g
    grid = torch.arange(layout.world).view(D, P, T)
    mesh = DeviceMesh.from_group([mine["dp"], mine["pp"], mine["tp"]], device.type, mesh=grid,
                                 mesh_dim_names=("dp", "pp", "tp"))
    return Groups(pp=mine["pp"], tp=mine["tp"], dp=mine["dp"], mesh=mesh, dp_outer=mine.get("dp_outer"))


def check_same_config(cfg: TrainConfig, resume: bool | None = None) -> None:
    """Every rank must have the same mesh, codecs, model and data settings (under torchrun each machine
    parses its own options); the per-rank fields (run directory, device, links) may differ. Codec options are
    compared as the codecs they build, every parameter written out (:func:`~qwire.config.codec_pins`: ``int4``
    and ``int:bits=4,tile=32`` agree; ``fp8`` does not where two versions of qwire build it with different
    defaults); so are the versions of qwire and torch, and, where given, whether each rank resumes the run."""
    import qwire
    from qwire.config import codec_pins

    mine = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_RANK_FIELDS}
    pins = codec_pins(cfg)
    versions = {"qwire": qwire.__version__, "torch": torch.__version__}
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, (mine, pins, versions, resume))
    first, first_pins, first_versions, first_resume = values[0]
    problems = []
    for r, (v, p, ver, res) in enumerate(values):
        out = []
        if ver != first_versions:
            out.append(" and ".join(f"{k} {ver[k]}" for k in ver) + " (rank 0: "
                       + " and ".join(f"{k} {first_versions[k]}" for k in first_versions) + ")")
        for k in sorted({*v, *first}):
            if k not in v or k not in first:  # an option one version of qwire has and the other not
                out.append(f"--{k.replace('_', '-')} is {'not ' if k not in v else ''}an option here "
                           f"(rank 0: {'not ' if k not in first else ''}an option)")
            elif k in p and k in first_pins and p[k] == first_pins[k]:
                continue  # two ways of writing one codec
            elif v[k] != first[k]:
                out.append(f"--{k.replace('_', '-')} {v[k]!r} (rank 0: {first[k]!r})")
            elif p.get(k) != first_pins.get(k):
                out.append(f"--{k.replace('_', '-')} {v[k]!r} builds {p.get(k)!r} (rank 0: {first_pins.get(k)!r})")
        if res != first_resume:
            out.append(f"{'resumes the run' if res else 'starts a new run'} (rank 0: "
                       f"{'resumes it' if first_resume else 'starts a new run'})")
        if out:
            problems.append(f"rank {r}: " + ", ".join(out))
    if problems:
        raise TrainError("ranks were started with different settings; give every rank the same options (and the "
                         "same versions of qwire and torch):\n  " + "\n  ".join(problems))


def ranks_differing(value: Any, group: Any = None) -> list[int]:
    """The ranks of ``group`` (by their rank in it) whose ``value`` differs from its first rank's (collective)."""
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return [r for r, v in enumerate(values) if v != values[0]]


def check_same_everywhere(what: str, value: str, fix: str) -> None:
    """Raise naming the ranks whose ``value`` differs from rank 0's (collective)."""
    differ = ranks_differing(value)
    if differ:
        raise TrainError(f"ranks {differ} have a different {what} than rank 0; {fix}")


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of the tensors' names and bytes, in order (exact: not a sum, whose rounding depends on how many
    threads add it up)."""
    import hashlib

    h = hashlib.sha1(usedforsecurity=False)
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy())  # (read in place)
    return h.hexdigest()


def weights_digest(model: torch.nn.Module) -> str:
    """:func:`tensors_digest` of every parameter and buffer of ``model``."""
    return tensors_digest([*model.named_parameters(), *model.named_buffers()])


def check_same_model(model: torch.nn.Module, fix: str) -> None:
    """Every rank must build the same model: its parameters' names and shapes, then their values (collective;
    raises TrainError naming the ranks that differ, ending with ``fix``)."""
    check_same_everywhere("model (its parameters' names and shapes)",
                          repr([(k, tuple(p.shape)) for k, p in model.named_parameters()]), fix)
    check_same_everywhere("model (the same names and shapes, other weights)", weights_digest(model), fix)


def _over_ranks(values: dict[str, float], device: torch.device, op: Any) -> dict[str, float]:
    if dist.get_backend() == "gloo":  # a few host numbers: gloo's CPU path, whatever the ranks' device
        device = torch.device("cpu")
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return dict(zip(values, t.tolist()))


def max_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """The largest value of each name over all ranks (one fp64 all-reduce); every rank gets them."""
    return _over_ranks(values, device, dist.ReduceOp.MAX)


def sum_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum each named value over all ranks (one fp64 all-reduce); every rank gets the sums."""
    return _over_ranks(values, device, dist.ReduceOp.SUM)
