"""QuanGrad DDP hook: exact with fp32, within the 8-bit bound, and DP=2 training close to plain DDP."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_utils import run_distributed
from qwire.codecs import get_codec
from qwire.comm.collectives import sent_bytes
from qwire.comm.ddp_hooks import QuanGradState, _local_roundtrip, allreduce_gradients, quangrad_hook, torch_fp16_hook

SIZES = [1, 7, 256, 1000, 4099]  # odd sizes: not divisible by the world size or the block
TIMEOUT = 60.0


class FakeBucket:
    """The parts of ``dist.GradBucket`` the hook uses."""

    def __init__(self, buf: torch.Tensor, index: int = 0) -> None:
        self._buf, self._index = buf, index

    def buffer(self) -> torch.Tensor:
        return self._buf

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return True


def _inputs(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * n + rank)
    x = torch.randn(n, generator=g)
    x[: max(1, n // 50)] *= 30.0  # a few outliers
    return x


def _hook_worker(rank: int, world: int) -> dict:
    out: dict = {}
    before = sent_bytes(None)
    out["torch-fp16"] = torch_fp16_hook(QuanGradState(codec="fp16"), FakeBucket(_inputs(rank, 1000))).wait().clone()
    out["torch-fp16", "sent"] = sent_bytes(None) - before
    for spec in ["fp32", "blockwise8:block=256", "blockwise4:block=32"]:
        for ef in (False, True):
            state = QuanGradState(codec=spec, error_feedback=ef)
            for n in SIZES:
                buf = _inputs(rank, n)
                res = quangrad_hook(state, FakeBucket(buf, index=n)).wait()
                assert res is buf  # written back in place, like torch's hooks
                out[(spec, ef, n)] = res.clone()
            out[(spec, ef, "counters")] = state.counters()
    # repeated steps with the same gradient: error feedback carries what was lost to the next step
    for ef in (False, True):
        state = QuanGradState(codec="blockwise4:block=32", error_feedback=ef)
        total = torch.zeros(1000)
        for _ in range(8):
            total += quangrad_hook(state, FakeBucket(_inputs(rank, 1000), index=0)).wait()
        out[("sum8", ef)] = total
    return out


def _bound(spec: str, n: int, world: int) -> torch.Tensor:
    """Error bound of the two-shot mean: stage-1 errors of every rank's shards plus the stage-2 error."""
    codec = get_codec(spec)
    k = -(-n // world)
    xs = [_inputs(r, n) for r in range(world)]

    def shard_bound(v: torch.Tensor) -> torch.Tensor:
        p = torch.cat([v, v.new_zeros(world * k - n)]).view(world, k)
        return torch.cat([codec.error_bound(p[r]) for r in range(world)])[:n]

    b1 = sum(shard_bound(x) for x in xs)
    s = sum(_local_roundtrip(x, codec, world) for x in xs)
    b2 = shard_bound(s)  # stage 2 re-quantizes the fp32 sum of the decoded shards
    return (b1 + b2) / world * (1 + 1e-5) + 1e-6


def test_hook_all_reduce_exact_and_bounded():
    world = 2
    res = run_distributed(_hook_worker, world, timeout=TIMEOUT)
    # PyTorch's own fp16 hook (the reference row): the mean in fp16 precision, its ring bytes counted
    exact = (_inputs(0, 1000) + _inputs(1, 1000)) / 2
    torch.testing.assert_close(res[0]["torch-fp16"], exact, rtol=2e-3, atol=2e-3)
    assert res[0]["torch-fp16", "sent"] == 1000 * 2  # 2 (w - 1) / w of the fp16 buffer, w = 2
    for key in res[0]:
        if key[-1] in ("counters", "sent") or key == "torch-fp16":
            continue
        torch.testing.assert_close(res[0][key], res[1][key], rtol=0, atol=0)  # bit-identical on every rank
    for n in SIZES:
        exact = (_inputs(0, n) + _inputs(1, n)) / 2
        for ef in (False, True):
            assert torch.equal(res[0][("fp32", ef, n)], exact)
        for spec in ["blockwise8:block=256", "blockwise4:block=32"]:
            bound = _bound(spec, n, world)
            for ef in (False, True):  # first call: error feedback has nothing to add yet
                err = (res[0][(spec, ef, n)] - exact).abs()
                assert bool((err <= bound).all()), (spec, ef, n, float((err - bound).max()))
    # 8 steps of the same gradient: without error feedback the rounding repeats (error ~8x one
    # step's); with it the accumulated sum stays within about one step's bound of 8x the mean
    exact8 = 8 * (_inputs(0, 1000) + _inputs(1, 1000)) / 2
    bound = _bound("blockwise4:block=32", 1000, world)
    err_ef = (res[0][("sum8", True)] - exact8).abs()
    err_plain = (res[0][("sum8", False)] - exact8).abs()
    assert bool((err_ef <= 2 * bound).all())
    assert float(err_ef.norm()) < 0.5 * float(err_plain.norm())
    c = res[0][("blockwise8:block=256", False, "counters")]
    assert c["buckets"] == len(SIZES) and c["elements"] == sum(SIZES)
    # 8.125 bits vs 32 bits per element, minus per-shard rounding on the tiny buckets
    assert 3.0 < c["compression"] < 4.0
    assert res[0][("fp32", False, "counters")]["compression"] == 1.0


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.emb(x))))


def _batch(step: int, rank: int, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randint(0, vocab, (16, 8), generator=g)
    y = (3 * x + 1) % vocab
    noise = torch.rand(x.shape, generator=g) < 0.1
    y = torch.where(noise, torch.randint(0, vocab, x.shape, generator=g), y)
    return x, y


def _train(rank: int, hook_state: QuanGradState | None, steps: int = 20) -> list[float]:
    torch.manual_seed(0)
    model = DDP(TinyLM(), bucket_cap_mb=0.004)  # several buckets of odd sizes
    if hook_state is not None:
        model.register_comm_hook(hook_state, quangrad_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        x, y = _batch(step, rank)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())
    return losses


def _train_worker(rank: int, world: int) -> dict:
    out = {"plain": _train(rank, None)}
    for name, kw in {"fp32": {"codec": "fp32"}, "q8": {}, "q8_ef": {"error_feedback": True},
                     "q4": {"codec": "blockwise4:block=32"}}.items():
        state = QuanGradState(**kw)
        out[name] = _train(rank, state)
        out[name + "_counters"] = state.counters()
    return out


@pytest.mark.slow
def test_ddp_training_with_hook_tracks_plain_ddp():
    res = run_distributed(_train_worker, 2, timeout=TIMEOUT)[0]
    plain = res["plain"]
    assert plain[-1] < 0.8 * plain[0]  # it learns
    # fp32 codec: the same gradients as DDP's own all-reduce for two ranks -> same losses
    assert res["fp32"] == plain
    # 8-bit: final loss (mean of the last 5 steps) within 3% of plain DDP's
    last = sum(plain[-5:]) / 5
    for name in ("q8", "q8_ef"):
        mine = sum(res[name][-5:]) / 5
        assert abs(mine - last) <= 0.03 * last, (name, mine, last)
        c = res[name + "_counters"]
        assert c["steps"] == 20 and c["compression"] > 3.0
    assert res["q8_ef_counters"]["wire_bytes"] == res["q8_counters"]["wire_bytes"]
    # 4-bit still trains (looser: 15%)
    assert abs(sum(res["q4"][-5:]) / 5 - last) <= 0.15 * last


@pytest.mark.slow
def test_bench_agoq_quick(tmp_path):
    """`qwire bench agoq --quick` runs end to end and writes its JSON, markdown and plot."""
    import json

    from qwire.bench import agoq

    parser = argparse.ArgumentParser()
    agoq.add_arguments(parser)
    assert agoq.run(parser.parse_args(["--quick", "--out", str(tmp_path), "--timeout", "120"])) == 0
    res = json.loads((tmp_path / "agoq.json").read_text())
    assert set(res["allreduce"]["0.25"]) == set(agoq.HOOKS)
    q, plain = res["allreduce"]["0.25"]["quangrad"], res["allreduce"]["0.25"]["allreduce"]
    assert 3.5 < plain["bytes"] / q["bytes"] < 4.0
    assert set(res["dp"]) == set(agoq.DP_RUNS)
    assert res["laaq_mem"]["rows"] and res["laaq_train"]
    # the project's own model preset and corpus, not a stand-in
    assert res["meta"]["model_name"] == "llama-micro" and res["meta"]["data"].startswith("corpus 'stdlib")
    assert res["dp"]["allreduce"]["bytes_per_step"] == 4 * 922_752  # llama-micro at vocab 512, 2 ranks: 2(W-1)/W = 1
    md = (tmp_path / "agoq.md").read_text()
    assert "simulated" in md and "qwire bench agoq --quick" in md
    assert (tmp_path / "agoq_loss.png").stat().st_size > 1000
    # a later run of one part keeps the other parts' results, and the page names both commands
    assert agoq.run(parser.parse_args(["--quick", "--out", str(tmp_path), "--timeout", "120", "--parts",
                                       "allreduce"])) == 0
    again = json.loads((tmp_path / "agoq.json").read_text())
    assert again["dp"] == res["dp"] and again["laaq_mem"] == res["laaq_mem"] and again["laaq_train"] == res[
        "laaq_train"]
    assert set(again["allreduce"]["0.25"]) == set(agoq.HOOKS)
    secs = again["meta"]["sections"]
    assert "--parts allreduce" in secs["allreduce"]["command"] and "--parts" not in secs["dp"]["command"]
    md = (tmp_path / "agoq.md").read_text()
    assert "Sections from earlier runs" in md and "DP training: `qwire bench agoq --quick" in md


def _allreduce_gradients_worker(rank: int, world: int) -> dict:
    params = [nn.Parameter(torch.zeros(n)) for n in (300, 500, 200, 700)]
    for k, p in enumerate(params[:3]):  # the last one has no gradient
        p.grad = torch.full_like(p, float(rank + 1) * (k + 1))
    exact = QuanGradState(codec="fp32")
    allreduce_gradients(params, exact, bucket_bytes=2000)  # buckets: [300 (1200 B), 500] [200, 700]
    means = [p.grad.clone() if p.grad is not None else None for p in params]
    ef = QuanGradState(codec="blockwise8:block=64", error_feedback=True)
    keys = []
    for _ in range(3):
        for k, p in enumerate(params[:3]):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(rank * 10 + k))
        allreduce_gradients(params, ef, bucket_bytes=2000)
        keys.append(sorted(ef.residuals))
    return {"means": means, "keys": keys, "buckets": exact.buckets}


def test_allreduce_gradients_averages_buckets_and_keeps_one_residual_per_bucket():
    for out in run_distributed(_allreduce_gradients_worker, 2):
        assert out["buckets"] == 2
        for k, m in enumerate(out["means"][:3]):
            assert torch.equal(m, torch.full_like(m, 1.5 * (k + 1)))  # mean of rank 1 and rank 2 values
        assert out["means"][3] is None  # a parameter without a gradient keeps none
        assert out["keys"] == [[0, 1]] * 3  # error-feedback residuals are reused step after step


def _ef_conservation_worker(rank: int, world: int) -> dict:
    from qwire.comm.ddp_hooks import _all_reduce_ef

    codec = get_codec(f"int4:rounding=stochastic,seed={rank}")
    x = _inputs(rank, 1001)
    mean, residual = _all_reduce_ef(x.clone(), codec, None, world, rank)
    return {"x": x, "mean": mean, "residual": residual}


@pytest.mark.parametrize("world", [2, 3])
def test_error_feedback_keeps_exactly_what_the_payloads_sent_lost(world):
    """Over the ranks, the residuals hold what the compressed mean lost: sum(x) - world * mean. The first-stage
    error comes from the payloads that were sent (one encode), so this holds under stochastic rounding too,
    where a second encode would draw other random numbers and the residual would not match what was sent."""
    res = run_distributed(_ef_conservation_worker, world, timeout=TIMEOUT)
    total_x = sum(r["x"].double() for r in res)
    lost = total_x - world * res[0]["mean"].double()
    kept = sum(r["residual"].double() for r in res)
    assert float(lost.abs().max()) > 1e-2  # int4: a real loss to account for
    torch.testing.assert_close(kept, lost, rtol=0, atol=1e-5)


def _disagreeing_worker(rank: int, world: int, case: str) -> str:
    from qwire.codecs import CodecError

    torch.manual_seed(0)
    try:
        if case == "codec":  # DDP with the hook; rank 1 names another codec
            model = nn.Linear(16, 8)
            ddp = DDP(model)
            ddp.register_comm_hook(QuanGradState(codec="fp8" if rank == 0 else "int4"), quangrad_hook)
            ddp(torch.randn(4, 16)).sum().backward()
        else:  # reduced after backward; rank 1's model is wider
            model = nn.Linear(16 + 8 * rank, 8)
            model(torch.randn(4, 16 + 8 * rank)).sum().backward()
            allreduce_gradients(list(model.parameters()), QuanGradState(codec="fp8"))
    except CodecError as e:
        return str(e)
    return "trained"


@pytest.mark.parametrize("case", ["codec", "model"])
def test_ranks_that_reduce_gradients_differently_are_told_so_at_the_first_bucket(case):
    """A rank with another codec (or model) than its peers: both raise a CodecError naming the two, where
    gloo aborted the process before (and NCCL would have summed garbled payloads)."""
    for msg in run_distributed(_disagreeing_worker, 2, (case,), timeout=TIMEOUT):
        assert msg.startswith("ranks disagree on the codec configuration of the data-parallel gradient all-reduce")
        assert "Give every rank the same codec and the same model." in msg
        if case == "codec":
            assert "rank 0: fp8:" in msg and "rank 1: int:bits=4" in msg
        else:
            assert "shape=(136,)" in msg and "shape=(200,)" in msg
