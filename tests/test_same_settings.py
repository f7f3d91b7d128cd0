"""What the processes of one job must agree on (:func:`qwire.parallel.mesh.check_same_config`), beyond their
options as written."""

from __future__ import annotations

import pytest

from dist_utils import run_distributed
from qwire.procs import TrainError


def _disagree(rank: int, world: int, case: str) -> str:
    """``check_same_config`` on two ranks that differ in ``case`` (rank 1 does); its error, or "" where none."""
    import dataclasses

    import qwire
    from qwire import config
    from qwire.parallel import mesh
    from qwire.train import TrainConfig

    cfg, resume = TrainConfig(fwd_codec="int4"), None
    if rank == 1:
        if case == "spelling":
            cfg = TrainConfig(fwd_codec="int:bits=4,tile=32")
        elif case == "default":  # another version of qwire builds the same option with another default
            real = config.codec_pins
            config.codec_pins = lambda c: {**real(c), "fwd_codec": real(c)["fwd_codec"].replace("tile=32", "tile=64")}
        elif case == "version":
            qwire.__version__ = "0.2.0"
        elif case == "option":  # a version of qwire with an option more
            real_asdict = dataclasses.asdict
            mesh.dataclasses = type("D", (), {"asdict": staticmethod(lambda c: {**real_asdict(c), "new_knob": 0})})
        elif case == "resume":
            resume = True
    try:
        mesh.check_same_config(cfg, resume if rank == 1 else False if case == "resume" else None)
    except TrainError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("case, needle", [
    ("spelling", ""),  # one codec, written two ways
    ("default", "rank 1: --fwd-codec 'int4' builds 'int:"),
    ("version", "rank 1: qwire 0.2.0 and torch "),
    ("option", "rank 1: --new-knob is an option here (rank 0: not an option)"),
    ("resume", "rank 1: resumes the run (rank 0: starts a new run)"),
])
def test_ranks_that_disagree_are_named_on_every_rank(case, needle):
    """What two machines can disagree on beyond their options as written: the codec an option builds (a version
    whose defaults differ trained DP with garbled gradients), the versions, an option one version lacks (rank 0
    passed the check and failed later on a closed connection), whether to resume (both waited out --timeout)."""
    got = run_distributed(_disagree, 2, (case,))
    for msg in got:
        if not needle:
            assert msg == ""
        else:
            assert msg.startswith("ranks were started with different settings") and needle in msg, msg


def _model_check(rank: int, world: int, case: str) -> str:
    import torch

    from qwire.parallel.mesh import check_same_model

    torch.manual_seed(rank if case == "weights" else 0)  # two checkpoints of one architecture
    model = torch.nn.Sequential(torch.nn.Linear(8, 8 + (4 * rank if case == "shapes" else 0)), torch.nn.LayerNorm(8))
    if case == "bf16":  # the same weights in another dtype on rank 1: other bytes
        model = model.to(torch.bfloat16 if rank else torch.float32)
    try:
        check_same_model(model, "give every machine the same model under --model m")
    except TrainError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("case, what", [
    ("same", ""),
    ("shapes", "its parameters' names and shapes"),
    ("weights", "the same names and shapes, other weights"),
    ("bf16", "the same names and shapes, other weights"),
])
def test_ranks_with_another_model_are_named_also_where_only_its_weights_differ(case, what):
    """Two directories under one --model path trained a mix of two models: names and shapes were compared, not
    the weights (two checkpoints of one architecture)."""
    for msg in run_distributed(_model_check, 2, (case,)):
        if not what:
            assert msg == ""
        else:
            assert msg == f"ranks [1] have a different model ({what}) than rank 0; give every machine the same " \
                          "model under --model m", msg
