"""The byte counters training reports are measured at the transport: what every rank counts as sent on
a process group (or pipeline boundary) equals what the other ranks' transport calls received there."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dist_utils import run_distributed
from qwire.comm.collectives import all_gather, all_reduce, reduce_scatter, sent_bytes
from qwire.parallel.dp import apply_dp
from qwire.parallel.pipeline import boundary_bytes, compressed_pipeline_stage


def _tally_received(received: dict[str, int], names: dict[object, str]) -> None:
    """Wrap the collectives qwire's compressed ones are built on, counting the bytes each call delivers to
    this rank from the other ranks of its group, by group name."""
    a2a, ag = dist.all_to_all_single, dist.all_gather_into_tensor

    def all_to_all_single(out, inp, *args, group=None, **kw):
        world = dist.get_world_size(group)
        received[names.get(group, "other")] += out.numel() * out.element_size() * (world - 1) // world
        return a2a(out, inp, *args, group=group, **kw)

    def all_gather_into_tensor(out, inp, *args, group=None, **kw):
        received[names.get(group, "other")] += (out.numel() - inp.numel()) * out.element_size()
        return ag(out, inp, *args, group=group, **kw)

    dist.all_to_all_single = all_to_all_single
    dist.all_gather_into_tensor = all_gather_into_tensor
    if hasattr(dist, "all_gather_single"):
        dist.all_gather_single = all_gather_into_tensor


def _groups_worker(rank: int, world: int) -> dict:
    # 4 ranks as a 2 x 2 mesh: "dp" groups {0,1},{2,3} and "tp" groups {0,2},{1,3}; every rank creates all.
    dp = {r: g for ranks in ([0, 1], [2, 3]) for g in [dist.new_group(ranks)] for r in ranks}[rank]
    tp = {r: g for ranks in ([0, 2], [1, 3]) for g in [dist.new_group(ranks)] for r in ranks}[rank]
    received = {"dp": 0, "tp": 0, "other": 0}
    _tally_received(received, {dp: "dp", tp: "tp"})
    torch.manual_seed(rank)
    x = torch.randn(1000)
    all_reduce(x, "blockwise8:block=64", group=dp)
    reduce_scatter(x, "int4", group=dp)
    all_gather(x[:333], "fp8", group=tp)
    all_reduce(x, "fp32", group=tp)
    # the DDP hook (collectives on qwire's background thread) and the after-backward path of TP stages
    for tensor_parallel in (False, True):
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        data = apply_dp(dp, "blockwise8:block=256", tensor_parallel=tensor_parallel)
        m = data.wrap(model)
        m(torch.randn(4, 32)).square().sum().backward()
        data.sync([p for p in model.parameters()])
    return {"sent": {"dp": sent_bytes(dp), "tp": sent_bytes(tp)}, "received": received}


def test_collective_counters_match_what_the_transport_received() -> None:
    res = run_distributed(_groups_worker, 4, timeout=120)
    for dim in ("dp", "tp"):
        sent = sum(r["sent"][dim] for r in res)
        got = sum(r["received"][dim] for r in res)
        assert sent == got > 0, (dim, sent, got)
    assert all(r["received"]["other"] == 0 for r in res)
    # each group counts only its own traffic: the totals differ, the per-group split is exact
    assert res[0]["sent"]["dp"] != res[0]["sent"]["tp"]


def _pipeline_worker(rank: int, world: int, fwd: str, bwd: str) -> dict:
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining import Schedule1F1B

    received = [0]
    batch_p2p = schedules._batch_p2p

    def counting(ops, *args, **kw):
        received[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                           if op.op.__name__ == "irecv")
        return batch_p2p(ops, *args, **kw)

    schedules._batch_p2p = counting
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    stage = compressed_pipeline_stage(module, rank, world, "cpu", input_args=torch.zeros(2, 16), fwd=fwd, bwd=bwd)
    sched = Schedule1F1B(stage, 4, loss_fn=lambda out, y: (out - y).square().mean())
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    for _ in range(2):
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
    b = boundary_bytes(stage)
    return {"sent": b["fwd"] + b["bwd"], "received": received[0]}


def test_pipeline_counters_match_what_the_transport_received() -> None:
    res = run_distributed(_pipeline_worker, 3, args=("int4", "perchannel6"), timeout=120)
    sent, got = sum(r["sent"] for r in res), sum(r["received"] for r in res)
    assert sent == got > 0, (sent, got)
