"""The benchmarks' shared process runner."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qwire.bench.runner import spawn_world


def _sum_ranks(rank: int, world: int, scale: float = 1.0) -> torch.Tensor:
    t = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(t)
    return t


def _fails_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 is broken")
    return rank


def test_spawn_world_returns_results_by_rank_and_reports_a_failing_rank() -> None:
    out = spawn_world(_sum_ranks, 3, kwargs={"scale": 2.0}, timeout=60)
    assert [float(t) for t in out] == [12.0, 12.0, 12.0]
    with pytest.raises(RuntimeError, match="rank 1 raised(.|\n)*rank 1 is broken"):
        spawn_world(_fails_on_rank_1, 2, timeout=30)
