"""``qwire train``: pipeline-parallel training of a causal LM with compressed stage boundaries.

Read top to bottom: configuration, launching, one worker's life (process
group, data, model stage, schedule, optimizer, loop, evaluation,
checkpoints), then the command line.

With no arguments it trains a tiny Llama on the Python standard library's
source with 4 pipeline stages as 4 local gloo processes, TAH-Quant on the
activations going forward and 6-bit per-channel gradients going back.
Under ``torchrun`` (RANK/WORLD_SIZE set) the same code runs one stage per
process across machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shutil
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# -----------------------------------------------------------------------------------------------
# Configuration: a plain object; every field is a command-line option of the same name.


@dataclass
class TrainConfig:
    stages: int = 4                 # pipeline stages = processes (one stage per process)
    schedule: str = "1f1b"          # gpipe | 1f1b
    microbatches: int = 4           # micro-batches per step (batch_size must be divisible)
    batch_size: int = 8             # sequences per optimizer step
    seq_len: int = 128
    model: str = "llama-tiny"       # preset name or a local model directory
    split: str = ""                 # decoder layers per stage, e.g. "3,2,2,1" (default: even)
    corpus: str = "stdlib"          # "stdlib", a file, a folder, or "jsonl:PATH"
    vocab_size: int = 4096
    fwd_codec: str = "tahquant"     # activations going forward
    bwd_codec: str = "perchannel6"  # gradients going back
    optimizer: str = "adamw"        # adamw | sgd
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup: int = 20                # linear warm-up steps, then cosine decay to lr/10
    grad_clip: float = 1.0          # max global grad norm (0 disables)
    seed: int = 0
    steps: int = 300
    device: str = "cpu"             # cpu (gloo) | cuda (nccl)
    eval_every: int = 100           # steps between validation runs (0: only at the end)
    eval_batches: int = 8
    log_every: int = 10
    checkpoint_every: int = 100     # steps between checkpoints (0: only at the end)
    out: str = ""                   # run directory (default: runs/<time>-<fwd>)
    timeout: float = 300.0          # seconds any rendezvous or collective may wait
    max_tokens: int = 0             # cap on corpus tokens (0: the corpus default)
    link: str = ""                  # rate-limited links between ranks, e.g. "100mbit,delay=20ms" (network lab)
    link_pp: str = ""               # links between pipeline stages (default: --link)
    link_tp: str = ""               # links between tensor-parallel ranks (default: --link)
    link_dp: str = ""               # links between data-parallel replicas (default: --link)
    tp: int = 1                     # tensor-parallel ranks per stage (Llama/Qwen2 models)
    tp_codec: str = "fp8"           # codec of the tensor-parallel collectives, forward and backward
    dp: int = 1                     # data-parallel replicas of the whole pipeline
    dp_codec: str = "blockwise8:block=256"  # codec of the data-parallel gradient all-reduce (QuanGrad)
    laaq: str = ""                  # low-bit saved activations: agoq | int4 | uniform4 | keep ("" off)

    @property
    def uses_links(self) -> bool:
        """Whether any rate-limited link was asked for (the run then goes through qwire.netlab)."""
        return bool(self.link or self.link_pp or self.link_tp or self.link_dp)

    @property
    def world(self) -> int:
        return self.stages * self.tp * self.dp

    def validate(self) -> None:
        if self.stages < 1:
            raise ValueError(f"--stages must be >= 1, got {self.stages}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}")
        if self.microbatches < 1 or self.batch_size % self.microbatches:
            raise ValueError(
                f"--batch-size ({self.batch_size}) must be a positive multiple of --microbatches "
                f"({self.microbatches})"
            )
        if self.schedule == "1f1b" and self.microbatches < self.stages:
            raise ValueError(f"the 1f1b schedule needs --microbatches >= --stages ({self.stages}), got "
                             f"{self.microbatches}; raise --microbatches or use --schedule gpipe")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"--optimizer must be adamw or sgd, got {self.optimizer!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device")
        for name in ("link", "link_pp", "link_tp", "link_dp"):
            if getattr(self, name):
                from qwire.netlab import parse_link
                try:
                    parse_link(getattr(self, name))  # a bad link spec fails before anything starts
                except ValueError as e:
                    raise ValueError(f"--{name.replace('_', '-')}: {e}") from None
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"--tp and --dp must be >= 1, got {self.tp} and {self.dp}")
        if self.laaq and self.laaq not in LAAQ_POLICIES:
            raise ValueError(f"--laaq must be one of {', '.join(LAAQ_POLICIES)} (or empty), got {self.laaq!r}")
        if self.steps < 1 or self.seq_len < 2 or self.timeout <= 0:
            raise ValueError("--steps must be >= 1, --seq-len >= 2 and --timeout > 0")
        from qwire.codecs import get_codec
        for c in (self.fwd_codec, self.bwd_codec, self.tp_codec, self.dp_codec):
            get_codec(c)  # raises a CodecError that says what is wrong with the spec

    def split_list(self) -> list[int] | None:
        if not self.split:
            return None
        try:
            parts = [int(p) for p in self.split.split(",")]
        except ValueError as e:
            raise ValueError(f"--split must be comma-separated layer counts like 3,2,2,1, got {self.split!r}") from e
        if len(parts) != self.stages:
            raise ValueError(f"--split gives {len(parts)} stages but --stages is {self.stages}")
        return parts


def _schedules() -> dict[str, Any]:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


SCHEDULES = ("gpipe", "1f1b")

# --laaq policies: keyword arguments of qwire.memory.LAAQPolicy; "stage_aware" applies AGoQ's
# per-stage bits b_i = max(4, 4 N_1 / N_i) from the micro-batches each stage holds in flight.
LAAQ_POLICIES: dict[str, dict[str, Any]] = {
    "agoq": {"bits": 4, "fmt": "fp", "block": 128, "recompute": (r"mlp$",), "stage_aware": True},
    "int4": {"bits": 4, "fmt": "int", "block": 128, "stage_aware": True},
    "uniform4": {"bits": 4, "fmt": "fp", "block": 128, "keep_attention": False, "stage_aware": False},
    "keep": {"fmt": "none", "stage_aware": False},
}


class TrainError(RuntimeError):
    """A training run failed for a reason the user can act on."""


# -----------------------------------------------------------------------------------------------
# Launching: under torchrun, run the worker in this process; otherwise spawn one process per stage.


def launch(cfg: TrainConfig, resume: bool = False) -> dict[str, Any]:
    cfg.validate()
    run_dir = Path(cfg.out)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg, resume, None)
    if cfg.uses_links:
        # Every rank in its own network namespace behind a shaped link (qwire.netlab).
        from qwire.netlab import launch_in_lab
        return launch_in_lab(cfg, resume)
    import torch.multiprocessing as mp
    port = _free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    try:
        mp.start_processes(worker, args=(cfg.world, cfg, resume, (port, queue)), nprocs=cfg.world,
                           start_method="spawn", join=True)
    except mp.ProcessExitedException as e:
        raise TrainError(
            f"rank {e.error_index} died ({_exit_reason(e.exit_code)}); the other ranks were stopped. "
            f"Continue from the last checkpoint with: qwire train --resume --out {run_dir}"
        ) from None
    except mp.ProcessRaisedException as e:
        msg = str(e).strip().splitlines()
        last = msg[-1] if msg else "unknown error"
        raise TrainError(f"a rank failed: {last}\n(full traceback above; run directory {run_dir})") from None
    summary = queue.get() if not queue.empty() else {}
    return summary


def main_worker(config_path: str, resume: bool = False) -> dict[str, Any]:
    """Run one rank from a saved config; rank and rendezvous come from the environment
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun sets them). Used by launchers
    that start each rank themselves, e.g. inside a network namespace."""
    cfg = TrainConfig(**json.loads(Path(config_path).read_text()))
    return worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg, resume, None)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -----------------------------------------------------------------------------------------------
# One worker = one pipeline stage.


def worker(rank: int, world: int, cfg: TrainConfig, resume: bool,
           local: tuple[int, Any] | None) -> dict[str, Any]:
    if local is not None:  # spawned locally: rendezvous on loopback
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(local[0]), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        summary = _run(rank, world, cfg, resume)
    except Exception as e:
        print(f"[rank {rank}] error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if not isinstance(e, TrainError | ValueError):
            traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if local is not None and rank == 0:
        local[1].put(summary)
    return summary


def _run(rank: int, world: int, cfg: TrainConfig, resume: bool) -> dict[str, Any]:
    from qwire.data import build_datasets, iterate_batches
    from qwire.models import build_model, lm_loss, split_model
    from qwire.parallel.pipeline import (
        boundary_bytes,
        codec_cache_nbytes,
        codec_state,
        compressed_pipeline_stage,
        load_codec_state,
        set_codec_phase,
        stateful_codecs,
    )

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if cfg.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.timeout))
    # Every rank must run the same configuration (under torchrun each machine parses its own options).
    _check_same_config(cfg, rank)
    if world != cfg.world:
        raise TrainError(f"--pp {cfg.stages} x --tp {cfg.tp} x --dp {cfg.dp} needs {cfg.world} processes, "
                         f"but WORLD_SIZE is {world}; start {cfg.world} processes (torchrun --nproc-per-node x "
                         "--nnodes) or change the mesh")
    # Layout: rank = (dp_rank * stages + pp_rank) * tp + tp_rank, one DeviceMesh ("dp", "pp", "tp")
    # with a process group per dimension (each with --timeout).
    dp_rank, pp_rank, tp_rank = rank // (cfg.stages * cfg.tp), rank // cfg.tp % cfg.stages, rank % cfg.tp
    mesh = _mesh(rank, cfg, device)
    pp_group, tp_group, dp_group = (mesh["pp"].get_group(), mesh["tp"].get_group(), mesh["dp"].get_group()) \
        if mesh is not None else (None, None, None)
    is_first, is_last = pp_rank == 0, pp_rank == cfg.stages - 1
    run_dir = Path(cfg.out)
    log = _Logger(run_dir, rank == 0)

    # Data: the first rank on each machine builds the tokenizer and token caches, the rest wait.
    if local_rank != 0:
        dist.barrier()
    train_ds, val_ds, tokenizer = build_datasets(corpus=cfg.corpus, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size,
                                                 seed=cfg.seed, max_tokens=cfg.max_tokens or None)
    if local_rank == 0:
        dist.barrier()
    _check_same_everywhere("data set (corpus + tokenizer)", train_ds.info["fingerprint"], rank,
                           "give every machine the same corpus files (the stdlib corpus differs between "
                           "Python versions; use a file or folder corpus on mixed machines)")
    batches_per_epoch = len(train_ds) // cfg.batch_size
    if batches_per_epoch < 1:
        raise TrainError(f"the corpus has {len(train_ds)} training sequences of {cfg.seq_len + 1} tokens, "
                         f"fewer than one batch of {cfg.batch_size}; lower --batch-size or --seq-len")

    # Model: every rank builds the same model from the seed and keeps its own stage.
    model = build_model(cfg.model, vocab_size=tokenizer.vocab_size, seed=cfg.seed)
    hidden = model.config.hidden_size
    n_params = sum(p.numel() for p in model.parameters())
    stage_module = split_model(model, cfg.stages, cfg.split_list())[pp_rank].to(device).train()
    del model
    if cfg.tp > 1:  # compressed tensor parallelism inside the stage (TACO styles)
        from qwire.parallel.tp import apply_tp
        assert mesh is not None
        apply_tp(stage_module, mesh["tp"], codec=cfg.tp_codec)
    wrap, dp_state = None, None
    # Data parallelism with QuanGrad's 8-bit all-reduce: as a DDP communication hook (overlapping
    # backward), or, on tensor-parallel stages (DTensor parameters), after backward on the local shards.
    dp_after_backward = cfg.dp > 1 and cfg.tp > 1
    if cfg.dp > 1:
        from torch.nn.parallel import DistributedDataParallel

        from qwire.comm.ddp_hooks import QuanGradState, quangrad_hook
        dp_state = QuanGradState(process_group=dp_group, codec=cfg.dp_codec)

    if cfg.dp > 1 and not dp_after_backward:
        def wrap(m: torch.nn.Module) -> torch.nn.Module:
            ddp = DistributedDataParallel(m, process_group=dp_group)
            ddp.register_comm_hook(dp_state, quangrad_hook)
            return ddp
    laaq_handle = None
    if cfg.laaq:  # compressed storage of what autograd saves for backward (AGoQ's LAAQ)
        from qwire.memory import LAAQPolicy, apply_laaq
        kw = dict(LAAQ_POLICIES[cfg.laaq])
        policy = LAAQPolicy(**{k: v for k, v in kw.items() if k != "stage_aware"})
        if kw["stage_aware"]:
            policy = policy.for_stage(pp_rank, cfg.stages, cfg.schedule, cfg.microbatches)
        laaq_handle = apply_laaq(stage_module, policy)
    mb = cfg.batch_size // cfg.microbatches
    example = (torch.zeros(mb, cfg.seq_len, dtype=torch.long, device=device) if is_first
               else torch.zeros(mb, cfg.seq_len, hidden, device=device))
    stage = compressed_pipeline_stage(stage_module, pp_rank, cfg.stages, device, input_args=example,
                                      fwd=cfg.fwd_codec, bwd=cfg.bwd_codec, group=pp_group, wrap=wrap)
    schedule = _schedules()[cfg.schedule](stage, cfg.microbatches, loss_fn=lm_loss)
    # A stateful forward codec (AQ-SGD) needs each micro-batch's sample ids on stage 0; they travel in
    # its payloads to the later stages. Its warm-up phase (codec option warmup=...) is the first epoch.
    from qwire.codecs import get_codec
    fwd_codec = get_codec(cfg.fwd_codec)
    stateful = bool(fwd_codec.stateful)
    warmup_epoch = stateful and getattr(fwd_codec, "warmup_codec", None) is not None

    params = [p for p in stage_module.parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                       betas=(0.9, 0.95))
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg.warmup, cfg.steps))

    start_step = 0
    if resume:
        start_step = _load_checkpoint(run_dir, _ckpt_name(pp_rank, tp_rank, cfg), stage_module, opt, sched)
        if stateful_codecs(stage):
            load_codec_state(stage, _load_codec_checkpoint(run_dir, rank))
        log.truncate(start_step)
        log.say(f"resumed from step {start_step} in {run_dir}")
    elif rank == 0:
        layout = f"{cfg.stages} stages" + (f" x TP {cfg.tp} ({cfg.tp_codec})" if cfg.tp > 1 else "") + (
            f" x DP {cfg.dp} ({cfg.dp_codec})" if cfg.dp > 1 else "")
        log.say(f"qwire train: {layout}, {_count(n_params)} params ({cfg.model}), "
                f"{cfg.schedule}, {cfg.microbatches} micro-batches of {mb} x {cfg.seq_len} tokens; "
                f"fwd {cfg.fwd_codec}, bwd {cfg.bwd_codec}; {len(train_ds)} train / {len(val_ds)} val sequences; "
                f"run dir {run_dir}")

    def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        epoch, k = divmod(step * cfg.dp + dp_rank, batches_per_epoch)  # each DP replica its own batch
        x, y, ids = next(iter(iterate_batches(train_ds, cfg.batch_size, seed=cfg.seed, epoch=epoch, start_batch=k)))
        return x.to(device), y.to(device), ids, epoch

    def pipeline_step(x: torch.Tensor, y: torch.Tensor, train: bool, ids: torch.Tensor | None = None) -> float:
        losses: list[torch.Tensor] = []
        run = schedule.step if train else schedule.eval
        kw = {"sample_ids": ids} if stateful and is_first else {}
        if is_first and is_last:
            run(x, target=y, losses=losses)
        elif is_first:
            run(x, **kw)
        elif is_last:
            run(target=y, losses=losses)
        else:
            run()
        return float(torch.stack([v.detach().float() for v in losses]).mean()) if losses else 0.0

    def evaluate() -> float:
        total = 0.0
        n = min(cfg.eval_batches, len(val_ds) // cfg.batch_size)
        if n < 1:
            return float("nan")
        it = iter(iterate_batches(val_ds, cfg.batch_size, seed=0, epoch=0))
        set_codec_phase(stage, use_cache=False, warming=False)  # validation samples are never cached
        with torch.no_grad():
            for _ in range(n):
                x, y, ids = next(it)
                total += pipeline_step(x.to(device), y.to(device), train=False, ids=ids)
        set_codec_phase(stage, use_cache=True)
        return _sum_over_ranks([total / n if is_last and tp_rank == 0 else 0.0], device)[0] / cfg.dp

    # The loop. Every rank walks the same batches; stage 0 feeds inputs, the last stage the labels.
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.dp
    from qwire.comm.collectives import comm_seconds, sent_bytes
    from qwire.comm.ddp_hooks import allreduce_gradients

    def dp_bytes() -> int:
        return dp_state.wire_bytes if dp_state is not None else 0
    t_start = time.perf_counter()
    def wire() -> dict[str, int]:
        return {**boundary_bytes(stage), "tp": sent_bytes() - dp_bytes(), "dp": dp_bytes()}

    last = wire()
    totals = {"fwd": 0.0, "bwd": 0.0, "fp32": 0.0, "tp": 0.0, "dp": 0.0}
    val_loss = float("nan")
    loss = float("nan")
    for step in range(start_step + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        x, y, ids, epoch = batch_at(step - 1)
        if warmup_epoch:
            set_codec_phase(stage, warming=epoch == 0)
        opt.zero_grad(set_to_none=True)
        c0 = comm_seconds()
        loss_here = pipeline_step(x, y, train=True, ids=ids)
        t_tp = comm_seconds() - c0  # TP collectives run inside forward and backward, on this thread
        t_dp = allreduce_gradients(params, dp_state) if dp_after_backward and dp_state is not None else 0.0
        now = wire()
        if laaq_handle is not None:  # peak bytes the saved-tensor hooks held this step (logged by stage 0, which
            # holds the most micro-batches in flight)
            record_laaq, laaq_handle.stats.peak_bytes = laaq_handle.stats.peak_bytes, laaq_handle.stats.live_bytes
        sums = _sum_over_ranks([loss_here if is_last and tp_rank == 0 else 0.0, _grad_sq(params, cfg.tp)] +
                               [now[k] - last[k] for k in WIRE_KEYS], device)
        last = now
        # every DP replica holds the same (all-reduced) gradients and reports its own loss
        loss, grad_norm = sums[0] / cfg.dp, math.sqrt(sums[1] / cfg.dp)
        if not math.isfinite(loss):
            raise TrainError(f"loss became {loss} at step {step}; lower --lr (now {cfg.lr}) or check the codecs")
        if cfg.grad_clip > 0 and grad_norm > cfg.grad_clip:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(cfg.grad_clip / (grad_norm + 1e-6))
        opt.step()
        sched.step()
        dt = time.perf_counter() - t0
        for k, v in zip(WIRE_KEYS, sums[2:]):
            totals[k] += v
        record = {"step": step, "loss": loss, "tokens": step * tokens_per_step,
                  "tokens_per_s": tokens_per_step / dt, "step_time_s": dt, "lr": sched.get_last_lr()[0],
                  "grad_norm": grad_norm, "wire_bytes_fwd": int(sums[2]), "wire_bytes_bwd": int(sums[3]),
                  "fp32_bytes": int(sums[4]), "wire_bytes_tp": int(sums[5]), "wire_bytes_dp": int(sums[6])}
        if cfg.tp > 1:
            record["time_tp_s"] = t_tp  # this rank (rank 0): seconds in TP collectives
        if dp_after_backward:
            record["time_dp_s"] = t_dp  # seconds of the gradient all-reduce after backward
        if laaq_handle is not None:
            record["laaq_saved_peak_bytes"] = int(record_laaq)
        if stateful:
            record["epoch"] = epoch
        is_eval = (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps
        if is_eval:
            val_loss = evaluate()
            record["val_loss"] = val_loss
            last = wire()  # validation traffic is not part of any training step
        log.metric(record)
        if rank == 0 and (step % cfg.log_every == 0 or is_eval or step == start_step + 1):
            log.progress(record, cfg.steps, time.perf_counter() - t_start, step - start_step)
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps:
            _save_checkpoint(run_dir, _ckpt_name(pp_rank, tp_rank, cfg) if dp_rank == 0 else None, local_rank,
                             step, stage_module, opt, sched, codec_state(stage), rank)
            if rank == 0:
                log.plot()

    elapsed = time.perf_counter() - t_start
    steps_done = max(1, cfg.steps - start_step)
    summary = {"steps": cfg.steps, "final_loss": loss, "val_loss": val_loss,
               "tokens_per_s": steps_done * tokens_per_step / elapsed, "elapsed_s": elapsed,
               "wire_bytes_fwd": totals["fwd"], "wire_bytes_bwd": totals["bwd"], "fp32_bytes": totals["fp32"],
               "wire_bytes_tp": totals["tp"], "wire_bytes_dp": totals["dp"],
               "run_dir": str(run_dir)}
    if stateful:  # AQ-SGD's caches: what TAH-Quant avoids (all ranks, both sides of every boundary)
        cache = codec_cache_nbytes(stage)
        summary["aqsgd_cache_bytes"] = int(_sum_over_ranks([float(cache["total"])], device)[0])
        summary["aqsgd_cache_bytes_per_sample"] = cache["per_sample"]  # per boundary and side
        codecs = stateful_codecs(stage)
        summary["aqsgd_cached_samples"] = len(next(iter(codecs.values())).cache) if codecs else 0
    if rank == 0:
        log.summary(summary, cfg)
    return summary


WIRE_KEYS = ("fwd", "bwd", "fp32", "tp", "dp")


def _check_same_config(cfg: TrainConfig, rank: int) -> None:
    """Every rank must have the same mesh, codecs, model and data settings (``out`` and ``device`` may differ)."""
    mine = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "device", "link", "link_pp",
                                                                          "link_tp", "link_dp")}
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, mine)
    problems = []
    for r, v in enumerate(values):
        diff = sorted(k for k in mine if v.get(k) != values[0].get(k))
        if diff:
            problems.append(f"rank {r}: " + ", ".join(f"--{k.replace('_', '-')} {v.get(k)!r} (rank 0: "
                                                      f"{values[0].get(k)!r})" for k in diff))
    if problems:
        raise TrainError("ranks were started with different settings; give every rank the same options:\n  "
                         + "\n  ".join(problems))


def _mesh(rank: int, cfg: TrainConfig, device: torch.device) -> Any:
    """One ``DeviceMesh`` of shape (dp, pp, tp) over this job's ranks, built from process groups that
    have --timeout (None for a pure pipeline, which uses the default group)."""
    if cfg.tp == 1 and cfg.dp == 1:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    pp, tp, dp = _groups(rank, cfg)
    layout = torch.arange(cfg.world).view(cfg.dp, cfg.stages, cfg.tp)
    return DeviceMesh.from_group([dp, pp, tp], device.type, mesh=layout, mesh_dim_names=("dp", "pp", "tp"))


def _groups(rank: int, cfg: TrainConfig) -> tuple[Any, Any, Any]:
    """This rank's pipeline, tensor-parallel and data-parallel process groups.

    Every rank creates every group (``new_group`` is collective), each with --timeout.
    """
    timeout = datetime.timedelta(seconds=cfg.timeout)
    P, T, D = cfg.stages, cfg.tp, cfg.dp
    mine: list[Any] = [None, None, None]
    families = [  # (slot, list of rank lists)
        (0, [[(d * P + p) * T + t for p in range(P)] for d in range(D) for t in range(T)]),
        (1, [[(d * P + p) * T + t for t in range(T)] for d in range(D) for p in range(P)]),
        (2, [[(d * P + p) * T + t for d in range(D)] for p in range(P) for t in range(T)]),
    ]
    for slot, rank_lists in families:
        for ranks in rank_lists:
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[slot] = g
    return mine[0], mine[1], mine[2]


def _grad_sq(params: list[torch.nn.Parameter], tp: int) -> float:
    """This rank's share of the squared global gradient norm (tensor-parallel replicas counted once)."""
    total = 0.0
    for p in params:
        g = p.grad
        if g is None:
            continue
        weight = 1.0
        if hasattr(g, "to_local"):  # DTensor: a replicated gradient lives on every TP rank
            weight = 1.0 / tp if all(pl.is_replicate() for pl in g.placements) else 1.0
            g = g.to_local()
        total += weight * float(g.float().pow(2).sum())
    return total


def _ckpt_name(pp_rank: int, tp_rank: int, cfg: TrainConfig) -> str:
    return f"stage{pp_rank}.pt" if cfg.tp == 1 else f"stage{pp_rank}-tp{tp_rank}.pt"


def _check_same_everywhere(what: str, value: str, rank: int, fix: str) -> None:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        raise TrainError(f"ranks {differ} have a different {what} than rank 0; {fix}")


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


# -----------------------------------------------------------------------------------------------
# Checkpoints: each rank writes its stage atomically; a pointer file names the last complete one.


def _load_codec_checkpoint(run_dir: Path, rank: int) -> dict[str, Any]:
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    path = run_dir / "checkpoints" / latest["dir"] / f"codecs-rank{rank}.pt"
    if not path.exists():
        raise TrainError(f"--resume: {path} (the per-sample caches of the forward codec) is missing")
    return torch.load(path, map_location="cpu", weights_only=False)


def _save_checkpoint(run_dir: Path, name: str | None, local_rank: int, step: int, module: torch.nn.Module,
                     opt: torch.optim.Optimizer, sched: Any, codecs: dict[str, Any] | None = None,
                     rank: int = 0) -> None:
    """Write this rank's stage as ``name`` (None: a DP replica, whose state equals replica 0's), and the
    state of its stateful codecs (AQ-SGD's caches differ on every rank) as ``codecs-rank<rank>.pt``."""
    ckdir = run_dir / "checkpoints" / f"step_{step:07d}"
    ckdir.mkdir(parents=True, exist_ok=True)
    if name is not None:
        state = {"step": step, "model": module.state_dict(), "optimizer": opt.state_dict(),
                 "scheduler": sched.state_dict(), "rng": torch.get_rng_state()}
        _atomic_torch_save(state, ckdir / name)
    if codecs:
        _atomic_torch_save(codecs, ckdir / f"codecs-rank{rank}.pt")
    dist.barrier()  # every stage of this step is on disk before the pointer moves
    if local_rank == 0:
        _atomic_write(run_dir / "checkpoints" / "latest.json", json.dumps({"step": step, "dir": ckdir.name}))
        for old in sorted((run_dir / "checkpoints").glob("step_*"))[:-2]:  # keep the last two
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def _load_checkpoint(run_dir: Path, name: str, module: torch.nn.Module, opt: torch.optim.Optimizer,
                     sched: Any) -> int:
    pointer = run_dir / "checkpoints" / "latest.json"
    if not pointer.exists():
        raise TrainError(f"--resume: no checkpoint in {run_dir} (expected {pointer}); start without --resume")
    latest = json.loads(pointer.read_text())
    path = run_dir / "checkpoints" / latest["dir"] / name
    if not path.exists():
        raise TrainError(f"--resume: {path} is missing; was the run made with a different --stages or --tp?")
    state = torch.load(path, map_location="cpu", weights_only=False)
    module.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# -----------------------------------------------------------------------------------------------
# Output: metrics.jsonl, progress lines, loss plot, summary (rank 0 only).


class _Logger:
    def __init__(self, run_dir: Path, active: bool):
        self.active = active
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        if active:
            run_dir.mkdir(parents=True, exist_ok=True)

    def say(self, msg: str) -> None:
        if self.active:
            print(msg, flush=True)

    def truncate(self, step: int) -> None:
        """Drop records after ``step`` (they are redone after a resume)."""
        if self.active and self.path.exists():
            keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
            _atomic_write(self.path, "".join(ln + "\n" for ln in keep))

    def metric(self, record: dict[str, Any]) -> None:
        if self.active:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def progress(self, r: dict[str, Any], total: int, elapsed: float, done: int) -> None:
        eta = elapsed / max(1, done) * (total - r["step"])
        ratio = r["fp32_bytes"] / max(1, r["wire_bytes_fwd"] + r["wire_bytes_bwd"])
        val = f" | val {r['val_loss']:.3f}" if "val_loss" in r else ""
        pp = (f" | wire fwd {_mb(r['wire_bytes_fwd'])} bwd {_mb(r['wire_bytes_bwd'])} per step "
              f"({ratio:.1f}x less than fp32)") if r["fp32_bytes"] else ""
        print(f"step {r['step']:>5}/{total} | loss {r['loss']:.3f}{val} | {r['tokens_per_s']:,.0f} tok/s{pp}"
              f"{_extra_wire(r)} | {_hms(elapsed)} elapsed, eta {_hms(eta)}", flush=True)

    def plot(self) -> None:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        recs = [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], label="train", lw=1)
        ev = [r for r in recs if "val_loss" in r]
        if ev:
            ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        tmp = self.run_dir / "loss.tmp.png"
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        os.replace(tmp, self.run_dir / "loss.png")

    def summary(self, s: dict[str, Any], cfg: TrainConfig) -> None:
        wire = s["wire_bytes_fwd"] + s["wire_bytes_bwd"]
        pp = (f"pipeline {_mb(s['wire_bytes_fwd'])} forward + {_mb(s['wire_bytes_bwd'])} backward = {_mb(wire)}; "
              f"fp32 would have sent {_mb(s['fp32_bytes'])} ({s['fp32_bytes'] / max(1, wire):.1f}x more)"
              if s["fp32_bytes"] else "no pipeline links")
        print(f"\ndone: {s['steps']} steps in {_hms(s['elapsed_s'])}, {s['tokens_per_s']:,.0f} tokens/s\n"
              f"  final train loss {s['final_loss']:.4f}, validation loss {s['val_loss']:.4f}\n"
              f"  on the wire: {pp}{_extra_wire(s)}\n"
              + (f"  AQ-SGD caches: {_mb(s['aqsgd_cache_bytes'])} over all ranks ({s['aqsgd_cached_samples']:,} "
                 f"samples x {_mb(s['aqsgd_cache_bytes_per_sample'])} per boundary side)\n"
                 if "aqsgd_cache_bytes" in s else "") +
              f"  run directory: {cfg.out} (config.json, metrics.jsonl, loss.png, checkpoints/)", flush=True)
        _atomic_write(self.run_dir / "summary.json", json.dumps(s, indent=2))


def _extra_wire(r: dict[str, Any]) -> str:
    parts = [f"{k} {_mb(r['wire_bytes_' + k])}" for k in ("tp", "dp") if r.get("wire_bytes_" + k)]
    return (" | " + ", ".join(parts)) if parts else ""


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _hms(sec: float) -> str:
    sec = int(sec)
    return f"{sec // 3600}:{sec // 60 % 60:02d}:{sec % 60:02d}" if sec >= 3600 else f"{sec // 60}:{sec % 60:02d}"


# -----------------------------------------------------------------------------------------------
# Command line: every TrainConfig field is an option; --resume continues a run directory.


def _field_help() -> dict[str, str]:
    """The comment after each TrainConfig field, so the help text lives next to the field."""
    import inspect
    import re
    out = {}
    for line in inspect.getsource(TrainConfig).splitlines():
        m = re.match(r"\s+(\w+): [^=]+=[^#]+#\s*(.*)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults, helps = TrainConfig(), _field_help()
    for f in dataclasses.fields(TrainConfig):
        flags = ["--" + f.name.replace("_", "-")] + (["--pp"] if f.name == "stages" else [])
        d = getattr(defaults, f.name)
        p.add_argument(*flags, dest=f.name, type=type(d), default=None, metavar=type(d).__name__.upper(),
                       help=helps.get(f.name, "") + f" (default: {d!r})")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a JSON or TOML file of options (keys are the option names, e.g. tp_codec or tp-codec); "
                        "options given on the command line override it")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint (its config.json is used; "
                        "--steps may be raised)")


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, bool]:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
             if getattr(args, f.name, None) is not None}
    if getattr(args, "config", None):
        given = {**load_config_file(args.config), **given}
    if args.resume:
        if not given.get("out"):
            raise ValueError("--resume needs --out RUN_DIR (the directory of the run to continue)")
        saved = Path(given["out"]) / "config.json"
        if not saved.exists():
            raise ValueError(f"--resume: {saved} not found; is {given['out']} a qwire run directory?")
        cfg = TrainConfig(**json.loads(saved.read_text()))
        ignored = sorted(k for k in given if k not in ("out", "steps") and given[k] != getattr(cfg, k))
        if ignored:
            print(f"--resume uses the run's saved config; ignoring {', '.join('--' + k for k in ignored)}",
                  file=sys.stderr)
        if "steps" in given:
            cfg.steps = given["steps"]
        return cfg, True
    cfg = TrainConfig(**given)
    if not cfg.out:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.out = str(Path("runs") / f"{stamp}-{cfg.fwd_codec.split(':')[0]}")
    return cfg, False


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Options from a JSON or TOML file, checked against TrainConfig's fields and types."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--config: {path} not found")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".toml":
            import tomllib
            raw = tomllib.loads(text)
        else:
            raw = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--config: {path} is not valid {'TOML' if path.suffix.lower() == '.toml' else 'JSON'}: "
                         f"{e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config: {path} must hold a table/object of options")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    defaults = TrainConfig()
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        name = "stages" if name == "pp" else name
        if name not in fields:
            raise ValueError(f"--config: unknown option {key!r} in {path}; options are "
                             f"{', '.join(sorted(fields))}")
        want = type(getattr(defaults, name))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ValueError(f"--config: {key} must be {want.__name__}, got {value!r} in {path}")
        out[name] = value
    return out


def run(args: argparse.Namespace) -> int:
    try:
        cfg, resume = config_from_args(args)
        cfg.validate()
        cfg.split_list()
        run_dir = Path(cfg.out)
        if not resume:
            if (run_dir / "checkpoints" / "latest.json").exists():
                raise ValueError(f"{run_dir} already holds a run; use --resume to continue it or another --out")
            run_dir.mkdir(parents=True, exist_ok=True)
            if int(os.environ.get("RANK", "0")) == 0:
                _atomic_write(run_dir / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
        launch(cfg, resume)
    except (ValueError, TrainError) as e:
        print(f"qwire train: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("qwire train: interrupted; continue with --resume", file=sys.stderr)
        return 130
    return 0
