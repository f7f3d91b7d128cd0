"""`auto`: the codec that is one candidate at a time, and the controllers that choose each pipeline
boundary's codec and the data- and tensor-parallel collectives' codecs from the measured link, codec cost
and error budget."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed, tiny_model_env
from qwire.codecs import CodecError, get_codec
from qwire.codecs.auto import Auto, auto_for
from qwire.parallel.autotune import Link, choose, measure, size_threshold
from qwire.train import TrainConfig, launch


def test_auto_spec_candidates_and_switching() -> None:
    a = get_codec("auto:candidates=int8+tahquant,max_nmse=0.01")
    assert isinstance(a, Auto) and a.labels == ["fp32", "int8", "tahquant"]  # fp32 is always a candidate
    assert get_codec(a.spec()) == a  # the spec round-trips
    x = torch.randn(4, 64, 96)
    assert a.payload_nbytes(x.shape, x.dtype) == x.numel() * 4  # before any decision: the first candidate
    assert torch.equal(a.decode(a.encode(x), x.shape, x.dtype), x)
    int8 = get_codec("int8")
    a.switch(int8.spec())
    assert a.label(a.in_force()) == "int8"
    p = a.encode(x)
    assert p.numel() == a.payload_nbytes(x.shape, x.dtype) == int8.payload_nbytes(x.shape, x.dtype)
    assert torch.equal(p, int8.encode(x))
    assert torch.equal(a.decode(p, x.shape, x.dtype), int8.decode(p, x.shape, x.dtype))
    assert a.max_payload_nbytes(x.shape, x.dtype) == x.numel() * 4
    with pytest.raises(CodecError, match="not one of its candidates"):
        a.switch("fp16")


@pytest.mark.parametrize("spec,needle", [
    ("auto:candidates=int8+nosuch", "nosuch"),
    ("auto:candidates=aqsgd", "per-sample state"),
    ("auto:candidates=auto", "its own candidate"),
    ("auto:max_nmse=-1", "max_nmse"),
])
def test_auto_bad_specs(spec: str, needle: str) -> None:
    with pytest.raises(CodecError, match=needle):
        get_codec(spec)


@pytest.mark.parametrize("kw,needle", [
    ({"bwd_codec": "auto:link=fast"}, "^--bwd-codec: codec 'auto': link='fast' is not a rate"),
    ({"fwd_codec": "auto:rule=shape"}, "^--fwd-codec auto:rule=shape: rule=shape picks TACO's fp8 group shape"),
    ({"tp": 2, "tp_codec": "auto:rule=shape,candidates=fp32"}, "rule=shape chooses among the candidates other"),
    ({"fwd_codec": "auto:link=10gbit,probe_every=0", "bwd_codec": "auto:link=1mbit,probe_every=2"},
     r"their link must agree: link=10gbit, link=1mbit; give one value \(on one direction, it serves both\)"),
    # the default given on one direction was taken for not given: both assumed 100mbit, silently
    ({"fwd_codec": "auto:link=measured", "bwd_codec": "auto:link=100mbit"},
     r"their link must agree: link=100mbit, link=measured; give one value"),
    ({"fwd_codec": "auto:probe_every=100", "bwd_codec": "auto:probe_every=10"}, r"their probe_every must agree"),
])
def test_pipeline_auto_errors_name_the_option_and_rule_shape_is_checked(kw: dict, needle: str) -> None:
    """With auto on both directions the user could not tell which option was wrong; rule=shape was ignored on a
    pipeline boundary, and with fp32 alone it ended the ranks with min() of an empty sequence after step 1."""
    from qwire.config import TrainConfig

    with pytest.raises(ValueError, match=needle):
        TrainConfig(stages=2, **kw).validate()


def _cand(codec: str, nbytes: int, enc: float, dec: float, nmse: float) -> dict:
    return {"codec": codec, "bytes": nbytes, "encode_s": enc, "decode_s": dec, "nmse": nmse}


CANDS = [_cand("fp32", 4_000_000, 0.0001, 0.0001, 0.0), _cand("fp16", 2_000_000, 0.001, 0.001, 1e-7),
         _cand("int8", 1_000_000, 0.004, 0.003, 3e-5), _cand("tahquant", 550_000, 0.02, 0.01, 0.012)]


def test_choose_follows_the_link_and_the_budget() -> None:
    slow, fast = Link(12.5e6 / 8, 0.01, "probe"), Link(10e9 / 8, 1e-5, "probe")  # 12.5 Mbit/s, 10 Gbit/s
    assert choose(CANDS, slow, 4, 0.02, 0.05, "fp32")["codec"] == "tahquant"
    assert choose(CANDS, slow, 4, 1e-3, 0.05, "fp32")["codec"] == "int8"      # tahquant is over the budget
    assert choose(CANDS, slow, 4, 1e-9, 0.05, "fp32")["codec"] == "fp32"      # only exact codecs qualify
    assert choose(CANDS, fast, 4, 0.02, 0.05, "tahquant")["codec"] == "fp32"  # compression does not pay
    # hysteresis: a candidate predicted faster by less than min_gain does not replace the codec in force
    near = [_cand("fp32", 1000, 0.0100, 0, 0.0), _cand("fp16", 500, 0.0098, 0, 1e-7)]
    assert choose(near, None, 1, 0.02, 0.05, "fp32")["codec"] == "fp32"
    assert choose(near, None, 1, 0.02, 0.0, "fp32")["codec"] == "fp16"
    got = choose(CANDS, slow, 4, 0.02, 0.05, "fp32")
    want = 4 * (0.02 + 0.01 + 550_000 / (12.5e6 / 8) + 0.01)
    assert math.isclose(got["predicted_s"], want) and got["predicted_s"] < got["predicted_fp32_s"]


def test_a_near_tie_goes_to_the_candidate_with_the_lower_error() -> None:
    """The forward boundary of the network lab's 200 Mbit/s link (autotune.jsonl of a 2-stage llama-micro run):
    tahquant predicted 6.73 ms per step, int8 6.96 ms, 3% apart, and either runs the faster depending on the run.
    Within min_gain of the fastest, the codec in force stays; otherwise the lowest error wins; a clear gain still
    goes to the fastest."""
    cands = [_cand("fp32", 131_072, 0.0000315, 0.0000369, 0.0), _cand("fp16", 65_536, 0.0000307, 0.0000313, 4.4e-8),
             _cand("int8", 34_820, 0.000166, 0.000114, 2.4e-5), _cand("tahquant", 18_052, 0.000614, 0.000290, 5.4e-3)]
    link = Link(24.6e6, 4.6e-5, "probe")
    got = choose(cands, link, 4, 0.02, 0.05, "fp32")
    assert got["codec"] == "int8" and got["predicted_s"] == pytest.approx(0.00696, rel=0.01)
    assert choose(cands, link, 4, 0.02, 0.05, "tahquant")["codec"] == "tahquant"  # in force and tied: stays
    assert choose(cands, link, 4, 0.02, 0.0, "fp32")["codec"] == "tahquant"      # no tie band: the fastest
    assert choose(cands, link, 4, 0.02, 0.05, "int8")["codec"] == "int8"
    slow = Link(6.2e6, 4.6e-5, "probe")  # 50 Mbit/s: tahquant is a third faster, not a tie
    assert choose(cands, slow, 4, 0.02, 0.05, "int8")["codec"] == "tahquant"


def test_the_pipeline_hides_transfers_behind_the_compute_of_the_other_micro_batches() -> None:
    """predict(hide_s=...): only the first of the micro-batches' transfers and what each later one takes beyond
    the per-micro-batch compute add to the step. The lab's 1 Gbit/s link (about 900 Mbit/s probed) with
    llama-micro's boundary (128 KiB in fp32, int8 a quarter of it at 0.55 ms of codec time, 8 ms of compute
    per micro-batch): counting every transfer favours int8; hiding them keeps fp32, which ran faster there.
    On a 20 Mbit/s link the transfers outlast the compute and compression still wins."""
    from qwire.parallel.autotune import predict

    one = _cand("x", 1_000_000, 0.0, 0.0, 0.0)
    link = Link(1e9, 0.0, "probe")  # 1 ms per micro-batch
    assert predict(one, link, 4) == pytest.approx(0.004) and predict(one, link, 4, hide_s=0.005) == pytest.approx(0.001)
    slow = Link(1e8, 0.0, "probe")  # 10 ms per micro-batch, 5 ms hidden for each after the first
    assert predict(one, slow, 4, hide_s=0.005) == pytest.approx(0.010 + 3 * 0.005)
    pair = [_cand("fp32", 131_072, 0.00003, 0.00004, 0.0), _cand("int8", 34_820, 0.0003, 0.00025, 2.5e-5)]
    gbit = Link(900e6 / 8, 0.0, "probe")
    assert choose(pair, gbit, 4, 0.02, 0.05, "fp32")["codec"] == "int8"
    got = choose(pair, gbit, 4, 0.02, 0.05, "fp32", hide_s=0.008)
    assert got["codec"] == "fp32" and got["predicted_s"] == pytest.approx(4 * 0.00007 + 131_072 / (900e6 / 8))
    assert choose(pair, Link(20e6 / 8, 0.0, "probe"), 4, 0.02, 0.05, "fp32", hide_s=0.008)["codec"] == "int8"


def test_only_a_schedule_that_overlaps_its_sends_hides_transfers() -> None:
    """gpipe sends while it computes the next micro-batches: the slower side's chunk time is hidden (none while a
    side is unknown); 1f1b waits for each send before its next chunk: nothing is. At 200 Mbit/s with llama-micro's
    boundary (the network lab's numbers), hiding made fp16 look faster than int8, which 1f1b ran 5-15 ms per step
    faster in six runs; counting every transfer picks int8. Every schedule `qwire train` offers has a model."""
    from qwire.config import SCHEDULES
    from qwire.parallel.autotune import EXPOSING_SCHEDULES, OVERLAPPING_SCHEDULES, hidden_s

    assert set(SCHEDULES) == set(OVERLAPPING_SCHEDULES + EXPOSING_SCHEDULES)
    assert hidden_s("gpipe", [0.012, 0.021]) == 0.021 and hidden_s("gpipe", [0.012, None]) == 0.0
    assert hidden_s("1f1b", [0.012, 0.021]) == 0.0
    cands = [_cand("fp32", 131_072, 0.00002, 0.00006, 0.0), _cand("fp16", 65_536, 0.00005, 0.00005, 4e-8),
             _cand("int8", 34_820, 0.00028, 0.00025, 2.5e-5)]
    link = Link(20.7e6, 0.0, "probe")
    assert choose(cands, link, 4, 0.02, 0.05, "int8", hide_s=hidden_s("gpipe", [0.012, 0.021]))["codec"] == "fp16"
    assert choose(cands, link, 4, 0.02, 0.05, "fp16", hide_s=hidden_s("1f1b", [0.012, 0.021]))["codec"] == "int8"


def test_measure_reports_the_real_error_and_size() -> None:
    x = torch.randn(2, 64, 128)
    m = measure(get_codec("int4"), x)
    y = get_codec("int4").decode(get_codec("int4").encode(x), x.shape, x.dtype)
    assert m["bytes"] == get_codec("int4").payload_nbytes(x.shape, x.dtype)
    assert math.isclose(m["nmse"], float((x - y).double().pow(2).sum() / x.double().pow(2).sum()), rel_tol=1e-9)
    assert measure(get_codec("fp32"), x)["nmse"] == 0.0


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_model_env(tmp_path_factory.mktemp("auto"), layers=3)


def test_auto_on_a_slow_link_switches_both_ends_to_the_same_compressed_codec(env) -> None:
    """3 stages behind a simulated 5 Mbit/s link: after step 1 every boundary leaves fp32 for a compressed
    codec within the budget; the bytes each step sends are that codec's payloads, and training goes on."""
    cfg = TrainConfig(stages=3, steps=4, batch_size=8, microbatches=4, seq_len=32, model=env["model"],
                      vocab_size=512, max_tokens=40_000, eval_every=0, eval_batches=2, log_every=1,
                      checkpoint_every=0, fwd_codec="auto:candidates=fp16+int8+tahquant,probe_every=3",
                      bwd_codec="auto:candidates=fp16+int8,max_nmse=0.001", timeout=120,
                      out=str(Path(env["base"]) / "slow"), link="5mbit,mode=sim", schedule="gpipe")
    summary = launch(cfg)
    recs = [json.loads(ln) for ln in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["codec_fwd"] == ["fp32", "fp32"] and recs[0]["codec_bwd"] == ["fp32", "fp32"]
    assert recs[0]["auto_next"] == {"0fwd": recs[1]["codec_fwd"][0], "1fwd": recs[1]["codec_fwd"][1],
                                    "0bwd": recs[1]["codec_bwd"][0], "1bwd": recs[1]["codec_bwd"][1]}
    assert all(c != "fp32" for c in recs[1]["codec_fwd"] + recs[1]["codec_bwd"])
    assert all(c in ("fp16", "int8") for c in recs[1]["codec_bwd"])  # tahquant is not a bwd candidate
    decisions = [json.loads(ln) for ln in (Path(cfg.out) / "autotune.jsonl").read_text().splitlines()]
    for b in decisions[0]["boundaries"].values():
        chosen = next(c for c in b["candidates"] if c["label"] == b["label"])
        assert chosen["nmse"] <= b["max_nmse"] and b["link"]["source"] == "simulated link"
    # the first decision hides no transfer (step 1's chunks load code); the one after step 3 hides them behind
    # the slower stage's compute per micro-batch, which the stages timed in step 3 (gpipe overlaps its sends)
    assert [d["step"] for d in decisions] == [1, 3]
    assert all(b["schedule"] == "gpipe" for d in decisions for b in d["boundaries"].values())
    assert all(b["hide_s"] == 0.0 for b in decisions[0]["boundaries"].values())
    assert all(0.0 < b["hide_s"] < 5.0 for b in decisions[1]["boundaries"].values())
    # step 2's bytes are the chosen codecs' payloads: 4 micro-batches of (4, 32, 64) on each boundary
    shape = (8 // 4, 32, 64)
    want_fwd = sum(4 * get_codec(c).payload_nbytes(shape, torch.float32) for c in recs[1]["codec_fwd"])
    assert recs[1]["wire_bytes_fwd"] == want_fwd < recs[0]["wire_bytes_fwd"]
    assert recs[-1]["loss"] < recs[0]["loss"]
    # auto's own time between steps is recorded on every row, the decisions' (probes, each candidate's encode
    # and decode) included, and the summary adds them up
    assert all(r["auto_time_s"] >= 0 for r in recs)
    assert all(recs[d["step"] - 1]["auto_time_s"] > 0 for d in decisions)
    assert summary["auto_decisions"] == 2
    assert summary["auto_time_s"] == pytest.approx(sum(r["auto_time_s"] for r in recs), abs=1e-3)


def test_resume_goes_on_with_the_codecs_auto_had_in_force(env, capfd: pytest.CaptureFixture[str]) -> None:
    """A checkpoint keeps auto's decisions (pipeline boundaries and the DP all-reduce): the resumed run's
    first step sends with them, no start-up measurement is repeated, and the console says so."""
    import dataclasses

    cfg = TrainConfig(stages=2, dp=2, steps=2, batch_size=8, microbatches=2, seq_len=32, model=env["model"],
                      vocab_size=512, max_tokens=40_000, eval_every=0, eval_batches=1, log_every=1,
                      checkpoint_every=2, fwd_codec="auto:candidates=fp16+int8", bwd_codec="fp32",
                      dp_codec="auto:link=5mbit,candidates=fp16+blockwise8", timeout=120,
                      out=str(Path(env["base"]) / "auto-resume"), link="5mbit,mode=sim")
    launch(cfg)
    capfd.readouterr()
    launch(dataclasses.replace(cfg, steps=3), resume=True)
    out = capfd.readouterr().out
    recs = [json.loads(ln) for ln in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0]["codec_fwd"] == ["fp32"] and recs[0]["codec_dp"] == ["fp32", "fp32"]  # DP: one per stage
    assert recs[1]["codec_fwd"] != ["fp32"] and "fp32" not in recs[1]["codec_dp"]
    # step 3, the first after the resume, runs with what was in force at step 2, and is not a measurement
    assert recs[2]["codec_fwd"] == recs[1]["codec_fwd"] and recs[2]["codec_dp"] == recs[1]["codec_dp"]
    assert recs[2]["wire_bytes_fwd"] == recs[1]["wire_bytes_fwd"] and "auto_next" not in recs[2]
    decisions = [json.loads(ln) for ln in (Path(cfg.out) / "autotune.jsonl").read_text().splitlines()]
    assert [d["step"] for d in decisions] == [1, 1]  # the pipeline's and the DP's, after step 1 only
    assert "auto: resumed with the codecs in force at step 2: fwd " + recs[1]["codec_fwd"][0] in out, out
    # the summary counts auto's decisions and time over the whole run, the part before the resume included
    summary = json.loads((Path(cfg.out) / "summary.json").read_text())
    assert summary["auto_decisions"] == 2
    assert summary["auto_time_s"] == pytest.approx(sum(r["auto_time_s"] for r in recs), rel=1e-6)
    assert "s measuring and choosing between steps" in out and "2 decision(s)" in out
    # resumed on another link (a requeued job), the decisions are measured again after the first resumed step
    launch(dataclasses.replace(cfg, steps=4, link="50mbit,mode=sim"), resume=True)
    out = capfd.readouterr().out
    assert "auto: the links changed since the checkpoint; measuring after the first step" in out, out
    decisions = [json.loads(ln) for ln in (Path(cfg.out) / "autotune.jsonl").read_text().splitlines()]
    assert [d["step"] for d in decisions] == [1, 1, 4, 4]


# -- auto on the collectives (data- and tensor-parallel) -----------------------------------------------


@pytest.mark.parametrize("kw,needle", [
    ({"dp_codec": "auto:candidates=fp16+aqsgd"}, "--dp-codec: .*per-sample state"),
    ({"dp_codec": "auto:candidates=fp16+nosuch"}, "--dp-codec: unknown codec 'nosuch'"),
    ({"dp_codec": "auto:candidates=torch-fp16"}, "DDP hooks, not a codec"),
    ({"tp_codec": "auto:link=fast"}, "--tp-codec: .*link='fast'"),
    ({"dp_shard": True, "dp_param_codec": "auto:candidates=fp8+auto"}, "--dp-param-codec: .*its own candidate"),
])
def test_auto_on_collectives_refuses_bad_input_naming_the_option(env, kw: dict, needle: str) -> None:
    cfg = TrainConfig(stages=1, dp=2, tp=2, model=env["model"], **kw)
    with pytest.raises(ValueError, match=needle):
        cfg.validate()


def test_auto_defaults_by_role_and_watching() -> None:
    assert auto_for("auto", "dp").labels == ["fp32", "fp16", "blockwise8"]
    assert auto_for("auto:candidates=int8", "tp").labels == ["fp32", "int8"]  # the user's own list wins
    assert auto_for("fp8", "tp") == "fp8"
    a = auto_for("auto", "tp")
    a.watch()
    for n in (10, 300, 20):
        a.encode(torch.ones(n))
    p = a.encode(torch.ones(300))
    for _ in range(4):  # an all-gather of 4 ranks decodes 4 payloads per encode: its decode time is 4 times it
        a.decode(p, (300,), torch.float32)
    seen = a.watched()
    assert seen["elements"] == 630 and seen["calls"] == 4 and seen["x"].numel() == 300 and seen["decoded"] == 1200
    a.encode(torch.ones(5000))  # not watched any more
    assert a.watched()["x"] is None


def test_an_auto_that_no_controller_drives_says_so() -> None:
    """In a training loop of one's own, nothing switched `auto`: it sent everything as fp32, silently."""
    from qwire.codecs.auto import UNCONTROLLED_WARN_AFTER

    a = get_codec("auto")
    with pytest.warns(RuntimeWarning, match=r"no controller to choose among its candidates, so it sends all of "
                                            r"them with its first one \(fp32\)"):
        for _ in range(UNCONTROLLED_WARN_AFTER):
            a.encode(torch.ones(8))
    driven = get_codec("auto")
    driven.controlled = True  # what PipelineAutotune and CollectiveAutotune set on the codecs they switch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(UNCONTROLLED_WARN_AFTER):
            driven.encode(torch.ones(8))


def test_small_tensors_go_as_fp32_below_the_measured_threshold() -> None:
    a = auto_for("auto:candidates=int8", "dp")
    a.switch(get_codec("int8").spec())
    a.small(100)
    small, big = torch.randn(99), torch.randn(100)
    assert a.payload_nbytes(small.shape, small.dtype) == 99 * 4
    assert torch.equal(a.encode(small).view(torch.float32), small)
    assert torch.equal(a.decode(a.encode(small), small.shape, small.dtype), small)
    assert a.payload_nbytes(big.shape, big.dtype) == get_codec("int8").payload_nbytes(big.shape, big.dtype)
    # the threshold: int8 costs 1 ms more per tensor than fp32 and saves 3 bytes per element (x2 fan-out) on a
    # 1 MB/s link, 6 us per element: below 1e-3 / 6e-6 = 167 elements fp32 is faster
    fp32 = {"codec": "fp32", "small_numel": 1000, "small_s": 0.0, "measured_numel": 10_000, "measured_s": 0.0,
            "measured_bytes": 40_000}
    int8 = {"codec": "int8", "small_numel": 1000, "small_s": 1e-3, "measured_numel": 10_000, "measured_s": 1e-3,
            "measured_bytes": 10_000}
    assert size_threshold(fp32, int8, 2.0, Link(1e6, 0.0, "probe")) == 167
    assert size_threshold(fp32, int8, 2.0, Link(1e3, 0.0, "probe")) == 1      # a slow link: compress everything
    assert size_threshold(fp32, int8, 2.0, Link(1e12, 0.0, "probe")) == 10_000  # capped at the measured size
    assert size_threshold(fp32, fp32, 2.0, Link(1e6, 0.0, "probe")) == 0


def _ddp_auto_worker(rank: int, world: int, budgets: tuple[float, ...]) -> dict:
    """Two DDP replicas, QuanGrad's hook with one `auto` codec, 2 steps per error budget; rank 1's gradients are
    noisier than rank 0's, so the ranks measure different errors: they must still choose the same codec."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from qwire.comm.collectives import sent_bytes
    from qwire.comm.ddp_hooks import QuanGradState, quangrad_hook
    from qwire.parallel.autotune import CollectiveAutotune

    results = {}
    for max_nmse in budgets:
        torch.manual_seed(0)
        codec = auto_for(f"auto:candidates=fp16+int4,link=1mbit,max_nmse={max_nmse},probe_every=2", "dp")
        ddp = DistributedDataParallel(torch.nn.Linear(256, 256))
        ddp.register_comm_hook(QuanGradState(codec=codec, background=False), quangrad_hook)
        tuner = CollectiveAutotune("dp", codec, None, 0, 1, True, lambda: sent_bytes(None), torch.device("cpu"))
        out: dict = {"codec": [], "bytes": [], "decisions": [], "switched": []}
        g = torch.Generator().manual_seed(rank)
        for step in (1, 2):
            tuner.arm()
            before = sent_bytes(None)
            ddp(torch.randn(8, 256, generator=g) * (1 + 10 * rank)).pow(2).sum().backward()
            out["bytes"].append(sent_bytes(None) - before)
            out["codec"].append(codec.in_force())
            out["decisions"].append(tuner.decide(step))
            out["switched"].append(tuner._switched)
        results[max_nmse] = out
    dist.barrier()
    return results


def test_ddp_replicas_choose_the_same_codec_and_send_its_bytes() -> None:
    """A slow assumed link: the 4-bit candidate wins when the budget allows it; a budget no lossy candidate
    meets forces fp32. Both replicas switch together, and the next step sends the chosen codec's bytes."""
    budgets = {0.02: "int4", 1e-12: "fp32"}
    both = run_distributed(_ddp_auto_worker, 2, args=(tuple(budgets),), timeout=60)
    for max_nmse, want in budgets.items():
        res = [both[0][max_nmse], both[1][max_nmse]]
        assert res[0]["codec"] == res[1]["codec"]
        assert res[0]["decisions"] == res[1]["decisions"]  # the same numbers, the same choice, on every rank
        assert res[0]["codec"] == ["fp32", get_codec(want).spec()]
        # whether a decision switched (the shift detector's settling depends on it) is the same on every rank
        assert res[0]["switched"] == res[1]["switched"] == [want != "fp32", False]
        entry = res[0]["decisions"][0]["groups"]["0dp"]  # after step 1, from fp32's step
        assert entry["label"] == want and entry["link"]["source"] == "assumed (auto:link=1mbit)"
        fp32_bytes, next_bytes = res[0]["bytes"]
        pred = next(c["bytes"] for c in entry["candidates"] if c["label"] == want)
        assert next_bytes == pytest.approx(pred, rel=0.02)  # the step after the switch sends what was predicted
        assert (next_bytes < fp32_bytes / 4) if want == "int4" else (next_bytes == fp32_bytes)


def test_auto_on_fsdp_and_tp_chooses_per_dimension_and_records_it(env) -> None:
    """FSDP x TP (2 x 2 ranks, 2 steps): a gradient budget no lossy codec meets keeps fp32 on the
    reduce-scatter; the weight all-gather and the TP collectives behind an assumed 5 Mbit/s link switch
    to fp8 after step 1, and step 2's bytes are fp8's."""
    cfg = TrainConfig(stages=1, dp=2, tp=2, dp_shard=True, steps=2, batch_size=4, microbatches=2, seq_len=32,
                      schedule="gpipe", model=env["model"], vocab_size=512, max_tokens=40_000, eval_every=0,
                      eval_batches=1, log_every=1, checkpoint_every=0, timeout=120,
                      dp_codec="auto:max_nmse=1e-12", dp_param_codec="auto:link=5mbit", tp_codec="auto:link=5mbit",
                      out=str(Path(env["base"]) / "fsdp-tp"))
    launch(cfg)
    recs = [json.loads(ln) for ln in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert [recs[0][f"codec_{d}"] for d in ("dp", "dp_param", "tp")] == [["fp32"]] * 3
    assert recs[0]["auto_next"] == {"0dp": "fp32", "0dp_param": "fp8", "0tp": "fp8"}
    assert [recs[1][f"codec_{d}"] for d in ("dp", "dp_param", "tp")] == [["fp32"], ["fp8"], ["fp8"]]
    assert recs[0]["nmse_dp"] == {"0": 0.0} and recs[0]["nmse_tp"] == {"0": 0.0}  # fp32 was in force
    assert recs[1]["wire_bytes_dp_grad"] == recs[0]["wire_bytes_dp_grad"]
    assert recs[1]["wire_bytes_dp_param"] < recs[0]["wire_bytes_dp_param"] / 3
    decisions = [json.loads(ln) for ln in (Path(cfg.out) / "autotune.jsonl").read_text().splitlines()]
    tp = next(d for d in decisions if d["dim"] == "tp")["groups"]["0tp"]
    fp8 = next(c for c in tp["candidates"] if c["label"] == "fp8")
    assert recs[1]["wire_bytes_tp"] == 4 * fp8["bytes"] < recs[0]["wire_bytes_tp"] / 3  # 4 ranks alike
    assert fp8["nmse"] <= tp["max_nmse"]


def test_a_probe_fits_the_link_from_its_ping_and_its_largest_size() -> None:
    """fit_link(): the line through the ping (the smallest size) and the largest size. On the lab's 20 Mbit/s
    link, 8 KiB still went at the speed of its token bucket and 16 KiB, once the probe had drained it, at the
    rate: the two largest sizes fitted 10.6 Mbit/s, the ping and the largest fit 18.9; the latency is half the
    intercept (0 where the line passes below the ping)."""
    from qwire.parallel.autotune import fit_link

    measured = {64: 0.0001, 4096: 0.00012, 8192: 0.00084, 16384: 0.00704}  # seconds, best of two
    link = fit_link(measured, "probe", round_trip=True)
    assert link.bytes_per_s == pytest.approx((16384 - 64) / (0.00704 - 0.0001))
    assert link.bytes_per_s * 8 > 18e6 and link.latency_s == pytest.approx((0.0001 - 64 / link.bytes_per_s) / 2)
    assert fit_link({4096: 0.5}, "probe", round_trip=True).bytes_per_s == pytest.approx(4096 / 0.5)


def _link_model(rate: float, round_trip_s: float, burst: float = 0.0):
    """A probe's transfer on a modelled link: a round trip of ``round_trip_s`` plus the bytes the token bucket
    (``burst`` bytes, refilled at ``rate`` while the round trips go) cannot pass at once, at ``rate``."""
    tokens = [burst]

    def transfer(size: int) -> float:
        take = min(tokens[0], size)
        tokens[0] = min(burst, tokens[0] - take + round_trip_s * rate)
        return round_trip_s + (size - take) / rate
    return transfer


def test_the_probe_measures_the_rate_behind_a_token_bucket_and_a_long_round_trip() -> None:
    """probe_ladder() + fit_link() on modelled links: the lab's 20 Mbit/s link (a 15 KB bucket, 0.1 ms round
    trips) and a 100 Mbit/s link with a 40 ms round trip, which ended the probe at its first size when a
    probe stopped at the first size slower than 5 ms (4 KiB over 40 ms: 0.8 Mbit/s): the probe now goes on
    until a size takes PROBE_SLOW_S longer than the ping, and both fits land within 5% of the rate (the
    latency within 5% of half the round trip). Every size goes PROBE_REPS times, the one that ends the probe
    too: one transfer held up on a busy machine does not end it."""
    from qwire.parallel.autotune import PROBE_REPS, PROBE_SIZES, PROBE_SLOW_S, fit_link, probe_ladder

    lab = fit_link(probe_ladder(_link_model(20e6 / 8, 1e-4, burst=15140)), "probe", round_trip=True)
    assert lab.bytes_per_s == pytest.approx(20e6 / 8, rel=0.05)
    far = probe_ladder(_link_model(100e6 / 8, 0.04))
    last = max(far)
    assert far[last] - far[PROBE_SIZES[0]] > PROBE_SLOW_S and last > 4096  # past the first sizes
    link = fit_link(far, "probe", round_trip=True)
    assert link.bytes_per_s == pytest.approx(100e6 / 8, rel=0.05) and link.latency_s == pytest.approx(0.02, rel=0.05)
    calls: list[int] = []
    probe_ladder(lambda n: calls.append(n) or 0.0)  # a link that takes no time: every size, PROBE_REPS times
    assert calls == [n for n in PROBE_SIZES for _ in range(PROBE_REPS)]
    # the lab's 1 Gbit/s link, one 4 KiB round trip held up 5.5 ms (a busy machine): the probe goes on
    fast, held = _link_model(1e9 / 8, 1e-4, burst=125000), [True]

    def busy(size: int) -> float:
        if size == 4096 and held[0]:
            held[0] = False
            return 0.0055
        return fast(size)
    times = probe_ladder(busy)
    assert max(times) == PROBE_SIZES[-1] and times[4096] < 0.001
    assert fit_link(times, "probe", round_trip=True).bytes_per_s == pytest.approx(1e9 / 8, rel=0.05)
    scaled = probe_ladder(lambda n: 0.0, scale=3)  # an all-gather of three ranks: bytes on the link per size
    assert sorted(scaled) == [3 * n for n in PROBE_SIZES]


def _probe_worker(rank: int, world: int, slow_s: float) -> dict:
    """Stage 0 probes the link to stage 1 (gloo, loopback), with PROBE_SLOW_S set to ``slow_s``; both return
    what they saw: the sender its link and how many messages of each size it sent."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from qwire.parallel import autotune

    autotune.PROBE_SLOW_S = slow_s
    sent: dict[int, int] = {}
    real_send = dist.send

    def counting_send(t, dst, group=None):
        if t.dtype == torch.uint8 and t.numel() > 1:
            sent[t.numel()] = sent.get(t.numel(), 0) + 1
        return real_send(t, dst, group=group)

    dist.send = counting_send
    t = object.__new__(autotune.PipelineAutotune)
    t.group, t.stage = None, SimpleNamespace(device=torch.device("cpu"))
    try:
        if rank == 0:
            link = t._probe_as_sender(1)
            return {"link": vars(link), "sent": sent}
        t._probe_as_echo(0)
        return {"echo_done": True}
    finally:
        dist.send = real_send


def test_the_pipeline_probe_grows_its_messages_until_one_is_slow() -> None:
    """_probe_as_sender/_probe_as_echo: on a fast link every size of PROBE_SIZES goes twice; a size whose best
    time is PROBE_SLOW_S longer than the ping's (here the ping itself, with the limit below 0) is the last;
    the echo stops either way."""
    from qwire.parallel.autotune import PROBE_REPS, PROBE_SIZES

    fast = run_distributed(_probe_worker, 2, args=(10.0,), timeout=60)
    assert fast[1] == {"echo_done": True}
    assert fast[0]["sent"] == {n: PROBE_REPS for n in PROBE_SIZES} and fast[0]["link"]["source"] == "probe"
    slow = run_distributed(_probe_worker, 2, args=(-1.0,), timeout=60)
    assert slow[1] == {"echo_done": True} and slow[0]["sent"] == {PROBE_SIZES[0]: PROBE_REPS}
    assert slow[0]["link"]["latency_s"] == 0.0  # one size alone: the bandwidth, no latency


def _probe_again_worker(rank: int, world: int) -> dict:
    """Both controllers' second probe on two gloo ranks: the pipeline's (stage 0 -> 1) and the collectives'
    (one data-parallel group of both ranks), with a remembered link that the first probe is far off."""
    from types import SimpleNamespace

    from qwire.parallel.autotune import CollectiveAutotune, Link, PipelineAutotune

    remembered = {0: [Link(1e3, 0.0, "probe")]}  # 8 kbit/s: loopback is far faster
    first = {0: Link(1e9, 0.0, "probe")}
    pipe = object.__new__(PipelineAutotune)
    pipe.group, pipe.assumed, pipe.lead, pipe.stages, pipe.pp_rank = None, None, True, 2, rank
    pipe.stage = SimpleNamespace(device=torch.device("cpu"), out_boundary=object() if rank == 0 else None)
    pipe._probes = {k: list(v) for k, v in remembered.items()}
    coll = object.__new__(CollectiveAutotune)
    coll.group, coll.assumed, coll.lead, coll.index, coll.device = None, None, True, 0, torch.device("cpu")
    coll._probes = {k: list(v) for k, v in remembered.items()}
    out = {"pipe": pipe._probe_again(first, 30), "coll": coll._probe_again(first, 30),
           "none": pipe._probe_again({0: Link(1.5e3, 0.0, "probe")}, 30)}  # within 2x: no second probe
    return {k: {kk: vars(vv) for kk, vv in v.items()} for k, v in out.items()}


def test_both_controllers_probe_a_jumped_link_again_on_every_rank() -> None:
    """_probe_again(): when a probe is far off the remembered ones, the pipeline's sender and echo probe that
    boundary again and the collectives' group all-gathers again; every rank gets the same second probe."""
    both = run_distributed(_probe_again_worker, 2, timeout=60)
    assert both[0] == both[1]
    for what in ("pipe", "coll"):
        assert set(both[0][what]) == {0} and both[0][what][0]["source"] == "probe"
        assert both[0][what][0]["bytes_per_s"] > 2e3
    assert both[0]["none"] == {}


def test_autotune_records_stay_json_when_a_probe_fits_no_bound(tmp_path) -> None:
    """A loopback probe can fit an unbounded bandwidth: autotune.jsonl writes it as null, not Infinity."""
    import json as _json

    from qwire.metrics import Logger

    Logger(tmp_path, active=True).autotune({"bandwidth": float("inf"), "fit": [1.0, float("nan")], "ok": {"x": 2}})
    line = (tmp_path / "autotune.jsonl").read_text().strip()
    assert "Infinity" not in line and "NaN" not in line
    assert _json.loads(line) == {"bandwidth": None, "fit": [1.0, None], "ok": {"x": 2}}


def _measured_after(times: list[float], probe_every: int = 10, shift: float = 0.5,
                    kept: tuple[int, ...] = ()) -> tuple[list, object]:
    """The steps a controller that arms a step ahead (arm_ahead 1, the collectives') measures after, with their
    trigger, for these step times of the slowest rank; and the controller. The decisions after the steps in
    ``kept`` keep every codec (the others switch one)."""
    from qwire.parallel.autotune import StepAutotune

    t = StepAutotune()
    t.shift, t.probe_every = shift, probe_every
    armed = []
    for step, sec in enumerate(times, start=1):
        due = t.due(step)
        if due:
            armed.append((step, t.trigger(step, first=step == 1)))
            t._switched = step not in kept  # what decide() records
        t.observe(step, sec, decided=due)
    return armed, t


def test_a_step_time_shift_arms_a_measurement_on_the_next_step() -> None:
    """observe(): the level is the median of the steps after a decision (the first one skipped); two steps
    in a row more than `shift` away from it arm the step after; noise below it, or one spike within twice
    `shift`, does not."""
    from qwire.parallel.autotune import SHIFT_SETTLE, SHIFT_SKIP, StepAutotune

    times = [0.50, 0.15, 0.16, 0.14, 0.17, 0.30, 0.15, 0.16, 0.30, 0.31, 0.30]
    armed, t = _measured_after(times, probe_every=0)
    assert SHIFT_SKIP + SHIFT_SETTLE == 4  # the level is set by steps 3-5 here: 0.16
    # step 6 (0.30) is a lone spike, under 2x the level; steps 9 and 10 are both > 1.5x it: step 11 is measured
    assert armed == [(1, "start"), (11, "shift")] and t._shift_from == pytest.approx(0.16)
    # a controller that keeps the last tensors (the pipeline's: arm_ahead 0) measures right after step 10
    p = StepAutotune()
    p.shift, p.probe_every, p.arm_ahead = 0.5, 0, 0
    armed = []
    for step, sec in enumerate(times, start=1):
        if not p.due(step):
            p.observe(step, sec, decided=False)
            if p.due(step):
                armed.append((step, p.trigger(step, first=False)))
                p.observe(step, sec, decided=True)
        else:
            p.observe(step, sec, decided=True)
    assert armed == [(10, "shift")] and p._shift_from == pytest.approx(0.16)
    off = StepAutotune()
    off.shift = 0.0
    for step, sec in enumerate(times, start=1):
        off.observe(step, sec, decided=step == 1)
    assert not any(off.due(s) for s in range(2, 12))


def test_steps_slower_after_a_decision_than_before_it_arm_a_measurement() -> None:
    """observe(): when the link drops while a measurement runs, the decision is taken on the old link; the
    level after it (more than `shift` above the level before it) arms a new measurement, once."""
    # steps 2-9 settle at 0.13; after the decision at step 10 the steps take 0.25 (the link dropped;
    # under 2 x 0.13, where one step alone would arm: test_one_step_far_off_the_level_arms_a_measurement_at_once)
    times = [0.5, 0.2, 0.13, 0.13, 0.14, 0.13, 0.13, 0.13, 0.13, 0.13] + [0.24, 0.25, 0.25, 0.25, 0.25, 0.25]
    armed, t = _measured_after(times)
    # steps 12 and 13, the first two after the skipped one, are both above 1.5 x 0.13: step 14 is measured
    assert armed == [(1, "start"), (10, "every"), (14, "shift")] and t._shift_from == pytest.approx(0.13)
    # the first settling step fast, the next two slow: the level they set (0.25) is what arms, at step 14
    armed, w = _measured_after(times[:10] + [0.24, 0.14, 0.25, 0.25, 0.25, 0.25])
    assert [s for s, _ in armed] == [1, 10, 15] and w._shift_from == pytest.approx(0.13)
    # one slow settling step among faster ones arms nothing
    armed, _ = _measured_after(times[:10] + [0.24, 0.25, 0.14, 0.13, 0.13, 0.13])
    assert [s for s, _ in armed] == [1, 10]
    # faster after a decision, or slower by less than shift: nothing armed
    for after in (0.08, 0.18):
        armed, _ = _measured_after(times[:10] + [0.24] + [after] * 5)
        assert [s for s, _ in armed] == [1, 10], after


def test_a_link_that_drops_as_a_decision_keeps_every_codec_is_seen_a_step_sooner() -> None:
    """observe(): the first step after a decision is left out of the level only when the decision switched a
    codec (that step is slow for other reasons); after one that kept them all, it counts. In the changing-link
    run the rate dropped right as a periodic decision kept fp16: the two slow steps after it re-measure."""
    times = [0.5, 0.2, 0.13, 0.13, 0.14, 0.13, 0.13, 0.13, 0.13, 0.13] + [0.25] * 6
    switched, _ = _measured_after(times)
    kept, t = _measured_after(times, kept=(10,))
    assert switched == [(1, "start"), (10, "every"), (14, "shift")]
    assert kept == [(1, "start"), (10, "every"), (13, "shift")] and t._shift_from == pytest.approx(0.13)
    # after a kept decision, steps at the old level arm nothing, and the level is the first three steps'
    armed, t = _measured_after(times[:10] + [0.13, 0.12, 0.14, 0.13, 0.13], kept=(10,))
    assert [s for s, _ in armed] == [1, 10] and t._level() == pytest.approx(0.13)


def test_one_step_far_off_the_level_arms_a_measurement_at_once() -> None:
    """observe(): one step more than SHIFT_JUMP x `shift` away from the level (a link that dropped far: fp16's
    steps went from 0.09 to 0.78 s when the lab link fell from 1 Gbit/s to 5 Mbit/s) arms a measurement
    alone, so the pipeline runs one step on the old codec, not two; so does one step that far above the level
    before a periodic decision, right after it (the step a decision that switched a codec leaves out of the
    level included: a new codec's first step ran at most 1.35x the level after it in the lab's runs)."""
    from qwire.parallel.autotune import SHIFT_JUMP

    assert SHIFT_JUMP == 2.0
    level = [0.5, 0.1, 0.09, 0.09, 0.09, 0.09, 0.09]  # decision after step 1; level 0.09 from steps 3-5
    armed, t = _measured_after(level + [0.78, 0.15, 0.15], probe_every=0, shift=0.3)
    assert armed == [(1, "start"), (9, "shift")] and t._shift_from == pytest.approx(0.09)
    # just under 1 + 2 x 0.3 times the level alone: nothing; a second such step: the two-step rule
    armed, _ = _measured_after(level + [0.14, 0.09, 0.09], probe_every=0, shift=0.3)
    assert armed == [(1, "start")]
    armed, _ = _measured_after(level + [0.14, 0.14, 0.09], probe_every=0, shift=0.3)
    assert armed == [(1, "start"), (10, "shift")]
    # a step far faster arms too (a link back up under an uncompressed codec)
    armed, _ = _measured_after(level + [0.03, 0.03], probe_every=0, shift=0.3)
    assert armed == [(1, "start"), (9, "shift")]
    # the link drops as a periodic decision (after step 10) measures it: the first step after it arms
    before = [0.5, 0.2, 0.13, 0.13, 0.14, 0.13, 0.13, 0.13, 0.13, 0.13]
    for kept in ((10,), ()):
        armed, _ = _measured_after(before + [0.78] * 4, probe_every=10, shift=0.3, kept=kept)
        assert armed == [(1, "start"), (10, "every"), (12, "shift")], kept
    # a new codec's first step 1.5x the level before: not a drop
    armed, _ = _measured_after(before + [0.2] + [0.13] * 4, probe_every=10, shift=0.3)
    assert armed == [(1, "start"), (10, "every")]


def test_periodic_decisions_use_the_median_of_the_recent_probes() -> None:
    """steady(): one noisy periodic probe of an unchanged link does not move the link decided with (the 1 Gbit/s
    lab link probed at 1768, 1644 and then 1007 Mbit/s switched fp16 to int8 for ten steps); the first decision
    and a shift-triggered one take their own probe alone; a simulated or assumed link passes through."""
    from qwire.parallel.autotune import LINK_MEMORY, Link, StepAutotune

    def mbit(v: float) -> Link:
        return Link(v * 1e6 / 8, 1e-4, "probe")

    t = StepAutotune()
    assert LINK_MEMORY == 3
    assert t.steady(0, mbit(1768), 1).bytes_per_s == mbit(1768).bytes_per_s  # the first: alone
    assert t.steady(0, mbit(1644), 10).bytes_per_s == pytest.approx((1768 + 1644) / 2 * 1e6 / 8)
    got = t.steady(0, mbit(1007), 20)
    assert got.bytes_per_s == mbit(1644).bytes_per_s and got.source == "probe, median of the last 3"
    assert t.steady(1, mbit(50), 20).bytes_per_s == mbit(50).bytes_per_s  # another link: its own history
    t._shift_at = 23  # a shift: the new probe alone, the old ones forgotten
    assert t.steady(0, mbit(20), 23).bytes_per_s == mbit(20).bytes_per_s
    assert t.steady(0, mbit(22), 30).bytes_per_s == pytest.approx(21e6 / 8)
    sim = Link(1e6, 0.01, "simulated link")
    assert t.steady(0, sim, 40) is sim and t.steady(0, None, 40) is None


def test_a_probe_far_off_the_recent_ones_is_checked_by_a_second_probe() -> None:
    """jumped()/steady(again=...): a periodic probe more than LINK_JUMP times off the median of the remembered
    probes is probed again; a second probe off on the same side means the link changed (the 1 Gbit/s lab link
    dropped to 20 Mbit/s as the changing-link run's periodic probe at step 30 saw 17 Mbit/s, and the median of
    905, 916 and 17 kept it at 905 for ten more steps): the new probes replace the old. A second probe back near
    the median means the first was noise: it counts as one probe among the last three."""
    from qwire.parallel.autotune import LINK_JUMP, Link, StepAutotune

    def mbit(v: float) -> Link:
        return Link(v * 1e6 / 8, 1e-4, "probe")

    t = StepAutotune()
    assert LINK_JUMP == 2.0
    t.steady(0, mbit(905), 1)
    t.steady(0, mbit(916), 10)
    assert not t.jumped(0, mbit(1007 / 1.7), 20) and not t.jumped(0, mbit(1500), 20)  # within 2x: no second probe
    assert t.jumped(0, mbit(17), 30) and t.jumped(0, mbit(2000), 30)
    got = t.steady(0, mbit(17), 30, again=mbit(19))
    assert got.bytes_per_s == pytest.approx(18e6 / 8) and got.source == "probe, median of the last 2"
    assert not t.jumped(0, mbit(17), 40) and t.steady(0, mbit(16), 40).bytes_per_s == mbit(17).bytes_per_s
    # a noisy probe: the second is back near the median; the first counts as one of the last three
    n = StepAutotune()
    n.steady(0, mbit(905), 1)
    n.steady(0, mbit(916), 10)
    got = n.steady(0, mbit(300), 20, again=mbit(900))
    assert got.bytes_per_s == mbit(905).bytes_per_s and got.source == "probe, median of the last 3"
    # a shift-triggered decision takes its probe alone anyway: no second probe
    n._shift_at = 25
    assert not n.jumped(0, mbit(17), 25)


def test_autotune_step_measures_a_pipeline_shift_right_after_the_step_that_shows_it() -> None:
    """qwire.train.autotune_step with a controller that needs no arming (arm_ahead 0, the pipeline's) and one
    that does (1, the collectives'): each observes every step (the first twice at the step it decides a shift
    on: once to arm it, once to reset), and the shift is decided after the second slow step, or a step later."""
    from types import SimpleNamespace

    from qwire.parallel.autotune import StepAutotune
    from qwire.train import autotune_step

    class Stub(StepAutotune):
        def __init__(self, ahead: int) -> None:
            self.shift, self.probe_every, self.arm_ahead, self.history = 0.5, 0, ahead, []
            self.observed: list[int] = []
            self.decided: list[tuple[int, str]] = []

        def observe(self, step, seconds, decided):
            self.observed.append(step)
            super().observe(step, seconds, decided)

        def decide(self, step):
            return {"step": step}

        def summary(self, decision):
            self.decided.append((decision["step"], decision["trigger"]))
            return {}, []

    tuners = [Stub(0), Stub(1)]
    run = SimpleNamespace(autotune=tuners, log=SimpleNamespace(say=lambda line: None, autotune=lambda d: None),
                          outer=None)
    times = [0.5, 0.15, 0.16, 0.14, 0.17, 0.16, 0.30, 0.31, 0.30, 0.30]
    for step, sec in enumerate(times, start=1):
        autotune_step(run, step, step == 1, {"step_time_max_s": sec})
    pipe, coll = tuners
    assert pipe.decided == [(1, "start"), (8, "shift")] and coll.decided == [(1, "start"), (9, "shift")]
    for t in tuners:
        assert sorted(set(t.observed)) == list(range(1, 11))
        assert all(t.observed.count(s) == 1 for s in range(1, 11) if (s, "shift") not in t.decided)

    # DiLoCo: the steps that hold a meeting are slower by its all-reduce, and were taken for a moved link
    tuners = [Stub(0)]
    tuners[0].shift = 0.3  # (the default; without the meetings left out: shifts decided after steps 8 and 16)
    run = SimpleNamespace(autotune=tuners, log=run.log, outer=SimpleNamespace(met_at=0))
    for step in range(1, 21):
        run.outer.met_at = step if step % 4 == 0 else run.outer.met_at
        autotune_step(run, step, step == 1, {"step_time_max_s": 0.3 if step % 4 == 0 else 0.15})
    assert tuners[0].decided == [(1, "start")]


def test_a_candidate_that_refuses_the_tensor_is_left_out_not_raised() -> None:
    """One activation past fp16's range (LLMs have such outliers) made auto's measurement of its default fp16
    candidate raise, which ended a run training on fine with fp32 in force."""
    x = torch.randn(1, 16, 64)
    x[0, 0, 0] = 7e4
    m = measure(get_codec("fp16"), x)
    assert m["nmse"] == math.inf and "exceeds fp16's range" in m["refused"]
    assert m["bytes"] == get_codec("fp16").payload_nbytes(x.shape, x.dtype)
    cands = [dict(measure(get_codec(c), x), label=c) for c in ("fp32", "fp16", "int8")]
    assert choose(cands, None, 1, 1e-3, 0.0, "fp16")["codec"] != "fp16"  # in force, refused: switched away


def test_fp8_group_auto_expands_to_the_group_sizes_and_chooses_by_error_per_byte() -> None:
    """fp8:group=auto (TACO's data-driven reshaping): candidates are fp8 at every group size (other options
    kept, group 128 in force first); the choice is the smallest payload whose measured error is within
    shape_tol of the lowest: large groups on a homogeneous tensor, small ones where outliers cluster."""
    from qwire.codecs.auto import FP8_GROUPS, fp8_group_auto
    from qwire.parallel.autotune import choose_shape

    a = fp8_group_auto("fp8:format=e5m2,group=auto")
    assert a is not None and a.rule == "shape" and a.in_force() == get_codec("fp8:format=e5m2,group=128").spec()
    assert sorted(c.group for c in a.choices if c.name != "fp32") == list(FP8_GROUPS)
    assert all(c.format == "e5m2" for c in a.choices if c.name != "fp32")
    assert fp8_group_auto("fp8:group=64") is None and fp8_group_auto("int8") is None
    with pytest.raises(ValueError, match="--tp-codec"):
        TrainConfig(tp=2, stages=1, tp_codec="fp8:group=auto,format=e9m9").validate()
    TrainConfig(tp=2, stages=1, tp_codec="fp8:group=auto").validate()

    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(1 << 16, generator=gen)
    spiky = flat.clone()
    spiky.view(-1, 512)[:, :8] *= 300.0  # eight large values at the start of every 512 elements
    link = Link(1e9, 0.0, "assumed")
    picks = {}
    for name, x in (("flat", flat), ("spiky", spiky)):
        cands = [dict(measure(c, x), label=lab) for lab, c in zip(a.labels, a.choices)]
        picks[name] = get_codec(choose_shape(cands, link, a.shape_tol)["codec"]).group
        errs = {get_codec(c["codec"]).group: c["nmse"] for c in cands if c["codec"] != "fp32"}
        if name == "spiky":
            assert errs[32] * 1.25 < errs[512]  # small groups do help here
    assert picks["flat"] == 512 and picks["spiky"] < 512


def test_tp_with_fp8_group_auto_records_the_chosen_group(env) -> None:
    cfg = TrainConfig(stages=1, tp=2, steps=2, batch_size=4, microbatches=2, seq_len=32, schedule="gpipe",
                      model=env["model"], vocab_size=512, max_tokens=40_000, eval_every=0, eval_batches=1,
                      log_every=1, checkpoint_every=0, timeout=120, tp_codec="fp8:group=auto",
                      out=str(Path(env["base"]) / "tp-shape"))
    launch(cfg)
    recs = [json.loads(ln) for ln in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["codec_tp"] == ["fp8:group=128"]
    decision = json.loads((Path(cfg.out) / "autotune.jsonl").read_text().splitlines()[0])["groups"]["0tp"]
    assert decision["rule"] == "shape" and decision["label"].startswith("fp8:group=")
    assert recs[1]["codec_tp"] == [decision["label"]] == [recs[0]["auto_next"]["0tp"]]
    shapes = [c for c in decision["candidates"] if c["codec"] != "fp32"]
    assert len(shapes) == 5
    picked = next(c for c in shapes if c["label"] == decision["label"])
    assert picked["nmse"] <= min(c["nmse"] for c in shapes) * 1.25 + 1e-30
