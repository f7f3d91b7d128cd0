"""DiLoCo (--dp-sync-every H): the outer step's arithmetic on two gloo ranks, and `qwire train` with it: the
replicas meet (and send) only every H steps and after the last, hold the same weights after each meeting, and a
resume from a checkpoint between meetings continues exactly."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed, tiny_model_env
from qwire.cli import main
from qwire.train import TrainConfig, launch


def _outer_steps(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from qwire.parallel.diloco import OuterSync

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    sync = OuterSync([p], dist.group.WORLD, "fp32", every=4, lr=0.7, momentum=0.9)
    out = {}
    for k in (1, 2):
        with torch.no_grad():  # each replica goes its own way: rank r moves by (r + 1) * k * [0.1, 0.2, -0.1]
            p.add_(torch.tensor([0.1, 0.2, -0.1]) * (rank + 1) * k)
        sync.sync()
        out[k] = (p.detach().clone(), sync.anchors[0].clone(), p.grad)
    return out


def _apart(rank: int, world: int) -> str:
    import torch.distributed as dist

    from qwire.parallel.diloco import OuterSync

    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)  # each rank's own random init
    sync = OuterSync(model.parameters(), dist.group.WORLD, "fp32", every=4, lr=0.7, momentum=0.9)  # a generator
    try:
        sync.sync()
    except ValueError as e:
        return str(e)
    return "met"


def test_replicas_that_start_from_other_weights_are_refused_at_the_first_meeting() -> None:
    """They never came together (each meeting moves every replica's own anchor by the mean pseudo-gradient)."""
    for msg in run_distributed(_apart, 2):
        assert msg.startswith("OuterSync: the replicas of group ranks [1] started from other weights than group "
                              "rank 0's"), msg


def test_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient() -> None:
    res = run_distributed(_outer_steps, 2)
    anchor = torch.tensor([1.0, -2.0, 3.0])
    step = torch.tensor([0.1, 0.2, -0.1])
    buf = torch.zeros(3)
    for k in (1, 2):
        delta = -(step * k * (1 + 2) / 2)  # the mean over the replicas of anchor - local (moved by 1x and 2x)
        buf = 0.9 * buf + delta if k > 1 else delta.clone()
        anchor = anchor - 0.7 * (delta + 0.9 * buf)  # torch's Nesterov SGD
        for r in res:
            got, anchors, grad = r[k]
            torch.testing.assert_close(got, anchor, rtol=0, atol=1e-6)
            torch.testing.assert_close(anchors, anchor, rtol=0, atol=1e-6)  # the new meeting point
            assert grad is None


def _overlapped(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from qwire.parallel.diloco import OuterSync

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    sync = OuterSync([p], dist.group.WORLD, "fp32", every=4, lr=0.7, momentum=0.9, overlap=2,
                     overlap_group=dist.new_group([0, 1]))
    out = {}
    with torch.no_grad():
        p.add_(torch.tensor([0.1, 0.2, -0.1]) * (rank + 1))  # the steps up to the meeting
        out[4] = sync.after_step(4, last=10)  # the meeting starts: nothing lands
        out["pending"] = sync.pending is not None
        p.add_(torch.tensor([0.0, 1.0, 0.5]) * (rank + 1))  # the steps taken while it crosses
        out[5] = sync.after_step(5, last=10)
        out[6] = sync.after_step(6, last=10)  # it lands
    out["p"], out["anchor"] = p.detach().clone(), sync.anchors[0].clone()
    return out


def test_an_overlapped_meeting_lands_later_with_the_steps_since_on_top() -> None:
    res = run_distributed(_overlapped, 2)
    anchor = torch.tensor([1.0, -2.0, 3.0])
    delta = -(torch.tensor([0.1, 0.2, -0.1]) * (1 + 2) / 2)  # mean of anchor - local at the meeting
    new_anchor = anchor - 0.7 * (delta + 0.9 * delta)  # Nesterov SGD's first step (momentum buffer = delta)
    for r, got in enumerate(res):
        assert got[4] == (False, 0.0, 0) and got["pending"] and got[5] == (False, 0.0, 0)
        landed, waited, sent = got[6]
        assert landed and waited >= 0 and sent > 0
        torch.testing.assert_close(got["anchor"], new_anchor, rtol=0, atol=1e-6)
        torch.testing.assert_close(got["p"], new_anchor + torch.tensor([0.0, 1.0, 0.5]) * (r + 1), rtol=0,
                                   atol=1e-6)


def _compensated(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from qwire.parallel.diloco import OuterSync

    out = {}
    for ef in (False, True):
        p = torch.nn.Parameter(torch.zeros(96))
        sync = OuterSync([p], dist.group.WORLD, "blockwise:bits=2,block=16", every=4, lr=1.0, momentum=0.0,
                         error_feedback=ef)
        gen = torch.Generator().manual_seed(rank)
        moved = torch.zeros(96)
        for _ in range(20):  # twenty meetings, each after the replica moved on its own
            step = torch.randn(96, generator=gen) * 0.01
            moved += step
            with torch.no_grad():
                p.add_(step)
            sync.sync()
        res = sync.states[0].residuals
        out[ef] = (p.detach().clone(), moved, res[0].clone() if res else None, sync.state_dict())
    return out


def test_error_feedback_carries_the_pseudo_gradients_quantization_error_to_the_next_meeting() -> None:
    """Outer SGD with lr 1 and no momentum moves the anchor by the sum of the averaged pseudo-gradients. With
    error feedback that sum is exact up to what the ranks still hold as residuals (a telescoping sum): the
    anchor misses the replicas' mean movement by the mean residual, not by twenty meetings' 2-bit errors."""
    res = run_distributed(_compensated, 2)
    exact = (res[0][False][1] + res[1][False][1]) / 2  # the replicas' mean movement over the meetings
    for r in res:
        anchor, _, none, state = r[False]
        assert none is None and "residuals" not in state
        plain_miss = (anchor - exact).norm()
        anchor, _, residual, state = r[True]
        held = (res[0][True][2] + res[1][True][2]) / 2
        torch.testing.assert_close(anchor, exact + held, rtol=0, atol=1e-5)  # residual: what is still owed
        assert (anchor - exact).norm() < 0.5 * plain_miss  # and the error does not pile up
        torch.testing.assert_close(state["residuals"][0][0], residual)


def test_fragments_are_contiguous_non_empty_and_about_equal() -> None:
    from qwire.parallel.diloco import split_fragments

    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([30, 10, 10, 10], 2) == [[0], [1, 2, 3]]
    assert split_fragments([100, 1, 1], 3) == [[0], [1], [2]]  # by size one run would be empty: by count
    assert split_fragments([5], 1) == [[0]] and split_fragments([], 1) == [[]]  # (a stage without parameters)
    with pytest.raises(ValueError, match="cannot cut 2 parameters into 3 fragments: give at most 2"):
        split_fragments([1, 1], 3)


def test_a_checkpoint_from_before_fragments_loads() -> None:
    """A stage file written before --dp-sync-fragments: one outer SGD state (not a list), a meeting in flight
    without a fragment index. No collective runs, so no process group is needed."""
    from qwire.parallel.diloco import OuterSync

    p = torch.nn.Parameter(torch.zeros(3))
    sync = OuterSync([p], None, "fp32", every=4, lr=0.7, momentum=0.9)
    old_sgd = torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.7, momentum=0.9, nesterov=True)
    old_sgd.state[old_sgd.param_groups[0]["params"][0]] = {"momentum_buffer": torch.full((3,), 0.25)}
    sync.load_state_dict({"anchors": [torch.ones(3)], "outer": old_sgd.state_dict(),
                          "pending": {"land_at": 6, "deltas": [torch.full((3,), 0.5)], "snapshot": [torch.ones(3)],
                                      "sent": 12}})
    assert torch.equal(sync.anchors[0], torch.ones(3)) and sync.pending.fragment == 0
    assert sync.pending.land_at == 6 and sync.pending.sent == 12
    buf = sync.outers[0].state[sync.anchors[0]]["momentum_buffer"]
    assert torch.equal(buf, torch.full((3,), 0.25))
    with pytest.raises(ValueError, match="outer state of 1 fragment"):
        OuterSync([p, torch.nn.Parameter(torch.zeros(2))], None, "fp32", every=4, lr=0.7, momentum=0.9,
                  fragments=2).load_state_dict({"anchors": [torch.ones(3), torch.ones(2)],
                                                "outer": old_sgd.state_dict()})
    with pytest.raises(ValueError, match="--dp-sync-fragments 3: this stage has 2 parameters, and every fragment"):
        OuterSync([p, torch.nn.Parameter(torch.zeros(2))], None, "fp32", every=6, lr=0.7, momentum=0.9, fragments=3)


def _fragmented(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from qwire.parallel.diloco import OuterSync

    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    sync = OuterSync([a, b], dist.group.WORLD, "fp32", every=4, lr=1.0, momentum=0.0, overlap=1,
                     overlap_group=dist.new_group([0, 1]), fragments=2)
    out = {"due": [sync.due(s, last=9) for s in range(1, 10)]}
    with torch.no_grad():
        for step in range(1, 10):
            a.add_(rank + 1.0)  # each replica its own way: rank r moves both parameters by r + 1 per step
            b.add_(rank + 1.0)
            out[step] = (sync.after_step(step, last=9)[0], a[0].item(), b[0].item())
    return out


def test_fragments_meet_in_turn_and_land_one_step_later() -> None:
    """Every 4 steps in 2 fragments (a, then b), landing 1 step later: fragment a meets after steps 2 and 6,
    b after 4 and 8; each landing moves only its own fragment to the replicas' mean (outer lr 1) plus the step
    taken since, and after the last step every fragment meets."""
    res = run_distributed(_fragmented, 2)
    assert res[0]["due"] == [[], [0], [], [1], [], [0], [], [1], [0, 1]]
    mean = 1.5  # the replicas' mean move per step
    for r, got in enumerate(res):
        own = r + 1.0
        assert [s for s in range(1, 10) if got[s][0]] == [3, 5, 7, 9]
        assert got[3][1:] == (2 * mean + own, 3 * own)  # a: the meeting after step 2, plus step 3; b: its own
        assert got[5][1:] == (2 * mean + 3 * own, 4 * mean + own)
        assert got[9][1:] == (9 * mean, 9 * mean)  # all met after the last step


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_model_env(tmp_path_factory.mktemp("diloco"), layers=2)


def _cfg(env: dict[str, str], name: str, **kw) -> TrainConfig:
    base = TrainConfig(stages=2, dp=2, dp_sync_every=3, steps=7, batch_size=8, microbatches=4, seq_len=32,
                       model=env["model"], vocab_size=512, max_tokens=40_000, eval_every=0, eval_batches=2,
                       log_every=1, checkpoint_every=2, fwd_codec="int4", bwd_codec="int4",
                       dp_codec="blockwise8:block=256", timeout=60, out=str(Path(env["base"]) / name))
    return dataclasses.replace(base, **kw)


def _metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _weights(run_dir: str | Path, step: int, stage: int, dp: int) -> dict[str, torch.Tensor]:
    path = Path(run_dir) / "checkpoints" / f"step_{step:07d}" / f"stage{stage}-dp{dp}.pt"
    return torch.load(path, weights_only=False)["model"]


def _resumed(run_dir: str | Path, copy: Path, step: int) -> list[dict]:
    """The metrics of a copy of ``run_dir`` cut back to its checkpoint after ``step`` (the later one removed)
    and resumed from it."""
    shutil.copytree(run_dir, copy)
    for later in (copy / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (copy / "checkpoints" / "latest.json").write_text(json.dumps({"step": step}))
    assert main(["train", "--resume", "--out", str(copy)]) == 0
    return _metrics(copy)


@pytest.fixture(scope="module")
def waiting(env) -> tuple[TrainConfig, list[dict]]:
    """The 2-stage x 2-replica run meeting every 3 steps, every replica waiting for each meeting; checkpoints
    after steps 5 (between meetings) and 7."""
    cfg = _cfg(env, "diloco", checkpoint_every=5)
    launch(cfg)
    return cfg, _metrics(cfg.out)


def test_replicas_meet_every_h_steps_and_resume_between_meetings_continues_exactly(env, waiting) -> None:
    cfg, rows = waiting
    met = [r["step"] for r in rows if r.get("dp_synced")]
    assert met == [3, 6, 7]  # every 3 steps, and after the last
    assert all((r["wire_bytes_dp"] > 0) == (r["step"] in met) for r in rows)  # nothing crosses between meetings
    assert len({r["wire_bytes_dp"] for r in rows if r["step"] in met}) == 1  # one all-reduce of the parameters
    assert rows[-1]["loss"] < rows[0]["loss"]
    for stage in (0, 1):
        at7 = [_weights(cfg.out, 7, stage, dp) for dp in (0, 1)]  # just met: one model
        assert all(torch.equal(at7[0][k], at7[1][k]) for k in at7[0])
        at5 = [_weights(cfg.out, 5, stage, dp) for dp in (0, 1)]  # two steps after a meeting: each its own
        assert not all(torch.equal(at5[0][k], at5[1][k]) for k in at5[0])
    # resume from step 5, between two meetings: the same losses and the same bytes as the run that went on
    again = _resumed(cfg.out, Path(env["base"]) / "diloco-resumed", 5)
    assert [r["step"] for r in again] == list(range(1, 8))
    assert [(r["loss"], r["wire_bytes_dp"]) for r in again] == [(r["loss"], r["wire_bytes_dp"]) for r in rows]


def test_overlapped_meetings_land_later_and_resume_with_one_in_flight_continues_exactly(env, waiting) -> None:
    """--dp-sync-overlap 1: the meetings after steps 3 and 6 land after 4 and 7; after the last step the one in
    flight lands and the replicas meet once more. The checkpoint after step 6 holds the meeting in flight and,
    with --dp-error-feedback, the residuals the last meeting (after step 7) adds to its pseudo-gradients."""
    cfg = _cfg(env, "diloco-overlap", dp_sync_overlap=1, checkpoint_every=3,  # the last two kept: after 6 and 7
               dp_error_feedback=True)
    launch(cfg)
    rows = _metrics(cfg.out)
    assert [r["step"] for r in rows if r.get("dp_synced")] == [4, 7]
    dp = {r["step"]: r["wire_bytes_dp"] for r in rows}
    assert all(dp[s] == 0 for s in (1, 2, 3, 5, 6)) and dp[4] > 0 and dp[7] == 2 * dp[4]
    saved = torch.load(Path(cfg.out) / "checkpoints" / "step_0000006" / "stage0-dp0.pt", weights_only=False)
    assert saved["diloco"]["pending"]["land_at"] == 7 and saved["diloco"]["residuals"][0][0].abs().max() > 0
    for stage in (0, 1):
        at7 = [_weights(cfg.out, 7, stage, d) for d in (0, 1)]
        assert all(torch.equal(at7[0][k], at7[1][k]) for k in at7[0])
    wait = [r["loss"] for r in waiting[1]]  # the same run waiting for each meeting: the same first three steps,
    assert wait[:3] == [r["loss"] for r in rows][:3] and wait[4:] != [r["loss"] for r in rows][4:]  # then others
    again = _resumed(cfg.out, Path(env["base"]) / "diloco-overlap-resumed", 6)
    assert [(r["loss"], r["wire_bytes_dp"]) for r in again] == [(r["loss"], r["wire_bytes_dp"]) for r in rows]
    assert again[-1]["val_loss"] == rows[-1]["val_loss"]  # after the last meeting, which used the residuals


def test_fragments_meet_in_turn_and_resume_with_one_in_flight_continues_exactly(env) -> None:
    """--dp-sync-every 4 --dp-sync-fragments 2 --dp-sync-overlap 1: the first fragment meets after steps 2 and 6,
    the second after 4, each landing a step later, and all after the last step (7); the checkpoint after step 4
    holds the second fragment's meeting in flight."""
    cfg = _cfg(env, "diloco-fragments", dp_sync_every=4, dp_sync_fragments=2, dp_sync_overlap=1,
               checkpoint_every=4, dp_error_feedback=True)
    launch(cfg)
    rows = _metrics(cfg.out)
    dp = {r["step"]: r["wire_bytes_dp"] for r in rows}
    assert [r["step"] for r in rows if r.get("dp_synced")] == [3, 5, 7]
    assert all(dp[s] == 0 for s in (1, 2, 4, 6)) and 0 < dp[3] and 0 < dp[5]
    assert dp[7] == 2 * dp[3] + dp[5]  # the first fragment landing, then both
    for stage in (0, 1):
        at7 = [_weights(cfg.out, 7, stage, d) for d in (0, 1)]
        assert all(torch.equal(at7[0][k], at7[1][k]) for k in at7[0])
    saved = torch.load(Path(cfg.out) / "checkpoints" / "step_0000004" / "stage0-dp0.pt", weights_only=False)
    assert saved["diloco"]["pending"]["fragment"] == 1 and len(saved["diloco"]["outer"]) == 2
    assert [len(r) for r in saved["diloco"]["residuals"]] == [1, 1]  # each fragment's own residuals
    again = _resumed(cfg.out, Path(env["base"]) / "diloco-fragments-resumed", 4)
    assert [(r["loss"], r["wire_bytes_dp"]) for r in again] == [(r["loss"], r["wire_bytes_dp"]) for r in rows]
    assert again[-1]["val_loss"] == rows[-1]["val_loss"]


def test_tensor_parallel_replicas_meet_shard_by_shard_and_resume_exactly(env) -> None:
    """--tp 2 with DiLoCo: each tensor-parallel shard meets the same shard of the other replica (its own
    data-parallel group), so after a meeting the replicas hold one model, shard by shard; every (tp, dp) rank
    saves its own file, and a resume between meetings continues exactly."""
    cfg = _cfg(env, "diloco-tp", stages=1, tp=2, steps=5, checkpoint_every=3, microbatches=2,
               tp_codec="fp8", dp_sync_every=2)
    launch(cfg)
    rows = _metrics(cfg.out)
    assert [r["step"] for r in rows if r.get("dp_synced")] == [2, 4, 5]
    assert all((r["wire_bytes_dp"] > 0) == (r["step"] in (2, 4, 5)) and r["wire_bytes_tp"] > 0 for r in rows)
    ckpt = Path(cfg.out) / "checkpoints"
    for step, same in ((5, True), (3, False)):
        for tp in (0, 1):
            a, b = (torch.load(ckpt / f"step_{step:07d}" / f"stage0-tp{tp}-dp{d}.pt", weights_only=False)["model"]
                    for d in (0, 1))
            assert all(torch.equal(a[k], b[k]) for k in a) == same, (step, tp)
    shards = [torch.load(ckpt / "step_0000005" / f"stage0-tp{tp}-dp0.pt", weights_only=False)["model"] for tp in (0, 1)]
    sharded = [k for k in shards[0] if "q_proj" in k]  # column-sharded: each tensor-parallel rank its own half
    assert sharded and all(not torch.equal(shards[0][k], shards[1][k]) for k in sharded)
    again = _resumed(cfg.out, Path(env["base"]) / "diloco-tp-resumed", 3)
    assert [(r["loss"], r["wire_bytes_dp"]) for r in again] == [(r["loss"], r["wire_bytes_dp"]) for r in rows]
    assert again[-1]["val_loss"] == rows[-1]["val_loss"]


def test_every_step_meeting_is_plain_data_parallelism(env) -> None:
    """--dp-sync-every 1 (the default) averages the gradients every step, with no DiLoCo state."""
    cfg = _cfg(env, "ddp", dp_sync_every=1, steps=2, checkpoint_every=0)
    launch(cfg)
    rows = _metrics(cfg.out)
    assert all(r["wire_bytes_dp"] > 0 and "dp_synced" not in r for r in rows)
    assert sorted(p.name for p in (Path(cfg.out) / "checkpoints" / "step_0000002").glob("*.pt")) == \
        ["stage0.pt", "stage1.pt"]


@pytest.mark.parametrize("argv,needle", [
    (["--dp-sync-every", "0"], "--dp-sync-every must be >= 1 (1: average the gradients every step), got 0"),
    (["--dp-sync-every", "4", "--dp-shard"], "(DiLoCo) cannot be used with --dp-shard: FSDP shards hold no whole"),
    (["--dp-sync-every", "4", "--dp-codec", "torch-fp16"], "cannot be used with --dp-codec torch-fp16: a DDP hook"),
    (["--dp-sync-every", "4", "--dp-codec", "auto"], "cannot be used with --dp-codec auto: it measures"),
    (["--dp-sync-every", "4", "--dp-codec", " AUTO:candidates=fp32+blockwise8"], "--dp-codec auto: it measures"),
    (["--dp-sync-every", "4", "--outer-lr", "0"], "--outer-lr must be > 0, got 0.0"),
    (["--dp-sync-every", "4", "--outer-momentum", "1"], "--outer-momentum must be >= 0 and < 1, got 1.0"),
    (["--dp-sync-every", "4", "--dp-sync-overlap", "4"], "--dp-sync-overlap must be >= 0 and < --dp-sync-every (4)"),
    (["--dp-sync-overlap", "1"], "--dp-sync-overlap 1 overlaps DiLoCo's meetings with training: add --dp-sync-every"),
    (["--dp-sync-every", "4", "--dp-sync-fragments", "3"], "--dp-sync-fragments must be >= 1 and divide "
                                                            "--dp-sync-every (4), so that the fragments meet evenly"),
    (["--dp-sync-every", "4", "--dp-sync-fragments", "2", "--dp-sync-overlap", "2"],
     "--dp-sync-overlap must be >= 0 and < --dp-sync-every / --dp-sync-fragments (2): a meeting's outer step"),
    (["--dp-sync-fragments", "2"], "--dp-sync-fragments 2 cuts DiLoCo's meetings into fragments: add --dp-sync-every"),
    (["--dp-error-feedback"], "--dp-error-feedback compensates the quantization of DiLoCo's pseudo-gradients: add"),
])
def test_diloco_options_a_run_cannot_use_fail_before_any_rank_starts(env, argv, needle, tmp_path: Path,
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never-started"
    assert main(["train", "--model", "llama-tiny", "--stages", "1", "--dp", "2", *argv, "--out", str(out)]) == 1
    last = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()][-1]
    assert last.startswith("qwire train: error: ") and needle in last, last
    assert not out.exists()


def test_diloco_with_one_replica_is_noted(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--stages", "1", "--dp-sync-every", "4", "--dp-error-feedback", "--dp-sync-fragments", "2",
                 "--steps", "0", "--out", str(tmp_path / "x")]) == 1
    err = capfd.readouterr().err
    assert "qwire train: note: --dp-sync-every 4 has no effect: --dp is 1" in err
    assert "qwire train: note: --dp-error-feedback has no effect: --dp is 1" in err
    assert "qwire train: note: --dp-sync-fragments 2 has no effect: --dp is 1" in err
    assert main(["train", "--stages", "1", "--dp", "2", "--dp-sync-every", "4", "--dp-error-feedback", "--dp-codec",
                 "fp32", "--steps", "0", "--out", str(tmp_path / "x")]) == 1
    assert ("qwire train: note: --dp-error-feedback has no effect: --dp-codec fp32 loses nothing to feed back"
            in capfd.readouterr().err)


def test_the_run_header_names_the_diloco_settings() -> None:
    cfg = TrainConfig(stages=2, dp=2, dp_sync_every=8, dp_sync_fragments=4, dp_sync_overlap=1,
                      dp_error_feedback=True, dp_codec="int2")
    assert cfg.describe() == ("2 stages x DP 2 (int2, DiLoCo: meeting every 8 steps in 4 fragments, one every 2, "
                              "landing 1 later, error feedback)")
    assert TrainConfig(stages=2, dp=2, dp_sync_every=8).describe() == \
        "2 stages x DP 2 (blockwise8:block=256, DiLoCo: meeting every 8 steps)"
    assert TrainConfig(stages=1, dp=2, dp_shard=True, dp_param_codec="fp8").describe() == \
        "1 stage x DP 2 (FSDP, gradients blockwise8:block=256, weights fp8)"
