"""AQ-SGD: per-sample caches on both sides of a boundary."""

from __future__ import annotations

import pytest
import torch

from qwire.codecs import CodecError, get_codec


def _pair(spec: str = "aqsgd"):
    return get_codec(spec), get_codec(spec)


def test_sender_and_receiver_caches_stay_identical_over_epochs() -> None:
    send, recv = _pair("aqsgd:inner=int4")
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 16, 64, generator=g)
    for epoch in range(4):
        for batch in (torch.tensor([0, 3]), torch.tensor([5, 1]), torch.tensor([2, 4])):
            x = base[batch] + 0.05 * epoch * torch.randn(2, 16, 64, generator=g)  # activations drift slowly
            payload = send.encode(x, sample_ids=batch)
            assert payload.numel() == send.payload_nbytes(x.shape, x.dtype)
            y = recv.decode(payload, x.shape, x.dtype, sample_ids=batch)
            assert y.shape == x.shape and y.dtype == x.dtype
    assert set(send.cache) == set(recv.cache) == set(range(6))
    for k in send.cache:
        assert torch.equal(send.cache[k], recv.cache[k])


def test_error_shrinks_when_samples_come_back() -> None:
    send, recv = _pair("aqsgd:inner=int3,cache_dtype=fp32")
    x = torch.randn(4, 8, 128, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(4)
    errs = []
    for _ in range(3):  # same activation each visit: the delta shrinks, so does the error
        y = recv.decode(send.encode(x, sample_ids=ids), x.shape, x.dtype)
        errs.append(float((y - x).pow(2).mean()))
    assert errs[1] < errs[0] / 10 and errs[2] <= errs[1]


def test_first_visit_is_direct_quantization() -> None:
    send, recv = _pair("aqsgd:inner=int4,cache_dtype=fp32")
    x = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(2))
    y = recv.decode(send.encode(x, sample_ids=[7, 9]), x.shape, x.dtype)
    direct = get_codec("int4")
    torch.testing.assert_close(y, direct.decode(direct.encode(x), x.shape, x.dtype))


def test_lossless_inner_codec_reproduces_the_input() -> None:
    send, recv = _pair("aqsgd:inner=fp32,cache_dtype=fp32")
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(3, 5, 32, generator=g)
        y = recv.decode(send.encode(x, sample_ids=[0, 1, 2]), x.shape, x.dtype)
        # x = m + (x - m) holds to float rounding (exactly when m and x are within a factor of 2)
        torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6)


def test_cache_memory_is_reported() -> None:
    send = get_codec("aqsgd")
    x = torch.randn(2, 16, 64)
    send.encode(x, sample_ids=[0, 1])
    assert send.per_sample_nbytes(x.shape) == 16 * 64 * 2  # fp16
    assert send.cache_nbytes() == 2 * 16 * 64 * 2


def test_missing_or_mismatched_sample_ids_are_clear_errors() -> None:
    send, recv = _pair()
    x = torch.randn(2, 4, 32)
    with pytest.raises(CodecError, match="pass sample_ids"):
        send.encode(x)
    with pytest.raises(CodecError, match="2 rows$"):
        send.encode(x, sample_ids=[1, 2, 3])
    with pytest.raises(CodecError, match="2 rows; in a pipeline schedule's step.., pass them as a tensor"):
        send.encode(x, sample_ids=[1, 2, 3, 4])  # the whole batch's ids, as a list the schedule did not split
    payload = send.encode(x, sample_ids=[1, 2])
    with pytest.raises(CodecError, match="expected"):
        recv.decode(payload, x.shape, x.dtype, sample_ids=[2, 1])
    with pytest.raises(CodecError, match="cannot be aqsgd"):
        get_codec("aqsgd:inner=aqsgd")


def test_what_a_user_can_get_wrong_is_a_codec_error_naming_it(tmp_path):
    """Each of these ended in a raw IndexError, RuntimeError, ValueError or FileNotFoundError from inside."""
    c = get_codec("aqsgd")
    with pytest.raises(CodecError, match="a 0-d tensor has no rows"):
        c.encode(torch.tensor(1.0), sample_ids=[0])
    with pytest.raises(CodecError, match="sample ids must be integers that fit in int64"):
        c.encode(torch.randn(2, 64), sample_ids=[2**70, 1])
    for spec in ("aqsgd", "aqsgd:cache_dtype=int8"):
        c = get_codec(spec)
        c.encode(torch.randn(2, 64), sample_ids=[0, 1])
        with pytest.raises(CodecError, match=r"sample 0 is cached with a row of .*, this call's rows are \(32,\): a "
                                             "sample's activation must keep its shape"):
            c.encode(torch.randn(2, 32), sample_ids=[0, 1])
    (tmp_path / "afile").write_text("")
    with pytest.raises(CodecError, match=f"store=mmap cannot keep its cache file in dir={tmp_path}/afile/x"):
        get_codec(f"aqsgd:store=mmap,dir={tmp_path}/afile/x")
    with pytest.raises(CodecError, match="parameter bits=inf is not a valid int"):
        get_codec("int", bits=float("inf"))


def test_a_cache_state_loads_into_a_codec_whose_cache_holds_the_same_kind_of_rows(tmp_path) -> None:
    """A state of another cache_dtype blamed the activation's shape ('must keep its shape from epoch to epoch')
    at the next encode; fp32 rows loaded into an mmap fp16 cache failed there too."""
    x, ids = torch.randn(4, 64), [0, 1, 2, 3]
    saved = {}
    for spec in ("aqsgd:cache_dtype=int8", "aqsgd:cache_dtype=fp32"):
        c = get_codec(spec)
        c.encode(x, sample_ids=ids)
        saved[spec] = c.state_dict()
    with pytest.raises(CodecError, match="the state's cached rows are int8 .payloads., this codec's cache_dtype is "
                                         "fp16: load it into an aqsgd with the cache_dtype that saved it"):
        get_codec("aqsgd").load_state_dict(saved["aqsgd:cache_dtype=int8"])
    mm = get_codec(f"aqsgd:store=mmap,dir={tmp_path}")
    mm.load_state_dict(saved["aqsgd:cache_dtype=fp32"])  # fp32 rows into an fp16 cache: cast
    mm.encode(x, sample_ids=ids)
    with pytest.raises(CodecError, match=r"a cache state is \{'ids': ..., 'rows': ...\}"):
        get_codec("aqsgd").load_state_dict({"foo": torch.zeros(1)})
