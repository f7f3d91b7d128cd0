"""Compressed tensor parallelism on a tiny Hugging Face Llama, gloo on CPU.

One gloo group per test runs every check (starting workers that import
transformers is the expensive part); assertions fail inside the workers and
come back with their tracebacks.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from qwire.parallel.tp import (
    CompressedColwiseParallel,
    CompressedPrepareModuleInput,
    CompressedRowwiseParallel,
    TPConfigError,
    llama_tp_plan,
)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


def _tiny_llama(seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = {**TINY, "attn_implementation": "eager", **overrides}
    return LlamaForCausalLM(LlamaConfig(**cfg))


def _batch(seq: int = 8) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(5))


def _compare_with_single_process(rank: int, world: int, codec: str, sequence_parallel: bool,
                                 **overrides) -> dict:
    """Loss and every gradient of the TP model vs. the same model on one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from qwire.parallel.tp import apply_tp

    ids = _batch()
    ref = _tiny_llama(**overrides)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    model = _tiny_llama(seed=100 + rank, **overrides)  # deliberately different: apply_tp syncs from rank 0
    if rank == 0:
        model.load_state_dict(ref.state_dict())
    apply_tp(model, init_device_mesh("cpu", (world,)), codec, sequence_parallel=sequence_parallel)
    with CommDebugMode() as comm:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    worst = 0.0
    for n, p in model.named_parameters():
        g = p.grad
        assert isinstance(p, DTensor) and isinstance(g, DTensor), n  # every parameter is a DTensor
        (pl,) = g.placements
        assert pl.is_shard() or pl.is_replicate(), (n, pl)
        want = ref_grads[n].chunk(world, pl.dim)[rank] if pl.is_shard() else ref_grads[n]
        g = g.to_local()
        assert g.shape == want.shape, n
        worst = max(worst, float((g - want).abs().max()))
    return {"ref_loss": float(ref_loss), "loss": float(loss), "worst_grad_err": worst, "comm": counts}


def _train(rank: int, world: int, codec: str, steps: int, sequence_parallel: bool = False) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    from qwire.parallel.tp import apply_tp

    model = _tiny_llama()
    apply_tp(model, init_device_mesh("cpu", (world,)), codec, sequence_parallel=sequence_parallel)
    # foreach optimizer paths and clip_grad_norm_ work because every parameter is a DTensor
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=True)
    ids = _batch()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        assert torch.isfinite(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        opt.step()
        losses.append(loss.item())
    return losses


def _bad_configs(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from qwire.codecs import CodecError
    from qwire.parallel.tp import apply_tp

    mesh = init_device_mesh("cpu", (world,))
    msgs = []
    cases = [
        (lambda: apply_tp(_tiny_llama(num_key_value_heads=1), mesh, "fp8"), TPConfigError,
         "num_key_value_heads=1 is not divisible by the tensor-parallel size 2"),
        (lambda: apply_tp(_tiny_llama(num_attention_heads=1, num_key_value_heads=1), mesh), TPConfigError,
         "num_attention_heads=1"),
        (lambda: apply_tp(_tiny_llama(), mesh, "fp8:group=100"), CodecError, "power of two"),
        (lambda: apply_tp(_tiny_llama().double(), mesh, "fp8"), TPConfigError, "float32, bfloat16 or float16"),
        # ranks that disagree on the codec are caught at setup, with both specs named
        (lambda: apply_tp(_tiny_llama(), mesh, f"fp8:format={'e4m3' if rank == 0 else 'e5m2'}"), CodecError,
         "rank 1: fp8:format=e5m2"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match) as info:
            call()
        msgs.append(str(info.value))
    # sequence parallelism needs a sequence length divisible by the TP size
    model = apply_tp(_tiny_llama(), mesh, "fp32", sequence_parallel=True)
    with pytest.raises(Exception, match="divisible|evenly"):
        model(input_ids=_batch(seq=7))
    return msgs


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**TINY, attn_implementation="eager"))  # q/k/v have biases


def _tiny_hf(model_type: str, **overrides):
    """A tiny decoder of another Llama-like family (Qwen3: a norm on each query and key head; Mistral)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, "head_dim": 16,
                                                                              "attn_implementation": "eager",
                                                                              **overrides}))


def _variants(rank: int, world: int) -> dict:
    """sdpa attention, tied embeddings, Qwen2, Qwen3, Mistral: loss and total gradient norm as on one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from qwire.parallel.tp import apply_tp

    ids = _batch()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, make in (("sdpa", lambda: _tiny_llama(attn_implementation="sdpa")),
                       ("tied", lambda: _tiny_llama(tie_word_embeddings=True)),
                       ("qwen2", _tiny_qwen2), ("qwen3", lambda: _tiny_hf("qwen3")),
                       ("mistral", lambda: _tiny_hf("mistral", sliding_window=4))):
        ref = make()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
        model = apply_tp(make(), mesh, "fp32")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if name == "tied":
            assert model.lm_head.weight is model.model.embed_tokens.weight
        out[name] = (float(ref_loss), float(loss), float(ref_norm), float(norm))
    # checkpoints: the full state dict of a TP model is the single-process one, and loads back
    from qwire.parallel.tp import full_state_dict, load_full_state_dict

    ref = _tiny_llama()
    sd = full_state_dict(apply_tp(_tiny_llama(), mesh, "fp32"))
    assert sd.keys() == ref.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    other = apply_tp(_tiny_llama(seed=7), mesh, "fp32")
    load_full_state_dict(other, sd)
    key = "model.layers.0.mlp.up_proj.weight"
    for bad, match in (({**sd, "extra.weight": torch.zeros(1)}, r"the model has no 1 entries, e.g. \['extra.weight'\]"),
                       ({**sd, key: sd[key][:, :-1]}, f"state dict entry '{key}' has shape")):
        with pytest.raises((KeyError, ValueError), match=match):  # (a wider tensor was a bare size mismatch)
            load_full_state_dict(other, bad)
    with torch.no_grad():
        out["reload"] = (float(ref(input_ids=ids, labels=ids).loss), float(other(input_ids=ids, labels=ids).loss),
                         0.0, 0.0)
    return out


def _tp2_worker(rank: int, world: int) -> dict:
    return {
        "variants": _variants(rank, world),
        "fp32": _compare_with_single_process(rank, world, "fp32", False),
        "fp32_sp": _compare_with_single_process(rank, world, "fp32", True),
        "fp8": _compare_with_single_process(rank, world, "fp8", False),
        "train_fp8": _train(rank, world, "fp8", 20),
        "train_fp8_sp": _train(rank, world, "fp8:format=e5m2", 5, sequence_parallel=True),
        "errors": _bad_configs(rank, world),
    }


@pytest.mark.slow
def test_tp2_matches_single_process_and_trains():
    res = run_distributed(_tp2_worker, 2, timeout=120)
    r0 = res[0]
    assert set(r0["variants"]) == {"sdpa", "tied", "qwen2", "qwen3", "mistral", "reload"}
    for name, (ref_loss, loss, ref_norm, norm) in r0["variants"].items():
        assert loss == pytest.approx(ref_loss, abs=1e-5), name
        assert norm == pytest.approx(ref_norm, rel=1e-5), name
    for key in ("fp32", "fp32_sp"):
        assert r0[key]["loss"] == pytest.approx(r0[key]["ref_loss"], abs=1e-5)
        assert r0[key]["worst_grad_err"] < 1e-5, (key, r0[key])
    # plain TP: one compressed all-reduce after each of o/down (forward) and one per block input
    # (backward): 2 layers x 4 = 8 all-to-all + 8 all-gather steps, nothing uncompressed.
    assert r0["fp32"]["comm"] == {"c10d.alltoall_base_": 8, "c10d._allgather_base_": 8}
    # sequence parallel: 4 reduce-scatters + 4 all-gathers per direction, plus the norms' weight
    # gradients (4 all-reduces) and the gathered final norm input.
    sp = r0["fp32_sp"]["comm"]
    assert set(sp) == {"c10d.alltoall_base_", "c10d._allgather_base_"}
    assert r0["fp8"]["loss"] == pytest.approx(r0["fp8"]["ref_loss"], rel=1e-2)
    for key in ("train_fp8", "train_fp8_sp"):
        losses = r0[key]
        assert all(torch.isfinite(torch.tensor(losses)))
        assert losses[-1] < losses[0]
    assert r0["train_fp8"][-1] < 0.5 * r0["train_fp8"][0]
    # every rank computed the same replicated loss (bit-identical all-reduces)
    assert res[1]["train_fp8"] == r0["train_fp8"]
    assert res[1]["fp32"]["loss"] == r0["fp32"]["loss"]
    assert len(r0["errors"]) == 5


def _fp32_both(rank: int, world: int, **overrides) -> dict:
    """fp32 TP without and with sequence parallelism, each against the single-process model."""
    return {"fp32": _compare_with_single_process(rank, world, "fp32", False, **overrides),
            "fp32_sp": _compare_with_single_process(rank, world, "fp32", True, **overrides)}


def _assert_both_match(res: list[dict]) -> None:
    for r in res:
        for key in ("fp32", "fp32_sp"):
            assert r[key]["loss"] == pytest.approx(r[key]["ref_loss"], abs=1e-5)
            assert r[key]["worst_grad_err"] < 1e-5, (key, r[key])


def _without_grad_placements_worker(rank: int, world: int) -> dict:
    """As on torch 2.11, whose DTensor.from_local has no ``grad_placements``: qwire's own autograd operator
    hands the gradient back as the keyword would."""
    import qwire.parallel.tp as tp

    tp._FROM_LOCAL_GRAD = False
    return _fp32_both(rank, world)


@pytest.mark.slow
def test_tp_without_from_locals_grad_placements_matches_single_process():
    res = run_distributed(_without_grad_placements_worker, 2, timeout=120)
    _assert_both_match(res)
    # still nothing uncompressed: no all-reduce of a Partial gradient by DTensor
    assert res[0]["fp32"]["comm"] == {"c10d.alltoall_base_": 8, "c10d._allgather_base_": 8}
    assert set(res[0]["fp32_sp"]["comm"]) == {"c10d.alltoall_base_", "c10d._allgather_base_"}


def _tp4_worker(rank: int, world: int) -> dict:
    return _fp32_both(rank, world, num_key_value_heads=4)


@pytest.mark.slow
def test_tp4_matches_single_process():
    _assert_both_match(run_distributed(_tp4_worker, 4, timeout=120))


def test_plan_shape_and_static_errors():
    model = _tiny_llama()
    plan = llama_tp_plan(model, "fp8", tp_size=2)
    assert isinstance(plan["model.layers.0.self_attn.q_proj"], CompressedColwiseParallel)
    assert isinstance(plan["model.layers.1.mlp.down_proj"], CompressedRowwiseParallel)
    assert isinstance(plan["model.layers.1.mlp"], CompressedPrepareModuleInput)
    assert plan["model.layers.0.self_attn.o_proj"].codec.spec() == "fp8:format=e4m3,group=128,hadamard=true"
    assert len(plan) == 2 * 9
    sp = llama_tp_plan(model.model, "fp8", tp_size=2, sequence_parallel=True)  # bare LlamaModel: no prefix
    assert "layers.0" in sp and "norm" in sp and "layers.1.input_layernorm" in sp
    with pytest.raises(TPConfigError, match="num_key_value_heads=2 is not divisible by the tensor-parallel size 4"):
        llama_tp_plan(model, tp_size=4)
    with pytest.raises(TPConfigError, match="intermediate_size"):
        llama_tp_plan(_tiny_llama(intermediate_size=126, num_key_value_heads=4), tp_size=4)
    with pytest.raises(TPConfigError, match="no decoder layer list"):
        llama_tp_plan(torch.nn.Linear(2, 2))
    with pytest.raises(TPConfigError, match="Shard\\(-1\\) or Replicate"):
        from torch.distributed.tensor import Shard
        CompressedColwiseParallel(output_layouts=Shard(0))
    with pytest.raises(TPConfigError, match="use_local_output"):
        CompressedRowwiseParallel(use_local_output=False)
    from qwire.codecs import CodecError
    with pytest.raises(CodecError, match="power of two"):
        CompressedColwiseParallel(codec="fp8:group=48")
