"""LAAQ saved-tensor compression: exactness when nothing is quantized, bounded gradient error otherwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qwire.memory import LAAQPolicy, activation_unit, apply_laaq, in_flight, laaq, stage_bits

transformers = pytest.importorskip("transformers")

B, S, H = 2, 32, 64


def _llama(impl: str = "eager") -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   attn_implementation=impl)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(1))


def _grads(model: nn.Module, policy: LAAQPolicy | None):
    model.zero_grad(set_to_none=True)
    ids = _ids()
    if policy is None:
        loss = model(input_ids=ids, labels=ids).loss
        session = None
    else:
        with laaq(model, policy) as session:
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()  # after the block: packed tensors still unpack
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()], session


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).norm() ** 2) for x, y in zip(a, b))
    return (num / sum(float(y.norm() ** 2) for y in b)) ** 0.5


@pytest.fixture(scope="module")
def model_and_ref():
    m = _llama()
    return m, _grads(m, None)


@pytest.mark.parametrize("policy", [
    LAAQPolicy(fmt="none"),
    LAAQPolicy(min_numel=1 << 40),  # everything "small": nothing quantized
    LAAQPolicy(fmt="none", recompute=(r"mlp$",)),  # recomputation of the exact input is exact
], ids=["none", "all-small", "none+recompute"])
def test_full_precision_policy_is_bit_exact(model_and_ref, policy):
    m, (loss_ref, g_ref, _) = model_and_ref
    loss, g, s = _grads(m, policy)
    assert loss == loss_ref
    assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
    assert s.stats.counts["quantized"] == 0
    assert s.stats.live_bytes == 0  # everything released after backward


# Stated error: relative L2 error of the full gradient vector of one step, on the tiny Llama.
@pytest.mark.parametrize("policy,tol", [
    (LAAQPolicy(bits=8, fmt="int"), 0.02),
    (LAAQPolicy(bits=8, fmt="fp"), 0.05),
    (LAAQPolicy(bits=4, fmt="int"), 0.25),
    (LAAQPolicy(bits=4, fmt="fp"), 0.35),
    (LAAQPolicy(bits=4, fmt="fp", recompute=(r"mlp$",)), 0.35),
], ids=["int8", "fp8", "int4", "fp4", "fp4+recompute"])
def test_quantized_gradients_within_stated_error(model_and_ref, policy, tol):
    m, (loss_ref, g_ref, _) = model_and_ref
    loss, g, s = _grads(m, policy)
    assert loss == loss_ref  # forward is untouched
    assert s.stats.counts["quantized"] > 0
    assert 0 < _rel(g, g_ref) < tol


def test_attention_kept_and_memory_accounted(model_and_ref):
    m, _ = model_and_ref
    U = activation_unit(B, S, H)
    _, _, full = _grads(m, LAAQPolicy(fmt="none"))
    _, _, agoq = _grads(m, LAAQPolicy())
    _, _, uniform = _grads(m, LAAQPolicy(keep_attention=False))
    layers = ["model.layers.0", "model.layers.1"]
    for name in layers:
        assert agoq.stats.stored[name]["attention"] > 0
        assert uniform.stats.stored[name]["attention"] == 0
        assert full.stats.stored[name]["quantized"] == 0
    assert set(agoq.stats.per_layer_units(U)) == set(layers)
    f, a, u = (x.stats.mean_layer_units(U) for x in (full, agoq, uniform))
    assert u < a < f
    # fp32 model: 4 bytes per kept element; 4.25 bits per quantized one
    assert a < 0.6 * f and u < 0.25 * f
    assert agoq.stats.peak_bytes < full.stats.peak_bytes
    # the raw size of what was saved is the same whatever the policy
    assert dict(agoq.stats.raw) == dict(full.stats.raw)


def test_outside_layers_kept_unless_asked(model_and_ref):
    m, (_, g_ref, _) = model_and_ref
    _, g_in, s_in = _grads(m, LAAQPolicy())
    _, g_all, s_all = _grads(m, LAAQPolicy(quantize_outside_layers=True))
    assert s_in.stats.stored["other"]["quantized"] == 0 and s_in.stats.stored["other"]["kept"] > 0
    assert s_all.stats.stored["other"]["quantized"] > 0
    # the loss's saved log-softmax is what hurts most at 4 bits
    assert _rel(g_in, g_ref) < _rel(g_all, g_ref)


def test_parameters_never_quantized():
    lin = nn.Linear(256, 256, bias=False)
    x = torch.randn(64, 256, requires_grad=True)
    (lin(x) ** 2).sum().backward()
    ref_x, ref_w = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.weight.grad = None
    with laaq(lin, LAAQPolicy(min_numel=0, quantize_outside_layers=True)) as s:
        y = lin(x)
    (y ** 2).sum().backward()  # outside the block: y is saved as usual
    # the linear saved x (quantized) and the weight (kept: it is a parameter)
    assert s.stats.counts["param"] == 1
    assert s.stats.counts["quantized"] == 1
    # x.grad = 2 y @ W needs only the weight: bit-exact proves it was not quantized
    assert torch.equal(x.grad, ref_x)
    # W.grad = 2 y^T x needs the quantized x
    assert not torch.equal(lin.weight.grad, ref_w)
    torch.testing.assert_close(lin.weight.grad, ref_w, rtol=0, atol=0.2 * float(ref_w.abs().max()))
    with laaq(lin, LAAQPolicy(min_numel=0)) as s:
        assert s._pack(lin.weight) is lin.weight


def test_weights_gathered_into_new_storage_for_the_forward_are_parameters_too():
    """FSDP2 all-gathers each module's weights into new storage before its forward: they were quantized as
    activations (twice the gradient error of the same model unsharded)."""
    lin = nn.Linear(256, 256, bias=False)

    def gather(mod: nn.Module, args: tuple) -> None:  # what FSDP2's pre-forward does to the parameter
        mod.weight = nn.Parameter(mod.weight.detach().clone())

    lin.register_forward_pre_hook(gather)
    x = torch.randn(64, 256, requires_grad=True)
    with laaq(lin, LAAQPolicy(min_numel=0, quantize_outside_layers=True)) as s:
        y = lin(x)
    (y ** 2).sum().backward()
    assert s.stats.counts["param"] == 1 and s.stats.counts["quantized"] == 1  # the weight; x


def test_a_kept_tensor_written_in_place_before_backward_raises_as_autograd_does():
    """A saved-tensor hook bypasses autograd's version check: the gradient came out of the overwritten values
    (0 instead of 577) with no error."""
    lin = nn.Linear(64, 64)
    h = torch.randn(64, 64, requires_grad=True)
    with laaq(lin, LAAQPolicy(fmt="none", quantize_outside_layers=True)):
        a = h * 1.0
        y = lin(a)
    a.mul_(0.0)  # the linear's saved input
    with pytest.raises(RuntimeError, match="modified by an inplace operation: a torch.float32 tensor of shape "
                                           r"\[64, 64\] that LAAQ kept as it was saved is at version 1"):
        y.sum().backward()


def test_integer_and_small_tensors_kept():
    emb = nn.Embedding(50, 8)
    ids = torch.randint(0, 50, (4, 5))
    with laaq(emb, LAAQPolicy(min_numel=0)) as s:
        emb(ids).sum().backward()
    assert s.stats.counts["nonfloat"] == 1  # embedding saved its indices as they are
    with laaq(nn.Identity(), LAAQPolicy(min_numel=100)) as s:
        t = torch.randn(10, requires_grad=True)
        (t.exp()).sum().backward()
    assert s.stats.counts["small"] == 1


def test_apply_laaq_on_a_stage_and_remove():
    m = _llama()
    stage = m.model.layers[0]
    keys = list(stage.state_dict())
    hidden = torch.randn(B, S, H)
    pos = m.model.rotary_emb(hidden, torch.arange(S).unsqueeze(0))

    def run():
        outs = []
        for i in range(2):  # two micro-batches in flight, backward later
            h = (hidden * (i + 1)).requires_grad_()
            outs.append(stage(h, position_embeddings=pos))
        sum(o.float().pow(2).mean() for o in outs).backward()
        return [p.grad.clone() for p in stage.parameters()]

    ref = run()
    stage.zero_grad(set_to_none=True)
    handle = apply_laaq(stage, LAAQPolicy(fmt="none"))
    assert torch.equal(torch.cat([g.flatten() for g in run()]), torch.cat([g.flatten() for g in ref]))
    assert handle.stats.counts["kept"] > 0
    stage.zero_grad(set_to_none=True)
    handle.remove()
    with pytest.warns(UserWarning, match="layer_pattern"):  # a bare layer: no "layers.N" inside
        handle = apply_laaq(stage, LAAQPolicy(bits=4))
        run()
    assert handle.stats.counts["quantized"] == 0
    handle.remove()
    stage.zero_grad(set_to_none=True)
    handle = apply_laaq(stage, LAAQPolicy(bits=4, quantize_outside_layers=True))
    g4 = run()
    assert handle.stats.counts["quantized"] > 0 and 0 < _rel(g4, ref) < 0.35
    handle.remove()
    assert list(stage.state_dict()) == keys
    assert all(not mod._forward_pre_hooks and not mod._forward_hooks for mod in stage.modules())
    assert all("forward" not in mod.__dict__ for mod in stage.modules())


def test_recompute_refuses_dropout():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)))
    with pytest.raises(ValueError, match="dropout"), laaq(model, LAAQPolicy(recompute=(r"^0$",))):
        pass


def test_stage_bits_rule():
    assert in_flight(4) == [4, 3, 2, 1]
    assert in_flight(4, "1f1b", n_microbatches=2) == [2, 2, 2, 1]
    assert in_flight(3, "gpipe", n_microbatches=8) == [8, 8, 8]
    # b_i = max(4, 4 * N_1 / N_i) = 4, 5.33, 8, 16
    assert stage_bits(4) == [4, 5, 8, 8]  # floor, capped at 8 bits
    assert stage_bits(4, max_bits=16) == [4, 5, 8, 16]
    assert stage_bits(4, rounding="ceil") == [4, 6, 8, 8]
    assert stage_bits(4, n_microbatches=2) == [4, 4, 4, 8]
    assert stage_bits(4, "gpipe") == [4, 4, 4, 4]
    # floor keeps every stage's in-flight bits at or below stage 0's
    for p in range(1, 9):
        n, b = in_flight(p), stage_bits(p, max_bits=64)
        assert all(ni * bi <= n[0] * b[0] for ni, bi in zip(n, b))
    pol = LAAQPolicy().for_stage(2, 4)
    assert pol.bits == 8 and pol.codec().spec() == "blockfp:bits=8,block=128"
    with pytest.raises(ValueError):
        stage_bits(4, "zigzag")


def test_policy_validation():
    assert LAAQPolicy(fmt="int4").fmt == "int"
    assert LAAQPolicy(fmt="fp4").codec().spec() == "blockfp:bits=4,block=128"
    with pytest.raises(ValueError):
        LAAQPolicy(fmt="nf4")
    with pytest.raises(ValueError):
        LAAQPolicy(bits=9)
