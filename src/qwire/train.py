"""``qwire train``: pipeline-parallel training of a causal LM with compressed stage boundaries.

Read top to bottom: launching, one rank's set-up (process groups, data, model stage, parallelism,
optimizer), one training step, evaluation, the loop, the end. The pieces it uses live in their own
modules: the configuration in ``qwire.config``, the rank layout and process groups in
``qwire.parallel.mesh``, data and tensor parallelism in ``qwire.parallel.dp`` / ``qwire.parallel.tp``,
checkpoints in ``qwire.checkpoint``, metrics and progress in ``qwire.metrics``, the command line in
``qwire.train_cli``.

With no arguments it trains a tiny Llama on the Python standard library's source with 4 pipeline
stages as 4 local gloo processes, TAH-Quant on the activations going forward and 6-bit per-channel
gradients going back. Under ``torchrun`` (RANK/WORLD_SIZE set) the same code runs one stage per
process across machines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from qwire import checkpoint, watchdog
from qwire.codecs import get_codec
from qwire.codecs.aqsgd import AQSGD
from qwire.codecs.auto import Auto, auto_for
from qwire.codecs.kernels import graphs as codec_graphs
from qwire.comm.collectives import comm_seconds, sent_bytes, stages
from qwire.comm.grad_accum import GradAccumHandle, accumulate_in_8bit
from qwire.config import (
    CODEC_PINS,
    LAAQ_POLICIES,
    LINK_FIELDS,
    TrainConfig,
    codec_pins,
    load_config_file,
    with_pinned_codecs,
)
from qwire.data import TokenDataset, build_datasets, iterate_batches
from qwire.memory import LAAQPolicy, apply_laaq
from qwire.metrics import WIRE_KEYS, Logger, fmt_count, max_rss_bytes, state_bytes
from qwire.models import ModelSource, build_model, lm_loss, model_source, split_model
from qwire.netlab import launch_in_lab
from qwire.netlab.simulated import ENV_LINKS, attach_from_env
from qwire.parallel.autotune import CollectiveAutotune, PipelineAutotune, StepAutotune, autotuned
from qwire.parallel.diloco import OuterSync
from qwire.parallel.dp import DataParallel, apply_dp
from qwire.parallel.fsdp import apply_fsdp, fsdp_sent_bytes
from qwire.parallel.mesh import (
    Groups,
    Layout,
    build_groups,
    check_same_config,
    check_same_everywhere,
    check_same_model,
    max_over_ranks,
    sum_over_ranks,
)
from qwire.parallel.pipeline import (
    CompressedPipelineStage,
    boundary_bytes,
    codec_cache_nbytes,
    codec_state,
    compressed_pipeline_stage,
    load_codec_state,
    set_codec_phase,
    stateful_codecs,
)
from qwire.parallel.tp import apply_tp
from qwire.procs import (
    STOP_SIGNALS,
    RunStopped,
    TrainError,
    clear_errors,
    describe_error,
    die_with_parent,
    exit_reason,
    first_error,
    first_on_machine,
    forwarding_stop_signals,
    in_launcher_env,
    is_transport_error,
    launcher_env,
    leave_terminal,
    oom_kills,
    oom_note,
    rank_context,
    record_error,
    request_stop,
    resume_command,
    stop_signal,
    stop_signals,
)
from qwire.rendezvous import LAUNCHER_STORE_ENV, attempt_store, gpu_backend, gpu_name, launcher_store

__all__ = ["LAAQ_POLICIES", "TrainConfig", "TrainError", "launch", "load_config_file", "main_worker"]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
JOINED_KEY = "qwire/joined"  # each rank's mark in the job's store before it joins the process group


# -----------------------------------------------------------------------------------------------
# Launching: under torchrun, run the worker in this process; otherwise spawn one process per rank.


STOP_GRACE_S = 5.0


def stop_on_signals(run_dir: str) -> None:
    """In a rank's main thread: a stop signal (:data:`~qwire.procs.STOP_SIGNALS`) ends the run after the current
    step, with its checkpoint on every rank. Repeats are the same request (a scheduler signals every process
    of the job, and a launcher forwards it too); SIGKILL, or Ctrl-C, ends a rank at once."""
    if threading.current_thread() is threading.main_thread():
        for sig in stop_signals():
            signal.signal(sig, lambda signum, frame: request_stop(signum, run_dir))
        if stop_signal() == signal.SIGHUP:  # a hang-up before this (in_launcher_env noted it): off the terminal now
            leave_terminal(run_dir)


def launch(cfg: TrainConfig, resume: bool = False) -> dict[str, Any]:
    """Run ``cfg`` to the end (or, with ``resume``, from the last checkpoint in ``cfg.out``); returns rank 0's
    summary. The run directory gets the configuration as ``config.json`` (what ``--resume`` reads). Raises
    :class:`~qwire.procs.RunStopped` when a stop signal (SIGTERM, SIGHUP) stopped the run after a step (with its
    checkpoint)."""
    summary = _launch(cfg, resume)
    if summary.get("stopped_at") is not None:
        raise RunStopped(int(summary["stopped_at"]), cfg.out, stop_signal())
    return summary


def resumed_codecs(cfg: TrainConfig) -> TrainConfig:
    """The codecs a resumed run started with: ``cfg`` with each codec option that this version builds otherwise
    than the run's ``codecs.json`` pins it (a default changed since) replaced by the run's codec, with a note.
    (A run started by a version without that file gets one from :func:`_launch`, pinning the codecs it continues
    with.)"""
    path = Path(cfg.out) / CODEC_PINS
    if not path.exists():
        return cfg
    try:
        pins = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"--resume: {path} is not valid JSON ({e}); delete it to continue with the codecs this "
                         "version of qwire builds from the run's config.json") from None
    if not isinstance(pins, dict) or not all(isinstance(v, str) for v in pins.values()):
        raise ValueError(f"--resume: {path} must map codec options to spec strings; delete it to continue with the "
                         "codecs this version of qwire builds from the run's config.json")
    cfg, notes = with_pinned_codecs(cfg, pins)
    if notes:
        cfg.validate()
        if first_on_machine():
            for note in notes:
                print(note, file=sys.stderr)
    return cfg


def _launch(cfg: TrainConfig, resume: bool) -> dict[str, Any]:
    cfg.validate()
    given = cfg  # config.json keeps the options as given; a resumed run's codecs are those it started with
    if resume:
        cfg = resumed_codecs(cfg)
    if first_on_machine():  # every machine's run directory gets it: --resume reads it there
        out = Path(cfg.out)
        path = out / "config.json"
        try:
            out.mkdir(parents=True, exist_ok=True)
            checkpoint.atomic_write(path, json.dumps(dataclasses.asdict(given), indent=2))
            path = out / CODEC_PINS  # a new run's (in a directory reused after a run that failed before its
            if not resume or not path.exists():  # first step too), or a resumed run's that had none
                checkpoint.atomic_write(path, json.dumps(codec_pins(cfg), indent=2))
        except OSError as e:
            raise checkpoint.RunWriteError(out, path, e) from e
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun's worker: it ends with its agent, as a local rank
            die_with_parent()  # with its launcher (an agent killed by SIGKILL left it training, holding --out)
        return worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg, resume, None)
    if cfg.uses_links:  # every rank in its own network namespace behind a shaped link (qwire.netlab)
        return launch_in_lab(cfg, resume, saved=given)
    ctx = rank_context()
    queue = ctx.SimpleQueue()
    clear_errors(cfg.out)
    call = pickle.dumps((worker, (cfg.world, cfg, resume)))
    store = launcher_store(cfg.timeout)  # held here for the run: it outlives any rank
    oom_before = oom_kills()
    started: list[Any] = []  # the ranks' processes, once they exist
    try:
        # after a rank fails, the others get STOP_GRACE_S to exit on their own (they fail at once on the broken
        # connection), then SIGTERM (which a rank acts on after its step), then SIGKILL after as long again: a
        # stopped or stuck rank costs 2 x STOP_GRACE_S, not torch's default 30 s. A stop signal is passed on from
        # before the ranks start: one sent while they start waits (blocked) until they can be given it.
        with forwarding_stop_signals(lambda: [p.pid for s in started for p in s.processes if p.is_alive()],
                                     then=lambda signum: request_stop(signum, cfg.out)):
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # a spawned rank starts with them
            try:  # blocked, as a forked one, until in_launcher_env takes them (a stop, not a kill, at its start)
                started.append(mp.start_processes(in_launcher_env, args=(launcher_env(), call, (store.port, queue)),
                                                  nprocs=cfg.world, start_method=ctx.get_start_method(), join=False))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            if stop_signal() is not None:  # it came before there were ranks to pass it to (again: the same request)
                for p in started[0].processes:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, stop_signal())
            while not started[0].join(grace_period=STOP_GRACE_S):
                pass
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        raise TrainError(failure_message(cfg, e, oom_before)) from None
    finally:
        del store
    return queue.get() if not queue.empty() else {}


def failure_message(cfg: TrainConfig, e: Exception, oom_before: int | None = None) -> str:
    """What to tell the user when a rank failed: a rank killed by a signal is named with the signal;
    otherwise the first error any rank recorded is the root cause, and it comes last. Where the kernel's
    out-of-memory killer ended processes since the ranks started (``oom_before``: :func:`~qwire.procs.oom_kills`
    then) and no rank recorded an error of its own (only a peer's broken connection, or nothing), that comes
    last."""
    rec = first_error(cfg.out)
    resume_failed = rec is not None and rec["type"] == "TrainError" and "--resume" in rec["message"]
    resume = (f" Continue from the last checkpoint with: {resume_command(cfg.out)}"
              if checkpoint.latest_step(Path(cfg.out)) is not None and not resume_failed else "")
    oom = oom_note(oom_before, rec)
    code = getattr(e, "exit_code", None)
    if isinstance(e, mp.ProcessExitedException) and code is not None and code < 0:
        why = exit_reason(code)
        if code == -signal.SIGABRT and cfg.resolve_backend(cfg.world) == "nccl":
            why += (f": on NCCL, torch's watchdog aborts a rank whose collective outlasts --timeout "
                    f"({cfg.timeout:g} s), so a peer most likely stopped or fell far behind")
        return f"rank {e.error_index} died ({why}); the other ranks were stopped.{resume}{oom}"
    if rec is None:  # no record (e.g. the run directory is not writable): the exception's own last line
        lines = str(e).strip().splitlines()
        return (f"the other ranks were stopped.{resume}\nrank {getattr(e, 'error_index', '?')} failed: "
                + (lines[-1] if lines else "unknown error") + oom)
    return f"the other ranks were stopped.{resume}\n{describe_error(rec, cfg.out)}{oom}"


def main_worker(config_path: str, resume: bool = False) -> dict[str, Any]:
    """Run one rank from a saved config; rank and rendezvous come from the environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, as torchrun sets them). Used by launchers that start each rank themselves,
    e.g. inside a network namespace."""
    cfg = TrainConfig(**json.loads(Path(config_path).read_text()))
    return worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg, resume, None)


def worker(rank: int, world: int, cfg: TrainConfig, resume: bool,
           local: tuple[int, Any] | None) -> dict[str, Any]:
    """One rank's life: set up, train, report; errors are printed with the rank that raised them."""
    if local is not None:  # started by launch(): rendezvous on loopback, through the launcher's store
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(local[0]), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank), **{LAUNCHER_STORE_ENV: "1"})
    clear_errors(cfg.out, rank)
    stop_on_signals(cfg.out)
    try:
        run = setup(rank, world, cfg, resume)
        summary = train(run, resume)
    except Exception as e:
        note = watchdog.note_for(e)  # a collective that failed: which ranks it was waiting on
        watchdog.failed()  # the last heartbeat says so: a peer waiting on this rank need not wait (--peer-timeout)
        record_error(cfg.out, rank, e, note)  # the launcher reports the first rank's error as the root cause
        print(f"[rank {rank}] error: {type(e).__name__}: {e}" + (f"\n[rank {rank}] {note}" if note else ""),
              file=sys.stderr, flush=True)
        if not isinstance(e, TrainError | ValueError) and not is_transport_error(e):
            traceback.print_exc()  # a peer's broken connection is one line; every traceback is in errors/
        with contextlib.suppress(AttributeError):
            e.reported = True  # printed and recorded: qwire train exits 1 without printing it again (torchrun)
        raise
    finally:
        try:
            watchdog.stop()
        except Exception:  # noqa: BLE001 - stopping the heartbeats must never hide the run's own error
            pass
        if dist.is_initialized():
            dist.destroy_process_group()
    if local is not None and rank == 0:
        local[1].put(summary)
    return summary


# -----------------------------------------------------------------------------------------------
# Set-up: everything one rank's loop needs.


@dataclass
class Run:
    cfg: TrainConfig
    at: Layout
    device: torch.device
    groups: Groups
    log: Logger
    train_ds: TokenDataset
    val_ds: TokenDataset
    n_params: int
    module: torch.nn.Module               # this rank's stage (its tensor-parallel shard)
    stage: CompressedPipelineStage
    schedule: Any
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    dp: DataParallel | None               # DDP-style replicas (QuanGrad's all-reduce)
    fsdp: torch.nn.Module | None          # the module FSDP2 shards over the replicas (--dp-shard)
    laaq: Any                             # the saved-tensor hooks' handle (None: --laaq off)
    accum: GradAccumHandle | None         # 8-bit gradient accumulation over micro-batches (--grad-accum-bits 8)
    stateful: bool                        # the forward codec keeps per-sample state (AQ-SGD)
    warmup_epoch: bool                    # ... and runs its warm-up codec in the first epoch
    autotune: list[StepAutotune]          # choose the codecs given as `auto` (boundaries, DP, TP)
    outer: OuterSync | None = None        # DiLoCo's outer loop over the replicas (--dp-sync-every > 1)
    autotune_restored: bool = False       # a resume put the checkpoint's `auto` decisions back in force
    source: ModelSource | None = None     # what --model named (a preset, a config, pretrained weights)
    stop: bool = False                    # some rank got a stop signal: every rank ends the run after this step

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.at.rank))

    @property
    def batches_per_epoch(self) -> int:
        return len(self.train_ds) // self.cfg.batch_size


def setup(rank: int, world: int, cfg: TrainConfig, resume: bool | None = None) -> Run:
    at = Layout.of(rank, cfg)
    device, attempt = init_process_group(at, world, cfg, resume)
    codec_graphs.enable(True if cfg.codec_graphs else None)  # None: QWIRE_CODEC_GRAPHS decides
    # heartbeats, and warnings naming a stalled peer
    watchdog.start(rank, world, cfg.stall_warn, cfg.timeout, attempt=attempt, peer_timeout=cfg.peer_timeout,
                   run_dir=cfg.out)
    groups = build_groups(at, device, cfg.timeout, outer=diloco(cfg) and cfg.dp_sync_overlap > 0)
    log = Logger(Path(cfg.out), rank == 0)
    source = model_source(cfg.model)  # a preset, a config, or a local model directory with its own tokenizer
    train_ds, val_ds, vocab = load_data(cfg, source)

    # Model: every rank builds (or loads) the same model and keeps its own stage.
    model = build_model(source, vocab_size=vocab, seed=cfg.seed)
    hidden, n_params = model.config.hidden_size, sum(p.numel() for p in model.parameters())
    check_same_model(model, f"give every machine the same model under --model {cfg.model}")
    module = split_model(model, cfg.stages, cfg.split_list())[at.pp_rank].to(device).train()
    del model
    codecs = collective_codecs(cfg)  # spec strings, or the `auto` objects their controllers switch
    if cfg.tp > 1:  # compressed tensor parallelism inside the stage (TACO styles)
        apply_tp(module, groups.mesh["tp"], codec=codecs["tp"])
    dp, sharded, wrap = apply_data_parallel(cfg, groups, module, codecs)
    laaq = apply_laaq(module, laaq_policy(cfg, at)) if cfg.laaq else None  # low-bit saved activations (AGoQ)

    mb = cfg.batch_size // cfg.microbatches
    example = (torch.zeros(mb, cfg.seq_len, dtype=torch.long, device=device) if at.is_first
               else torch.zeros(mb, cfg.seq_len, hidden, device=device))
    host_staging = stages(example, groups.pp)  # gloo sends host tensors: CUDA payloads cross through the host
    stage = compressed_pipeline_stage(module, at.pp_rank, cfg.stages, device, input_args=example,
                                      fwd=cfg.fwd_codec, bwd=cfg.bwd_codec, group=groups.pp, wrap=wrap,
                                      host_staging=host_staging)
    attach_from_env(stage)  # the simulated link, when a netlab launcher asked for one (else nothing)
    schedule = SCHEDULES[cfg.schedule](stage, cfg.microbatches, loss_fn=lm_loss)
    # A stateful forward codec (AQ-SGD) needs each micro-batch's sample ids on stage 0; they travel in
    # its payloads to the later stages. Its warm-up phase (codec option warmup=...) is the first epoch.
    fwd_codec = get_codec(cfg.fwd_codec)
    stateful = bool(fwd_codec.stateful)
    warmup_epoch = isinstance(fwd_codec, AQSGD) and fwd_codec.warmup_codec is not None

    # AGoQ's 8-bit gradient accumulation: each micro-batch's gradient folded into 8-bit blocks (stage.submod
    # is what the schedule runs backward through: DDP's no-sync micro-batches are folded too)
    accum = accumulate_in_8bit(stage.submod, bits=8) if cfg.grad_accum_bits == 8 else None
    params = [p for p in module.parameters() if p.requires_grad]
    opt, sched = build_optimizer(cfg, params)
    autotune = build_autotune(cfg, at, groups, device, stage, codecs, sharded)
    outer = (OuterSync(params, groups.dp, codecs["dp"], cfg.dp_sync_every, cfg.outer_lr, cfg.outer_momentum,
                       overlap=cfg.dp_sync_overlap, overlap_group=groups.dp_outer,
                       error_feedback=cfg.dp_error_feedback, fragments=cfg.dp_sync_fragments)
             if diloco(cfg) else None)
    return Run(cfg, at, device, groups, log, train_ds, val_ds, n_params, module, stage, schedule, params, opt,
               sched, dp, sharded[0] if sharded else None, laaq, accum, stateful, warmup_epoch, autotune, outer,
               source=source)


def diloco(cfg: TrainConfig) -> bool:
    """Whether the replicas train on their own and meet every --dp-sync-every steps (DiLoCo)."""
    return cfg.dp > 1 and cfg.dp_sync_every > 1


def apply_data_parallel(cfg: TrainConfig, groups: Groups, module: torch.nn.Module, codecs: dict[str, Any]) -> tuple[
        DataParallel | None, list[torch.nn.Module], Any]:
    """Data parallelism for this rank's stage: DDP-style replicas with QuanGrad's all-reduce, or FSDP2 shards
    (--dp-shard). Returns the DDP handle, a list that holds the module FSDP shards once it is sharded, and
    what the pipeline stage should wrap its module with (None: nothing)."""
    sharded: list[torch.nn.Module] = []
    if cfg.dp == 1 or diloco(cfg):  # (DiLoCo's replicas meet after their steps: OuterSync)
        return None, sharded, None
    if not cfg.dp_shard:
        dp = apply_dp(groups.dp, codecs["dp"], tensor_parallel=cfg.tp > 1)
        return dp, sharded, dp.wrap

    def shard(m: torch.nn.Module) -> torch.nn.Module:
        sharded.append(m)
        return apply_fsdp(m, groups.mesh["dp"], grad_codec=codecs["dp"], param_codec=codecs["dp_param"],
                          reshard_after_forward=not cfg.dp_keep_weights)

    if cfg.grad_accum_bits:  # reduce-scatter each micro-batch, so the 8-bit buffer holds only shards
        shard(module)
        return None, sharded, None
    return None, sharded, shard  # the pipeline schedule shards what it runs and reduce-scatters once per step


def collective_codecs(cfg: TrainConfig) -> dict[str, Any]:
    """The codecs of the collectives (``tp``, ``dp``, ``dp_param``; None: FSDP's uncompressed weights): the
    spec strings, except that an ``auto`` spec becomes one :class:`~qwire.codecs.auto.Auto` object per
    dimension, shared by all of its collectives on this rank, with that dimension's default candidates."""
    return {"tp": auto_for(cfg.tp_codec, "tp"), "dp": auto_for(cfg.dp_codec, "dp"),
            "dp_param": auto_for(cfg.dp_param_codec, "dp_param") if cfg.dp_param_codec else None}


def build_autotune(cfg: TrainConfig, at: Layout, groups: Groups, device: torch.device, stage: CompressedPipelineStage,
                   codecs: dict[str, Any], sharded: list[torch.nn.Module]) -> list[StepAutotune]:
    """The controllers of the codecs given as ``auto``: pipeline boundaries, then DP gradients, FSDP weights and
    TP collectives (every rank builds the same list, so they all decide in the same order). A dimension's
    decision is per stage, from its first group (DP: tensor-parallel rank 0; TP: replica 0)."""
    out: list[StepAutotune] = []
    if autotuned(stage):
        out.append(PipelineAutotune(stage, groups.pp, at.pp_rank, cfg.stages, cfg.microbatches,
                                    lead=at.dp_rank == 0 and at.tp_rank == 0, fwd=cfg.fwd_codec, bwd=cfg.bwd_codec,
                                    schedule=cfg.schedule))

    def fsdp_bytes(kind: str) -> Callable[[], int]:  # FSDP shards the stage lazily, in the pipeline's wrap
        return lambda: fsdp_sent_bytes(sharded[0])[kind] if sharded else 0

    dims = [("dp", cfg.dp > 1, groups.dp, at.tp_rank == 0,
             fsdp_bytes("reduce_scatter") if cfg.dp_shard else (lambda: sent_bytes(groups.dp))),
            ("dp_param", cfg.dp > 1, groups.dp, at.tp_rank == 0, fsdp_bytes("all_gather")),
            ("tp", cfg.tp > 1, groups.tp, at.dp_rank == 0, lambda: sent_bytes(groups.tp))]
    for dim, used, group, lead, sent in dims:
        if used and isinstance(codecs[dim], Auto):
            out.append(CollectiveAutotune(dim, codecs[dim], group, at.pp_rank, cfg.stages, lead, sent, device))
    return out


def laaq_policy(cfg: TrainConfig, at: Layout) -> LAAQPolicy:
    """--laaq as a policy; "stage_aware" policies give each stage AGoQ's bits for what it holds in flight."""
    kw = dict(LAAQ_POLICIES[cfg.laaq])
    policy = LAAQPolicy(**{k: v for k, v in kw.items() if k != "stage_aware"})
    if kw["stage_aware"]:
        policy = policy.for_stage(at.pp_rank, cfg.stages, cfg.schedule, cfg.microbatches)
    return policy


def build_optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW (betas 0.9, 0.95) or SGD with momentum, and the warm-up + cosine schedule."""
    if cfg.optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                       betas=(0.9, 0.95))
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.warmup, cfg.steps))


def init_process_group(at: Layout, world: int, cfg: TrainConfig, resume: bool | None = None
                       ) -> tuple[torch.device, str]:
    """Join the job (gloo on CPU, NCCL on CUDA, with --timeout) and check every rank runs the same one; the
    device and the name of the attempt (under torchrun, see :mod:`qwire.rendezvous`; "0" elsewhere)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    backend = cfg.resolve_backend(local_world)
    if cfg.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", at.rank))
        # a scheduler that gives each rank its own GPU through CUDA_VISIBLE_DEVICES leaves it one visible GPU
        own_visible = torch.cuda.device_count() == 1 and bool(os.environ.get("CUDA_VISIBLE_DEVICES"))
        if backend == "nccl" and local_rank >= torch.cuda.device_count() and not own_visible:
            raise TrainError(f"--backend nccl needs a GPU per rank, but this machine runs {local_world} ranks on "
                             f"{torch.cuda.device_count()} GPU(s) (NCCL refuses two ranks on one GPU); use "
                             "--backend gloo (or auto) to share the GPUs, or start fewer ranks per machine (or give "
                             "each rank its own GPU with CUDA_VISIBLE_DEVICES)")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=cfg.timeout)
    store, attempt = attempt_store(world, timeout)
    if store is not None:
        store.set(f"{JOINED_KEY}/{at.rank}", "1")
    try:
        if cfg.backend == "auto" and cfg.device == "cuda" and store is not None:  # from every rank's GPU
            backend = gpu_backend(store, at.rank, world, gpu_name(device))
        # NCCL: bind the rank to its GPU at once (its communicators are made there, and barriers need not guess)
        dist.init_process_group(backend, rank=at.rank, world_size=world, timeout=timeout, store=store,
                                device_id=device if backend == "nccl" else None)
    except dist.DistStoreError as e:  # "wait timeout after ...ms, keys: /0//cpu//0/1": which rank is that?
        missing = [r for r in range(world) if store is not None and not store.check([f"{JOINED_KEY}/{r}"])]
        if store is None:  # torch's env:// rendezvous (RANK and WORLD_SIZE set by hand): its store is rank 0's
            raise TrainError(f"the job's processes did not all join within --timeout {cfg.timeout:g} s "
                             f"({type(e).__name__}: {e}): start all WORLD_SIZE={world} processes with the same "
                             f"MASTER_ADDR and MASTER_PORT ({os.environ.get('MASTER_ADDR')}:"
                             f"{os.environ.get('MASTER_PORT')}), or launch with torchrun") from None
        if not missing:
            raise
        raise TrainError(f"the job's processes did not all join within --timeout {cfg.timeout:g} s "
                         f"({type(e).__name__}: {e}): rank{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(map(str, missing))} never came (a process that was stopped, froze, or is "
                         "still starting on a loaded machine; its log may say more)") from None
    check_same_config(cfg, resume)
    if world != cfg.world:
        raise TrainError(f"--pp {cfg.stages} x --tp {cfg.tp} x --dp {cfg.dp} needs {cfg.world} processes, "
                         f"but WORLD_SIZE is {world}; start {cfg.world} processes (torchrun --nproc-per-node x "
                         "--nnodes) or change the mesh")
    return device, attempt


def load_data(cfg: TrainConfig, source: ModelSource) -> tuple[TokenDataset, TokenDataset, int]:
    """Train and validation sets and the vocabulary size, tokenized with the model's own tokenizer if it has
    one (else a BPE trained on the corpus). The first rank on each machine builds the tokenizer and token
    caches while the others wait; every rank must end with the same data."""
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if local_rank != 0:
        dist.barrier()
    train_ds, val_ds, tokenizer = build_datasets(corpus=cfg.corpus, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size,
                                                 seed=cfg.seed, max_tokens=cfg.max_tokens or None,
                                                 tokenizer=source.tokenizer, model_vocab_size=source.vocab_size)
    if local_rank == 0:
        dist.barrier()
    check_same_everywhere("data set (corpus + tokenizer)", train_ds.info["fingerprint"],
                          "give every machine the same corpus files (the stdlib corpus differs between "
                          "Python versions; use a file or folder corpus on mixed machines)")
    if len(train_ds) < cfg.batch_size:
        raise TrainError(f"the corpus has {len(train_ds)} training sequences of {cfg.seq_len + 1} tokens, "
                         f"fewer than one batch of {cfg.batch_size}; lower --batch-size or --seq-len")
    return train_ds, val_ds, tokenizer.vocab_size


def schedule_note(cfg: TrainConfig, step: int, was: int | None) -> str:
    """What a resume from the checkpoint of ``step`` with ``--steps`` other than the checkpoint's run's (``was``;
    None: not recorded) does to the learning rate: its decay spans the new length, so the next step's rate
    differs from what it would have been (nothing to say where it does not, as during the warm-up)."""
    if was is None or was == cfg.steps:
        return ""
    now, then = (cfg.lr * lr_factor(step, cfg.warmup, n) for n in (cfg.steps, was))  # LambdaLR's next: its
    if math.isclose(now, then, rel_tol=1e-6):  # last_epoch, the checkpoint's step
        return ""
    return (f"--resume: --steps {cfg.steps}, where the checkpoint's run had {was}: the learning rate's decay now "
            f"spans {cfg.steps} steps, so step {step + 1} trains at {now:.3g} instead of {then:.3g}")


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


# -----------------------------------------------------------------------------------------------
# One step and evaluation. Every rank walks the same batches; stage 0 feeds inputs, the last stage labels.


def batch_at(run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The batch of ``step`` (0-based) for this rank's data-parallel replica, and its epoch."""
    epoch, k = divmod(step * run.cfg.dp + run.at.dp_rank, run.batches_per_epoch)
    x, y, ids = next(iter(iterate_batches(run.train_ds, run.cfg.batch_size, seed=run.cfg.seed, epoch=epoch,
                                          start_batch=k)))
    return x.to(run.device), y.to(run.device), ids, epoch


def pipeline_step(run: Run, x: torch.Tensor, y: torch.Tensor, train: bool, ids: torch.Tensor | None = None) -> float:
    """Run one batch through the pipeline (forward+backward when ``train``); the mean micro-batch loss on
    the last stage, 0.0 elsewhere."""
    at, losses = run.at, []
    step = run.schedule.step if train else run.schedule.eval
    kw = {"sample_ids": ids} if run.stateful and at.is_first else {}
    if at.is_first and at.is_last:
        step(x, target=y, losses=losses)
    elif at.is_first:
        step(x, **kw)
    elif at.is_last:
        step(target=y, losses=losses)
    else:
        step()
    return float(torch.stack([v.detach().float() for v in losses]).mean()) if losses else 0.0


def wire_counters(run: Run) -> dict[str, int]:
    """Payload bytes this rank has handed to the transport so far, by where they cross."""
    tp = sent_bytes(run.groups.tp) if run.groups.tp is not None else 0
    dp = sent_bytes(run.groups.dp) if run.groups.dp is not None else 0
    return {**boundary_bytes(run.stage), "tp": tp, "dp": dp}


def train_step(run: Run, step: int) -> dict[str, Any]:
    """One optimizer step (1-based ``step``): forward, backward, data-parallel averaging, clipping, update.
    Returns its metrics record (loss and grad norm over all ranks, bytes on the wire summed over ranks)."""
    cfg, t0 = run.cfg, time.perf_counter()
    run.stage.codec_clock.take()  # what evaluation's forwards encoded and decoded since the last step
    x, y, ids, epoch = batch_at(run, step - 1)
    if run.warmup_epoch:
        set_codec_phase(run.stage, warming=epoch == 0)
    before = wire_counters(run)
    fsdp_before = fsdp_sent_bytes(run.fsdp) if run.fsdp is not None else {}
    run.opt.zero_grad(set_to_none=True)
    c0 = comm_seconds()
    loss_here = pipeline_step(run, x, y, train=True, ids=ids)
    t_tp = comm_seconds() - c0  # TP collectives run inside forward and backward, on this thread
    if run.accum is not None:  # the summed gradient back into p.grad (the schedule's 1/n skipped it)
        run.accum.finish(scale=1 / cfg.microbatches)
    t_dp = run.dp.sync(run.params) if run.dp is not None else 0.0
    after = wire_counters(run)
    if run.laaq is not None:  # peak bytes the saved-tensor hooks held this step
        laaq_peak, run.laaq.stats.peak_bytes = run.laaq.stats.peak_bytes, run.laaq.stats.live_bytes
    fsdp_after = fsdp_sent_bytes(run.fsdp) if run.fsdp is not None else {}
    sums = sum_over_ranks({"loss": loss_here if run.at.reports_loss else 0.0, "grad_sq": grad_sq_share(run),
                           "stop": float(stop_signal() is not None),  # a stop signal anywhere: all agree on it
                           **{k: float(after[k] - before[k]) for k in WIRE_KEYS},
                           **{k: float(fsdp_after[k] - fsdp_before[k]) for k in fsdp_after}}, run.device)
    # every DP replica holds the same (all-reduced) gradients and reports its own loss
    # DDP replicas hold the same (all-reduced) gradients; FSDP replicas each hold one shard of them
    loss, grad_norm = sums["loss"] / cfg.dp, math.sqrt(sums["grad_sq"] / (1 if cfg.dp_shard else cfg.dp))
    run.stop = sums["stop"] > 0
    if not math.isfinite(loss):
        raise TrainError(f"loss became {loss} at step {step}; lower --lr (now {cfg.lr}) or check the codecs")
    if cfg.grad_clip > 0 and grad_norm > cfg.grad_clip:
        for p in run.params:
            if p.grad is not None:
                p.grad.mul_(cfg.grad_clip / (grad_norm + 1e-6))
    run.opt.step()
    lr = run.sched.get_last_lr()[0]  # the rate this step trained at (the scheduler's step moves on to the next)
    run.sched.step()
    met = False
    if run.outer is not None:  # DiLoCo: the replicas meet (a compressed all-reduce of the pseudo-gradients, then
        # the outer step), or start a meeting whose outer step lands --dp-sync-overlap steps later
        met, t_dp, dp_sent = run.outer.after_step(step, cfg.steps)
        if met:  # every rank lands at the same steps
            sums["dp"] += sum_over_ranks({"dp": float(dp_sent)}, run.device)["dp"]
    dt = time.perf_counter() - t0
    codec_s = run.stage.codec_clock.take()  # this rank's boundary encodes and decodes in the step
    mem = max_over_ranks({"state": float(state_bytes(run.params, run.opt)), "rss": float(max_rss_bytes()),
                          "step_s": dt, "codec_s": codec_s}, run.device)
    tokens = cfg.batch_size * cfg.seq_len * cfg.dp
    record: dict[str, Any] = {
        "step": step, "loss": loss, "tokens": step * tokens, "tokens_per_s": tokens / dt, "step_time_s": dt,
        "step_time_max_s": mem["step_s"], "lr": lr, "grad_norm": grad_norm,
        "wire_bytes_fwd": int(sums["fwd"]), "wire_bytes_bwd": int(sums["bwd"]), "fp32_bytes": int(sums["fp32"]),
        "wire_bytes_tp": int(sums["tp"]), "wire_bytes_dp": int(sums["dp"]),
        "state_bytes_max": int(mem["state"]), "max_rss_bytes": int(mem["rss"])}
    if cfg.stages > 1:  # the most seconds one rank spent encoding and decoding its boundaries' payloads
        record["codec_time_max_s"] = mem["codec_s"]
    if cfg.tp > 1:
        record["time_tp_s"] = t_tp  # this rank (rank 0): seconds in TP collectives
    if (run.dp is not None and run.dp.after_backward) or met:
        record["time_dp_s"] = t_dp  # seconds of the gradient all-reduce after backward (DiLoCo: this rank's wait
        # for the meeting)
    if met:
        record["dp_synced"] = True  # DiLoCo: a meeting's outer step landed after this step
    if run.fsdp is not None:  # FSDP's data-parallel bytes: gradients reduce-scattered, weights all-gathered
        record["wire_bytes_dp_grad"], record["wire_bytes_dp_param"] = (int(sums["reduce_scatter"]),
                                                                       int(sums["all_gather"]))
    if run.accum is not None:  # bytes the 8-bit buffers held at most this step, and fp32 accumulation's
        record["grad_accum_peak_bytes"] = int(run.accum.last_peak_bytes)
        record["grad_accum_fp32_bytes"] = int(run.accum.fp32_bytes())
    if run.laaq is not None:
        record["laaq_saved_peak_bytes"] = int(laaq_peak)
    if run.stateful:
        record["epoch"] = epoch
    record.update(codecs_in_force(run))
    return record


def codecs_in_force(run: Run) -> dict[str, Any]:
    """The codec on each dimension this step (``auto``: the candidate in force on each boundary)."""
    cfg = run.cfg
    out: dict[str, Any] = {"codec_fwd": cfg.fwd_codec, "codec_bwd": cfg.bwd_codec}
    if cfg.tp > 1:
        out["codec_tp"] = cfg.tp_codec
    if cfg.dp > 1:
        out["codec_dp"] = cfg.dp_codec
    if cfg.dp_shard:
        out["codec_dp_param"] = cfg.dp_param_codec or "uncompressed"
    for tuner in run.autotune:  # `auto`: the candidate in force (per boundary, or per stage)
        out.update(tuner.in_force())
    return out


def autotune_arm(run: Run, step: int, first: bool) -> None:
    """``auto``: before a step after which codecs will be chosen, start capturing what crosses."""
    for tuner in run.autotune:
        if first or tuner.due(step):
            tuner.arm()


def autotune_step(run: Run, step: int, first: bool, record: dict[str, Any]) -> int:
    """``auto``: re-measure and choose the codecs after this step when due (collective), and record what was
    measured (``nmse_*``: the error of the codecs in force) and decided (``auto_next``: in force from the next
    step on; ``autotune.jsonl``: every measurement, and ``trigger``: why it was measured). Every controller
    then sees the step time of the slowest rank (a shift re-arms a measurement). Returns how many
    controllers decided."""
    decided = 0
    # a step that held a DiLoCo meeting is slower by its all-reduce, not by a link that moved: not observed
    seconds = math.nan if run.outer is not None and run.outer.met_at == step else record["step_time_max_s"]
    for tuner in run.autotune:
        due = first or tuner.due(step)
        observed = False
        if not due and tuner.arm_ahead == 0:  # this step's time may arm a measurement right after it
            tuner.observe(step, seconds, decided=False)
            due, observed = tuner.due(step), True
        if due:
            decision = tuner.decide(step)
            decision["trigger"] = tuner.trigger(step, first)
        if due or not observed:
            tuner.observe(step, seconds, decided=due)
        if not due:
            continue
        decided += 1
        fields, lines = tuner.summary(decision)
        if decision["trigger"] == "shift":
            lines.insert(0, f"auto: the step time moved from {tuner._shift_from:.3f} s to "
                            f"{record['step_time_max_s']:.3f} s (more than shift={tuner.shift:g}); re-measured "
                            f"after step {step}")
        for key, value in fields.items():
            record.setdefault(key, {}).update(value)
        for line in lines:
            run.log.say(line)
        run.log.autotune(decision)
    return decided


def grad_sq_share(run: Run) -> float:
    """This rank's share of the squared global gradient norm (tensor-parallel replicas counted once)."""
    total = 0.0
    for p in run.params:
        g = p.grad
        if g is None:
            continue
        weight = 1.0
        if hasattr(g, "to_local"):  # DTensor: a replicated gradient lives on every TP rank
            weight = 1.0 / run.cfg.tp if _replicated_over_tp(g) else 1.0
            g = g.to_local()
        total += weight * float(g.float().pow(2).sum())
    return total


def _replicated_over_tp(g: Any) -> bool:
    """Whether a DTensor gradient is a full copy on every tensor-parallel rank (a 1-D TP mesh, or the "tp"
    dimension of a (dp, tp) mesh when FSDP shards over "dp")."""
    names = g.device_mesh.mesh_dim_names or ()
    if "tp" in names:
        return g.placements[names.index("tp")].is_replicate()
    return all(pl.is_replicate() for pl in g.placements)


def evaluate(run: Run) -> float:
    """Mean validation loss over --eval-batches fixed batches (the same every time), averaged over DP replicas."""
    cfg = run.cfg
    n = min(cfg.eval_batches, len(run.val_ds) // cfg.batch_size)
    if n < 1:
        return float("nan")
    total = 0.0
    it = iter(iterate_batches(run.val_ds, cfg.batch_size, seed=0, epoch=0))
    set_codec_phase(run.stage, use_cache=False, warming=False)  # validation samples are never cached
    with torch.no_grad():
        for _ in range(n):
            x, y, ids = next(it)
            total += pipeline_step(run, x.to(run.device), y.to(run.device), train=False, ids=ids)
    set_codec_phase(run.stage, use_cache=True)
    return sum_over_ranks({"val": total / n if run.at.reports_loss else 0.0}, run.device)["val"] / cfg.dp


# -----------------------------------------------------------------------------------------------
# The loop, checkpoints and the end.


def announce(run: Run) -> None:
    """The run's first line: the mesh, the model and where it came from, the codecs, the data; and a note
    where the validation split cannot fill one batch."""
    cfg, log = run.cfg, run.log
    mb = cfg.batch_size // cfg.microbatches
    memory = "".join([f"; LAAQ {cfg.laaq} (low-bit saved activations)" if cfg.laaq else "",
                      f"; {cfg.grad_accum_bits}-bit gradient accumulation" if cfg.grad_accum_bits else ""])
    staged = " (payloads staged through host memory)" if run.stage.host_staging else ""
    if cfg.device == "cuda" or staged:
        memory += f"; on {cfg.device} with {dist.get_backend()}{staged}"
        if cfg.device == "cuda" and codec_graphs.enabled():
            memory += "; codec kernels in CUDA graphs"
    what = run.source.describe() if run.source is not None else cfg.model
    log.say(f"qwire train: {cfg.describe()}, {fmt_count(run.n_params)} params ({what}), "
            f"{cfg.schedule}, {cfg.microbatches} micro-batches of {mb} x {cfg.seq_len} tokens; "
            + (f"fwd {cfg.fwd_codec}, bwd {cfg.bwd_codec}" if cfg.stages > 1 else "no pipeline boundary")
            + f"{memory}; {len(run.train_ds)} train / {len(run.val_ds)} val "
            f"sequences; run dir {cfg.out}")
    if len(run.val_ds) < cfg.batch_size and cfg.eval_batches:
        log.say(f"note: the validation split has {len(run.val_ds)} sequences, fewer than one batch of "
                f"{cfg.batch_size}, so there is no validation loss (nan); give a bigger corpus or a smaller "
                "--batch-size")


def train(run: Run, resume: bool) -> dict[str, Any]:
    """The loop, from step 1 or from the last checkpoint to --steps; returns the run's summary (whole run:
    bytes and seconds of the steps before a resume included)."""
    cfg, at, log = run.cfg, run.at, run.log
    run_dir = Path(cfg.out)
    announce(run)
    start_step, earlier = restore(run) if resume else (0, {})
    totals = {k: earlier.get(k, 0.0) for k in (*WIRE_KEYS, "elapsed_s", "auto_time_s", "auto_decisions",
                                               "codec_time_max_s", "step_time_max_s")}
    loss = val_loss = float("nan")
    t_start = time.perf_counter()
    for step in range(start_step + 1, cfg.steps + 1):
        first = step == start_step + 1 and not run.autotune_restored  # auto measures after its first step
        autotune_arm(run, step, first)
        with watchdog.watch("step", step):
            record = train_step(run, step)
        with watchdog.watch("auto", step):
            t_auto = time.perf_counter()
            totals["auto_decisions"] += autotune_step(run, step, first, record)
            if run.autotune:  # measuring and choosing runs between steps, outside step_time_s: its own field
                record["auto_time_s"] = time.perf_counter() - t_auto
                totals["auto_time_s"] += record["auto_time_s"]
        loss = record["loss"]
        for k in WIRE_KEYS:
            totals[k] += record["fp32_bytes" if k == "fp32" else f"wire_bytes_{k}"]
        for k in ("codec_time_max_s", "step_time_max_s"):
            totals[k] += record.get(k, 0.0)
        is_eval = (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps
        if is_eval:  # validation traffic is not part of any training step's bytes
            with watchdog.watch("evaluation", step):
                val_loss = record["val_loss"] = evaluate(run)
        log.metric(record)
        if step % cfg.log_every == 0 or is_eval or step == start_step + 1:
            log.progress(record, cfg.steps, time.perf_counter() - t_start, step - start_step)
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps or run.stop:
            so_far = {**totals, "elapsed_s": totals["elapsed_s"] + time.perf_counter() - t_start}
            with watchdog.watch("checkpoint", step):
                checkpoint.save(run_dir, stage_file(run) if per_replica(cfg) or at.dp_rank == 0 else None, step,
                                run.module, run.opt, run.sched, codec_state(run.stage), at.rank, run.local_rank,
                                so_far, extra=checkpoint_extra(run))
            log.plot()
        if run.stop and step < cfg.steps:
            got = stop_signal()
            log.say(f"stopped after step {step} ({signal.Signals(got).name if got else 'a stop signal'}), with its "
                    "checkpoint")
            return {"stopped_at": step, "run_dir": str(run_dir)}

    elapsed = totals["elapsed_s"] + time.perf_counter() - t_start
    summary = {"steps": cfg.steps, "final_loss": loss, "val_loss": val_loss,
               "tokens_per_s": cfg.steps * cfg.batch_size * cfg.seq_len * cfg.dp / elapsed, "elapsed_s": elapsed,
               "wire_bytes_fwd": totals["fwd"], "wire_bytes_bwd": totals["bwd"], "fp32_bytes": totals["fp32"],
               "wire_bytes_tp": totals["tp"], "wire_bytes_dp": totals["dp"], "run_dir": str(run_dir)}
    if cfg.stages > 1:  # what the boundary codecs cost, against the steps' time (slowest rank, summed over steps)
        summary.update(codec_time_max_s=totals["codec_time_max_s"], step_time_max_s=totals["step_time_max_s"])
    if run.autotune:  # what choosing the codecs cost, so that a user can weigh it against what it saved
        summary.update(auto_time_s=totals["auto_time_s"], auto_decisions=int(totals["auto_decisions"]))
    if run.stateful:  # AQ-SGD's caches: what TAH-Quant avoids (all ranks, both sides of every boundary)
        cache = codec_cache_nbytes(run.stage)
        summary["aqsgd_cache_bytes"] = int(sum_over_ranks({"c": float(cache["total"])}, run.device)["c"])
        summary["aqsgd_cache_bytes_per_sample"] = cache["per_sample"]  # per boundary and side
        codecs = stateful_codecs(run.stage)
        summary["aqsgd_cached_samples"] = len(next(iter(codecs.values())).cache) if codecs else 0
    log.summary(summary, cfg.out)
    return summary


def links_of(cfg: TrainConfig) -> dict[str, str]:
    """The run's network-lab links (what ``auto``'s decisions were measured on); a lab's workers have them from
    their launcher (their own config names none: the lab shapes the links)."""
    given = os.environ.get(ENV_LINKS)
    return json.loads(given) if given else {k: getattr(cfg, k) for k in LINK_FIELDS}


def restore_autotune(run: Run, states: list[dict[str, Any]] | None, step: int,
                     links: dict[str, str] | None = None) -> None:
    """``auto``: go on with the codecs in force at the checkpoint (no new start-up measurement), when the
    checkpoint holds them for every controller and the run resumes on the links they were measured on
    (``links``, saved with them); otherwise measure after the first resumed step, as at the start. Every rank
    reads the same stage file of its stage, so the ends of each link agree."""
    if not run.autotune:
        return
    before = [t.state_dict() for t in run.autotune]
    moved = links is not None and links != links_of(run.cfg)
    ok = not moved and bool(states) and len(states) == len(run.autotune) and all(
        t.load_state_dict(s) for t, s in zip(run.autotune, states))
    agreed = sum_over_ranks({"ok": float(ok)}, run.device)["ok"] == dist.get_world_size()  # all or none
    if not agreed:
        for t, b in zip(run.autotune, before):  # as at the start, on every rank
            t.load_state_dict(b)
        why = ("the links changed since the checkpoint" if moved
               else "the checkpoint holds no decisions for these codecs")
        run.log.say(f"auto: {why}; measuring after the first step")
        return
    run.autotune_restored = True
    fields: dict[str, Any] = {}
    for t in run.autotune:
        fields.update(t.in_force())
    run.log.say(f"auto: resumed with the codecs in force at step {step}: "
                + ", ".join(f"{k.removeprefix('codec_')} {'/'.join(v)}" for k, v in fields.items()))


def per_replica(cfg: TrainConfig) -> bool:
    """Whether every data-parallel rank saves its own stage file: FSDP's shards differ, and so do DiLoCo's
    replicas between meetings (and their optimizers always)."""
    return cfg.dp_shard or diloco(cfg)


def checkpoint_extra(run: Run) -> dict[str, Any] | None:
    """What a stage file holds besides the stage, its optimizer and the counters: the steps its learning-rate
    schedule decays over, the fingerprint of the data it trains on (a resume on other data stops), the codecs
    ``auto`` has in force (and the links they were chosen for), DiLoCo's anchor
    and outer momentum."""
    extra: dict[str, Any] = {"lr_steps": run.cfg.steps, "data": run.train_ds.info["fingerprint"]}
    if run.autotune:
        extra.update(autotune=[t.state_dict() for t in run.autotune], autotune_links=links_of(run.cfg))
    if run.outer is not None:
        extra["diloco"] = run.outer.state_dict()
    return extra or None


def stage_file(run: Run) -> str:
    """This rank's checkpoint file: its stage (and TP shard); with FSDP or DiLoCo its data-parallel rank too."""
    at = run.at
    return checkpoint.stage_file(at.pp_rank, at.tp_rank, run.cfg.tp, at.dp_rank if per_replica(run.cfg) else None)


def restore(run: Run) -> tuple[int, dict[str, float]]:
    """Load the newest checkpoint every rank can read into this rank's stage, optimizer and codecs;
    returns its step and the run's counters up to it."""
    cfg, at, run_dir = run.cfg, run.at, Path(run.cfg.out)
    got = checkpoint.load(run_dir, stage_file(run), at.rank,
                          with_codecs=bool(stateful_codecs(run.stage)), say=run.log.say)
    data = got.state.get("data")  # (checkpoints before it was recorded hold none)
    if data is not None and data != run.train_ds.info["fingerprint"]:
        raise TrainError(f"the data differ from those the run in {run_dir} trained on up to step {got.step}: "
                         f"--corpus {cfg.corpus} (with the tokenizer of --model {cfg.model}) now reads "
                         f"{len(run.train_ds)} training sequences of other text. A relative path is read from the "
                         "folder the command runs in: resume from the folder the run started in, or give the "
                         "same files again")
    checkpoint.apply(got, run.module, run.opt, run.sched)
    if run.outer is not None:
        run.outer.load_state_dict(got.state["diloco"])
    if got.codecs is not None:
        load_codec_state(run.stage, got.codecs)
    if got.step >= cfg.steps:
        raise TrainError(f"nothing to do: the run in {run_dir} is at step {got.step} and --steps is {cfg.steps}; "
                         f"give --steps > {got.step} to train further")
    run.log.truncate(got.step)
    run.log.say(f"resumed from step {got.step} in {run_dir}")
    note = schedule_note(cfg, got.step, got.state.get("lr_steps"))
    if note:
        run.log.say(note)
    restore_autotune(run, got.state.get("autotune"), got.step, got.state.get("autotune_links"))
    return got.step, {k: float(v) for k, v in got.state.get("totals", {}).items()}
