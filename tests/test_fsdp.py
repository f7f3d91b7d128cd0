"""apply_fsdp: FSDP2 with qwire's compressed reduce-scatter / all-gather, on gloo with 2 ranks.

* ``fp32`` gradients == plain FSDP2 == one process on the whole batch, step for step;
* ``blockwise8`` gradients within a bounded relative error, and training still lowers the loss;
* 8-bit/FP8 parameter all-gather: close forward outputs, sharded master weights untouched;
* bytes counted == bytes the transport carried; mismatched codecs fail at start-up;
* accumulate_in_8bit on an FSDP2 module (hooks of the sharded parameters).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from qwire.codecs import CodecError
from qwire.comm.collectives import sent_bytes
from qwire.comm.grad_accum import accumulate_in_8bit
from qwire.models import build_model, lm_loss, split_model
from qwire.parallel.fsdp import FSDPError, apply_fsdp, decoder_blocks, fsdp_sent_bytes

WORLD = 2
VOCAB = 128
STEPS = 4
LR = 1e-2
TIMEOUT = 90.0


def _stage() -> torch.nn.Module:
    """A tiny Llama as a qwire pipeline stage (one stage: input_ids -> logits)."""
    model = build_model("llama-tiny", vocab_size=VOCAB, seed=0, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    return split_model(model, 1)[0].train()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (2, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _optimizer(module: torch.nn.Module, adam: bool) -> torch.optim.Optimizer:
    # SGD with momentum is linear in the gradients, so rounding differences stay at rounding size
    # (AdamW's per-element normalization turns a near-zero gradient's sign flip into a full step)
    if adam:
        return torch.optim.AdamW(module.parameters(), lr=LR)
    return torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)


def _train(module: torch.nn.Module, rank: int, fixed_batch: bool = False) -> dict:
    """STEPS optimizer steps (AdamW on one fixed batch, else SGD on fresh batches): the losses (this
    rank's batch), the first step's full gradients and the final full parameters."""
    opt = _optimizer(module, adam=fixed_batch)
    losses, grads = [], None
    for step in range(STEPS):
        x, y = _batch(rank, 0 if fixed_batch else step)
        loss = lm_loss(module(x), y)
        loss.backward()
        if step == 0:
            grads = [_full(p.grad).detach().clone() for p in module.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": grads, "params": [_full(p).detach().clone() for p in module.parameters()]}


def _plain_fsdp(module: torch.nn.Module, group) -> torch.nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    for block in decoder_blocks(module):
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


class _Tally:
    """Wraps the transport calls qwire's collectives make and counts what this rank received from the others."""

    def __init__(self, group) -> None:
        self.group, self.received = group, 0
        self._orig = {name: getattr(dist, name) for name in ("all_to_all_single", "all_gather_single",
                                                             "all_gather_into_tensor") if hasattr(dist, name)}

    def __enter__(self) -> _Tally:
        world = dist.get_world_size(self.group)

        def a2a(out, inp, *args, group=None, **kw):
            if group is self.group:
                self.received += out.numel() * out.element_size() * (world - 1) // world
            return self._orig["all_to_all_single"](out, inp, *args, group=group, **kw)

        def gather(name):
            def fn(out, inp, *args, group=None, **kw):
                if group is self.group:
                    self.received += (out.numel() - inp.numel()) * out.element_size()
                return self._orig[name](out, inp, *args, group=group, **kw)
            return fn

        dist.all_to_all_single = a2a
        for name in self._orig:
            if name != "all_to_all_single":
                setattr(dist, name, gather(name))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def _fsdp_worker(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=60))
    out: dict = {}
    out["plain"] = _train(_plain_fsdp(_stage(), group), rank)

    # fp32 gradients, uncompressed parameters: every byte counted, and counted right
    module = apply_fsdp(_stage(), group, grad_codec="fp32")
    before = sent_bytes(group)
    with _Tally(group) as tally:
        out["fp32"] = _train(module, rank)
    out["bytes"] = {"tally": tally.received, "counter": sent_bytes(group) - before,
                    "split": fsdp_sent_bytes(module)}

    # 8-bit gradients: close to fp32, and training on one fixed batch still lowers the loss
    module = apply_fsdp(_stage(), group)
    before = sent_bytes(group)
    with _Tally(group) as tally:
        out["blockwise8"] = _train(module, rank)
    out["bytes8"] = {"tally": tally.received, "counter": sent_bytes(group) - before,
                     "split": fsdp_sent_bytes(module)}
    out["fit8"] = _train(apply_fsdp(_stage(), group), rank, fixed_batch=True)["losses"]
    out["fit32"] = _train(apply_fsdp(_stage(), group, grad_codec="fp32"), rank, fixed_batch=True)["losses"]

    # compressed parameter all-gather: forward close to exact; the sharded master weights untouched
    x, _ = _batch(rank, 0)
    exact = apply_fsdp(_stage(), group, grad_codec="fp32")
    shards0 = [p.to_local().clone() for p in exact.parameters()]
    out["logits"] = {"exact": exact(x).detach()}
    out["param_loss"] = {"exact": float(lm_loss(out["logits"]["exact"], x))}
    for spec in ("fp8", "blockwise8"):
        module = apply_fsdp(_stage(), group, grad_codec="fp32", param_codec=spec)
        logits = module(x)
        lm_loss(logits, x).backward()
        out["logits"][spec] = logits.detach()
        out["param_loss"][spec] = float(lm_loss(logits.detach(), x))
        out.setdefault("shards_exact", {})[spec] = all(
            torch.equal(p.to_local(), s) for p, s in zip(module.parameters(), shards0))
        out.setdefault("gather_bytes", {})[spec] = fsdp_sent_bytes(module)["all_gather"]
    module = apply_fsdp(_stage(), group, grad_codec="fp32")
    lm_loss(module(x), x).backward()
    out["gather_bytes"]["none"] = fsdp_sent_bytes(module)["all_gather"]

    # 8-bit accumulation over 3 micro-batches on FSDP2 (gradient sync in every micro-batch)
    for spec in ("fp32", "blockwise8:block=256"):
        ref = apply_fsdp(_stage(), group, grad_codec="fp32")
        module = apply_fsdp(_stage(), group, grad_codec="fp32")
        handle = accumulate_in_8bit(module, codec=spec)
        for i in range(3):
            x, y = _batch(rank, 10 + i)
            lm_loss(ref(x), y).backward()
            lm_loss(module(x), y).backward()
        held, fp32 = handle.held_bytes(), handle.fp32_bytes()
        assert all(p.grad is None for p in module.parameters())  # the fp32 shards were freed
        handle.finish()
        out.setdefault("accum", {})[spec] = {
            "held": held, "fp32": fp32, "folded": handle.folded, "n_params": len(list(module.parameters())),
            "ref": [_full(p.grad) for p in ref.parameters()], "got": [_full(p.grad) for p in module.parameters()]}
    out["pipeline"] = _pipeline_cases(rank, world, group)
    return out


def _pipeline_cases(rank: int, world: int, group) -> dict:
    """FSDP inside a one-stage pipeline schedule (2 micro-batches, gradients scaled by 1/2): apply_fsdp on the
    stage module, or as the stage's wrap; with the 8-bit accumulator, finish(scale=1/2) after the step."""
    from torch.distributed.pipelining import ScheduleGPipe

    from qwire.parallel.pipeline import compressed_pipeline_stage

    pp = [dist.new_group([r]) for r in range(world)][rank]
    x, y = _batch(rank, 20)
    out = {}
    for case in ("inner", "wrap", "inner+accum"):
        module = _stage()
        wrap = None
        if case == "wrap":
            def wrap(m):
                return apply_fsdp(m, group, grad_codec="fp32")
        else:
            apply_fsdp(module, group, grad_codec="fp32")
        handle = accumulate_in_8bit(module, codec="fp32") if case == "inner+accum" else None
        stage = compressed_pipeline_stage(module, 0, 1, "cpu", input_args=x[:1], fwd="fp32", bwd="fp32",
                                          group=pp, wrap=wrap)
        ScheduleGPipe(stage, 2, loss_fn=lm_loss).step(x, target=y)
        if handle is not None:
            assert handle.held_bytes() == handle.fp32_bytes()
            handle.finish(scale=1 / 2)  # the schedule's 1/n scaling skipped the gradients in the buffer
        out[case] = [_full(p.grad) for p in module.parameters()]
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_fsdp_worker, WORLD, timeout=TIMEOUT)


def _single_process() -> dict:
    """The same training on one process, both ranks' batches in one (the mean loss of equal halves)."""
    module = _stage()
    opt = _optimizer(module, adam=False)
    losses, grads = [], None
    for step in range(STEPS):
        xs, ys = zip(*(_batch(r, step) for r in range(WORLD)))
        loss = lm_loss(module(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        if step == 0:
            grads = [p.grad.clone() for p in module.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": grads, "params": [p.detach().clone() for p in module.parameters()]}


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).float().norm() ** 2) for x, y in zip(a, b)) ** 0.5
    return num / sum(float(y.float().norm() ** 2) for y in b) ** 0.5


def test_fp32_codec_matches_plain_fsdp2_and_one_process(results):
    ref = _single_process()
    for r in results:
        plain, fp32 = r["plain"], r["fp32"]
        for a, b in zip(fp32["grads"], plain["grads"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for a, b in zip(fp32["params"], plain["params"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for a, b in zip(fp32["grads"], ref["grads"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(fp32["params"], ref["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    mean_losses = [sum(r["fp32"]["losses"][s] for r in results) / WORLD for s in range(STEPS)]
    assert mean_losses == pytest.approx(ref["losses"], rel=1e-5)


def test_blockwise8_gradients_close_and_training_works(results):
    for r in results:
        assert _rel(r["blockwise8"]["grads"], r["fp32"]["grads"]) < 0.02
        for a, b in zip(r["blockwise8"]["losses"], r["fp32"]["losses"]):
            assert abs(a - b) < 0.01 * b
        fit8, fit32 = r["fit8"], r["fit32"]
        assert fit8[-1] < 0.9 * fit8[0]
        assert abs(fit8[-1] - fit32[-1]) < 0.02 * fit32[-1]


def test_param_codec_forward_close_master_weights_exact(results):
    for r in results:
        exact = r["logits"]["exact"]
        # relative error of the logits of a 2-layer model whose weights all went through the codec:
        # e4m3 keeps 3 mantissa bits (up to 6% per weight), block-wise int8 about 0.4% of the block's max
        for spec, bound in (("fp8", 0.1), ("blockwise8", 0.03)):
            got = r["logits"][spec]
            err = float((got - exact).norm() / exact.norm())
            assert 0 < err < bound, (spec, err)  # compressed (not identical), yet close
            assert abs(r["param_loss"][spec] - r["param_loss"]["exact"]) < 0.01 * r["param_loss"]["exact"]
            assert r["shards_exact"][spec], spec
        # 8-bit weights: about a quarter of the fp32 all-gather bytes
        assert r["gather_bytes"]["blockwise8"] < 0.3 * r["gather_bytes"]["none"]
        assert r["gather_bytes"]["fp8"] < 0.3 * r["gather_bytes"]["none"]


def test_bytes_counted_equal_bytes_carried(results):
    for r in results:
        for key in ("bytes", "bytes8"):
            b = r[key]
            assert b["tally"] == b["counter"] > 0
            assert b["split"]["reduce_scatter"] + b["split"]["all_gather"] == b["counter"]
        # 8-bit gradients: ~1/4 of the fp32 reduce-scatter bytes, the all-gather unchanged
        assert r["bytes8"]["split"]["reduce_scatter"] < 0.27 * r["bytes"]["split"]["reduce_scatter"]
        assert r["bytes8"]["split"]["all_gather"] == r["bytes"]["split"]["all_gather"]


def test_accumulate_in_8bit_on_fsdp2(results):
    for r in results:
        exact, q = r["accum"]["fp32"], r["accum"]["blockwise8:block=256"]
        for a, b in zip(exact["got"], exact["ref"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert _rel(q["got"], q["ref"]) < 0.02
        assert exact["folded"] == q["folded"] == 3 * q["n_params"]
        assert 0.24 < q["held"] / q["fp32"] < 0.27
        assert exact["held"] == exact["fp32"]


def _errors_worker(rank: int, world: int) -> dict:
    """apply_fsdp with codecs that differ between the ranks, or that cannot be used: the error each rank gets."""
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=20))
    cases = {"grad_mismatch": {"grad_codec": ["blockwise8", "fp8"][rank]},
             "param_mismatch": {"param_codec": [None, "fp8"][rank]},
             "unknown": {"grad_codec": "blockwise9"},
             "stateful": {"param_codec": "aqsgd"}}
    out = {}
    for key, kw in cases.items():
        try:
            apply_fsdp(_stage(), group, **kw)
            out[key] = "no error"
        except (CodecError, FSDPError) as e:
            out[key] = f"{type(e).__name__}: {e}"
    return out


def test_mismatched_codecs_fail_at_startup_and_bad_specs_are_clear():
    res = run_distributed(_errors_worker, WORLD, timeout=40.0)
    for r in res:
        for key in ("grad_mismatch", "param_mismatch"):
            msg = r[key]
            assert msg.startswith("CodecError") and "ranks disagree" in msg, msg
            assert "rank 0" in msg and "rank 1" in msg
        assert r["unknown"].startswith("CodecError") and "blockwise9" in r["unknown"]
        assert r["stateful"].startswith("FSDPError") and "stateful" in r["stateful"]


def test_decoder_blocks_of_models_and_stages():
    from transformers import AutoModelForCausalLM, GPT2Config

    stage = _stage()
    assert len(decoder_blocks(stage)) == 2
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64))
    assert len(decoder_blocks(gpt2)) == 3
    assert [type(b).__name__ for b in decoder_blocks(split_model(gpt2, 3)[1])] == ["GPT2Block"]
    assert decoder_blocks(torch.nn.Linear(2, 2)) == []


def test_a_sharded_module_whose_own_parameters_have_two_dtypes_is_refused_naming_them():
    """FSDP2 needs one dtype per sharded group: its AssertionError came at the first forward."""
    from qwire.parallel.fsdp import _check_one_dtype_per_module

    stage = _stage()
    blocks = decoder_blocks(stage)
    blocks[0].bfloat16()  # a block of its own dtype is sharded on its own: fine
    _check_one_dtype_per_module(stage, [*blocks, stage])
    head = [m for m in stage.modules() if m not in blocks and any(True for _ in m.parameters(recurse=False))][-1]
    head.bfloat16()  # ... a module the root shards together with fp32 ones is not
    with pytest.raises(FSDPError, match=r"FSDP shards the parameters of 'CausalLMStage' as one group, which needs one "
                                        r"dtype, but they are bfloat16 \(lm_head.weight, ...\) and float32 \(model"):
        _check_one_dtype_per_module(stage, [*blocks, stage])


def test_apply_fsdp_needs_an_initialized_group():
    with pytest.raises(FSDPError, match="init_process_group"):
        apply_fsdp(torch.nn.Linear(2, 2))


def test_fsdp_inside_a_pipeline_stage(results):
    module = _stage()
    xs, ys = zip(*(_batch(r, 20) for r in range(WORLD)))
    lm_loss(module(torch.cat(xs)), torch.cat(ys)).backward()
    for r in results:
        for case, grads in r["pipeline"].items():
            for a, p in zip(grads, module.parameters()):
                torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7, msg=case)


def _tp_worker(rank: int, world: int) -> dict:
    """dp=2 x tp=2: qwire's TP styles on mesh["tp"], apply_fsdp on mesh["dp"] of the same mesh (torchtitan's 2-D)."""
    from torch.distributed.device_mesh import init_device_mesh

    from qwire.parallel.tp import apply_tp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for spec in ("fp32", "blockwise8"):
        module = _stage()
        apply_tp(module, mesh["tp"], codec="fp32")
        apply_fsdp(module, mesh["dp"], grad_codec=spec)
        x, y = _batch(mesh["dp"].get_local_rank(), 30)
        lm_loss(module(x), y).backward()
        out[spec] = [p.grad.full_tensor() for p in module.parameters()]
    return out


@pytest.mark.slow
def test_fsdp_with_tensor_parallel_on_a_2d_mesh():
    res = run_distributed(_tp_worker, 4, timeout=TIMEOUT)
    module = _stage()
    xs, ys = zip(*(_batch(d, 30) for d in range(2)))
    lm_loss(module(torch.cat(xs)), torch.cat(ys)).backward()
    ref = [p.grad for p in module.parameters()]
    for r in res:
        for a, b in zip(r["fp32"], ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert _rel(r["blockwise8"], ref) < 0.02
