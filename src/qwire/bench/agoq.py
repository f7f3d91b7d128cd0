"""``qwire bench agoq``: QuanGrad (8-bit DP gradients) and LAAQ (low-bit saved activations).

Four measurements, all in one run, written to ``<out>/agoq.json``,
``<out>/agoq.md`` and ``<out>/agoq_loss.png``:

1. **All-reduce of one gradient bucket** on ``--world`` gloo ranks with every DDP hook
   (plain all-reduce, torch's ``fp16_compress_hook``, ``bf16_compress_hook``,
   ``powerSGD_hook``, QuanGrad with and without error feedback): the bytes each rank
   sends (counted at the ``torch.distributed`` calls the hooks make), the real gloo
   time on this machine, and a **simulated link**: ``real time + bytes / bandwidth +
   latency x collective steps`` at several bandwidths, as ratios to plain all-reduce.
2. **DP training** of a ``qwire.models`` preset (``--model``, default ``llama-micro``) with each
   hook (same data, seed and steps), plus QuanGrad with the 8-bit gradient accumulation buffer
   over 2 micro-batches.
3. **LAAQ memory**: bytes of the tensors autograd saves, per transformer layer, in
   units of ``U = B*S*H*2``, and their peak during a step, for several policies.
4. **LAAQ training**: loss curves of the same model with each policy (uncompressed,
   AGoQ, uniform 4-bit everywhere, ...).

Every model comes from :func:`qwire.models.build_model` and every token from a :mod:`qwire.data`
corpus (``--corpus``, tokenized by its byte-level BPE of ``--vocab-size`` ids).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qwire.bench import add_out_argument
from qwire.bench.report import (
    bench_command,
    finish,
    fmt_bytes,
    machine_info,
    model_summary,
    option_defaults,
    pyplot,
    render_saved,
    smooth,
)
from qwire.bench.runner import number_list, spawn_world
from qwire.data.corpus import parse_corpus_spec
from qwire.models import model_source

HOOKS = ["allreduce", "fp16", "bf16", "powersgd", "quangrad", "quangrad_ef"]
HOOK_LABELS = {
    "allreduce": "plain all-reduce (fp32)",
    "fp16": "torch fp16_compress_hook",
    "bf16": "torch bf16_compress_hook",
    "powersgd": "torch powerSGD_hook",
    "quangrad": "QuanGrad (blockwise8, block 256)",
    "quangrad_ef": "QuanGrad + error feedback",
    "quangrad_acc8": "QuanGrad + 8-bit accumulation (2 micro-batches)",
    "allreduce_seed1": "noise reference: plain all-reduce, init seed + 1",
}
DP_RUNS = [*HOOKS, "quangrad_acc8", "allreduce_seed1"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny sizes and a few steps (smoke test, < 30 s)")
    add_out_argument(p, "where agoq.json, agoq.md and agoq_loss.png go")
    p.add_argument("--world", type=int, default=2, help="data-parallel ranks (gloo, this machine)")
    p.add_argument("--sizes-mb", default="4,32", help="bucket sizes for the all-reduce benchmark (MB of fp32)")
    p.add_argument("--bandwidths-gbps", default="1,10,100,200", help="simulated link bandwidths (Gbit/s)")
    p.add_argument("--latency-us", type=float, default=10.0, help="simulated latency per collective step")
    p.add_argument("--reps", type=int, default=7,
                   help="timed repetitions per all-reduce, methods in round robin (median reported)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD matrix_approximation_rank")
    p.add_argument("--dp-steps", type=int, default=150, help="DP training steps per hook")
    p.add_argument("--laaq-steps", type=int, default=300, help="training steps per LAAQ policy")
    p.add_argument("--laaq-seeds", type=int, default=3, help="model initializations per LAAQ policy")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (and per LAAQ step)")
    p.add_argument("--seq", type=int, default=64, help="sequence length for training")
    p.add_argument("--mem-batch", type=int, default=4, help="batch of the LAAQ memory measurement")
    p.add_argument("--mem-seq", type=int, default=256, help="sequence length of the LAAQ memory measurement")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--model", default="llama-micro", help="qwire.models preset (or config / model directory)")
    p.add_argument("--corpus", default="stdlib:max_mb=4", help="qwire.data corpus spec")
    p.add_argument("--vocab-size", type=int, default=512, help="ids of the corpus's byte-level BPE tokenizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the DP workers are killed")
    p.add_argument("--parts", default="allreduce,dp,laaq_mem,laaq_train", help="which measurements to run")
    p.add_argument("--render-only", action="store_true",
                   help="re-render agoq.md and agoq_loss.png from the agoq.json in --out (no measurement)")


# --------------------------------------------------------------------------------------------------
# data and model
# --------------------------------------------------------------------------------------------------
def _windows(args: argparse.Namespace, seq: int, n_train: int,
             n_val: int = 0) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``n_train`` training and ``n_val`` validation windows of ``seq`` corpus tokens (LongTensor[n, seq]),
    drawn at random (seeded) from :func:`qwire.data.build_datasets`'s splits, and the tokenizer."""
    from qwire.data import build_datasets

    train, val, tok = build_datasets(corpus=args.corpus, seq_len=seq - 1, vocab_size=args.vocab_size, seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)

    def take(ds: Any, n: int) -> torch.Tensor:
        idx = torch.randint(0, len(ds), (n,), generator=g)
        return torch.stack([ds[int(i)][0] for i in idx]).long() if n else torch.empty(0, seq, dtype=torch.long)

    return take(train, n_train), take(val, n_val), tok


def _model(spec: dict[str, Any], seed: int, impl: str = "eager", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``spec["model"]`` built by :func:`qwire.models.build_model` for ``spec["vocab"]`` ids, seeded."""
    from qwire.models import build_model

    return build_model(spec["model"], vocab_size=spec["vocab"], seed=seed, dtype=dtype, attn_implementation=impl)


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    """What :func:`_model` needs: the model (``--model``) and the tokenizer's vocabulary (set by ``run``)."""
    return {"model": args.model, "vocab": args._vocab}


def _lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _lm_loss_under(model: torch.nn.Module, ids: torch.Tensor, pol: Any) -> torch.Tensor:
    """The loss, with LAAQ policy ``pol`` storing what autograd saves (None: plain autograd)."""
    if pol is None:
        return _lm_loss(model, ids)
    from qwire.memory import laaq

    with laaq(model, pol):
        return _lm_loss(model, ids)


@torch.no_grad()
def _val_loss(model: torch.nn.Module, val: torch.Tensor, batch: int) -> float:
    was = model.training
    model.eval()
    losses = [float(_lm_loss(model, val[i:i + batch])) for i in range(0, len(val) - batch + 1, batch)]
    model.train(was)
    return sum(losses) / max(1, len(losses))


# --------------------------------------------------------------------------------------------------
# counting what each hook sends
# --------------------------------------------------------------------------------------------------
class WireCounter:
    """Patches ``torch.distributed`` collectives to count the bytes this rank sends and the link steps.

    Cost model per call (ring / pairwise algorithms, one link per rank), tensor of T bytes:
    all_reduce sends ``2 (W-1)/W T`` in ``2 (W-1)`` steps; all_to_all_single sends ``(W-1)/W T``
    in ``W-1`` steps; all_gather sends ``(W-1) T`` (T = this rank's input) in ``W-1`` steps.
    """

    NAMES = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_gather")

    def __init__(self, world: int) -> None:
        self.world = world
        self.bytes = 0.0
        self.steps = 0
        self.calls = 0
        self._orig: dict[str, Any] = {}

    def _nbytes(self, t: Any) -> int:
        if isinstance(t, torch.Tensor):
            return t.numel() * t.element_size()
        return sum(self._nbytes(x) for x in t)

    def _wrap(self, name: str, fn: Any) -> Any:
        w = self.world

        def counted(*a: Any, **k: Any) -> Any:
            self.calls += 1
            if name == "all_reduce":
                self.bytes += 2 * (w - 1) / w * self._nbytes(a[0])
                self.steps += 2 * (w - 1)
            elif name == "all_to_all_single":
                self.bytes += (w - 1) / w * self._nbytes(a[1])
                self.steps += w - 1
            elif name == "all_gather":
                self.bytes += (w - 1) * self._nbytes(a[1])
                self.steps += w - 1
            else:
                self.bytes += (w - 1) * self._nbytes(a[1])
                self.steps += w - 1
            return fn(*a, **k)

        return counted

    def __enter__(self) -> WireCounter:
        import torch.distributed as dist

        for n in self.NAMES:
            if hasattr(dist, n):
                self._orig[n] = getattr(dist, n)
                setattr(dist, n, self._wrap(n, self._orig[n]))
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        for n, f in self._orig.items():
            setattr(dist, n, f)
        self._orig.clear()


def _make_hook(name: str, args: dict) -> tuple[Any, Callable]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from qwire.comm.ddp_hooks import QuanGradState, quangrad_hook

    if name in ("allreduce", "allreduce_seed1"):
        return None, default_hooks.allreduce_hook
    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, _bf16_hook
    if name == "powersgd":
        st = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args["powersgd_rank"],
                                         start_powerSGD_iter=2, random_seed=args["seed"])
        return st, powerSGD_hook.powerSGD_hook
    if name in ("quangrad", "quangrad_acc8"):
        return QuanGradState(codec="blockwise8:block=256"), quangrad_hook
    if name == "quangrad_ef":
        return QuanGradState(codec="blockwise8:block=256", error_feedback=True), quangrad_hook
    raise ValueError(name)


def _bf16_hook(state, bucket):  # no annotations: DDP checks them only when present
    """torch's ``bf16_compress_hook`` under another name: DDP refuses that name unless on NCCL/XCCL."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


class _Bucket:
    """A stand-in for ``dist.GradBucket`` (buffer, per-parameter views, index, is_last)."""

    def __init__(self, shapes: list[tuple[int, ...]], seed: int) -> None:
        n = sum(math.prod(s) for s in shapes)
        g = torch.Generator().manual_seed(seed)
        self.init = torch.randn(n, generator=g) * 1e-3
        self.buf = self.init.clone()
        self.views, off = [], 0
        for s in shapes:
            k = math.prod(s)
            self.views.append(self.buf[off:off + k].view(s))
            off += k

    def reset(self) -> None:
        self.buf.copy_(self.init)

    def buffer(self) -> torch.Tensor:
        return self.buf

    def gradients(self) -> list[torch.Tensor]:
        return self.views

    def parameters(self) -> list[torch.Tensor]:
        return self.views

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def _bucket_shapes(mb: float) -> list[tuple[int, ...]]:
    """Weight matrices (and a bias) adding up to about ``mb`` MB of fp32, like a transformer bucket."""
    n = int(mb * 2 ** 20 / 4)
    side = 1024 if n >= 1024 * 1024 else 256
    k = max(1, n // (side * side))
    return [(side, side)] * k + [(side,)]


# --------------------------------------------------------------------------------------------------
# the DP worker: all-reduce micro-benchmark and DP training
# --------------------------------------------------------------------------------------------------
def _dp_worker(rank: int, world: int, cfg: dict, train: torch.Tensor | None, val: torch.Tensor | None) -> dict:
    import torch.distributed as dist

    out: dict[str, Any] = {"allreduce": {}, "dp": {}}
    if "allreduce" in cfg["parts"]:
        for mb in cfg["sizes_mb"]:
            shapes = _bucket_shapes(mb)
            bucket = _Bucket(shapes, seed=1000 * rank + 1)
            hooks = {name: _make_hook(name, cfg) for name in HOOKS}
            for state, hook in hooks.values():
                for _ in range(cfg["warmup"]):  # warm-up (PowerSGD compresses from its 3rd call on)
                    bucket.reset()
                    hook(state, bucket).wait()
            times: dict[str, list[float]] = {name: [] for name in HOOKS}
            counted: dict[str, WireCounter] = {}
            for _ in range(cfg["reps"]):  # round robin: load changes hit every method alike
                for name, (state, hook) in hooks.items():
                    bucket.reset()
                    dist.barrier()
                    with WireCounter(world) as wc:
                        t0 = time.perf_counter()
                        hook(state, bucket).wait()
                        times[name].append(time.perf_counter() - t0)
                    counted[name] = wc
            ts = [None] * world
            dist.all_gather_object(ts, times)
            res = {}
            for name in HOOKS:
                per_call = [max(ts[r][name][i] for r in range(world)) for i in range(cfg["reps"])]
                wc = counted[name]
                res[name] = {"seconds": statistics.median(per_call), "bytes": wc.bytes, "steps": wc.steps,
                             "calls": wc.calls, "numel": int(bucket.buf.numel())}
            out["allreduce"][str(mb)] = res
    if "dp" in cfg["parts"]:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from qwire.comm.grad_accum import QuantizedGradAccumulator

        B = cfg["batch"]
        for name in DP_RUNS:
            seed = cfg["seed"] + (1 if name == "allreduce_seed1" else 0)
            model = _model(cfg, seed)
            # one bucket for the whole tiny model: torch's PowerSGD hook issues its gloo all-reduces
            # from future callbacks, and with several buckets those race (collective mismatch)
            ddp = DDP(model, bucket_cap_mb=64)
            state, hook = _make_hook(name, cfg)
            ddp.register_comm_hook(state, hook)  # allreduce_hook == DDP's default, but counted
            opt = torch.optim.AdamW(ddp.parameters(), lr=cfg["lr"], weight_decay=0.0)
            acc = QuantizedGradAccumulator(ddp.parameters()) if name == "quangrad_acc8" else None
            losses, t_step = [], []
            with WireCounter(world) as wc:
                for step in range(cfg["dp_steps"]):
                    i0 = (step * world + rank) * B % (len(train) - B + 1)
                    ids = train[i0:i0 + B]
                    t0 = time.perf_counter()
                    if acc is None:
                        loss = _lm_loss(ddp, ids)
                        loss.backward()
                    else:  # 2 micro-batches: the first under no_sync into the 8-bit buffer
                        h = B // 2
                        with ddp.no_sync():
                            l1 = _lm_loss(ddp, ids[:h])
                            (l1 / 2).backward()
                            acc.accumulate()
                        acc.finalize()
                        l2 = _lm_loss(ddp, ids[h:])
                        (l2 / 2).backward()
                        loss = (l1 + l2) / 2
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    t_step.append(time.perf_counter() - t0)
                    losses.append(float(loss.detach()))
            vl = _val_loss(model, val, B) if rank == 0 else None
            rec = {"losses": losses, "val_loss": vl, "bytes_per_step": wc.bytes / cfg["dp_steps"],
                   "steps_per_step": wc.steps / cfg["dp_steps"], "seconds_per_step": statistics.median(t_step)}
            if name.startswith("quangrad"):
                rec["hook_counters"] = {k: v for k, v in state.counters().items() if k != "codec"}
            if acc is not None:
                mem = acc.memory()
                rec["accumulator"] = {"fp32_bytes": mem.fp32_bytes, "payload_bytes": mem.payload_bytes,
                                      "saved_fraction": mem.saved_fraction}
            allloss = [None] * world
            dist.all_gather_object(allloss, losses)
            rec["losses"] = [sum(v) / world for v in zip(*allloss)]
            out["dp"][name] = rec
    return out


# --------------------------------------------------------------------------------------------------
# LAAQ
# --------------------------------------------------------------------------------------------------
def _laaq_policies(quick: bool) -> dict[str, Any]:
    from qwire.memory import LAAQPolicy

    pols = {
        "bf16 / fp32 (uncompressed)": None,
        "AGoQ: FP4 E2M1, attention kept": LAAQPolicy(bits=4, fmt="fp"),
        "AGoQ + MLP recompute": LAAQPolicy(bits=4, fmt="fp", recompute=(r"mlp$",)),
        "INT4, attention kept": LAAQPolicy(bits=4, fmt="int"),
        "uniform FP4 (attention too)": LAAQPolicy(bits=4, fmt="fp", keep_attention=False),
        "uniform INT4 (attention too)": LAAQPolicy(bits=4, fmt="int", keep_attention=False),
        "8-bit FP (E4M3), attention kept": LAAQPolicy(bits=8, fmt="fp"),
        "uniform 3-bit FP (E1M1, attention too)": LAAQPolicy(bits=3, fmt="fp", keep_attention=False),
        "uniform FP4 + head and loss too": LAAQPolicy(bits=4, fmt="fp", keep_attention=False,
                                                      quantize_outside_layers=True),
    }
    if quick:
        keep = ("bf16 / fp32 (uncompressed)", "AGoQ + MLP recompute", "uniform FP4 (attention too)")
        pols = {k: v for k, v in pols.items() if k in keep}
    return pols


# the policies trained (all of them are in the memory table)
TRAIN_POLICIES = ("bf16 / fp32 (uncompressed)", "AGoQ: FP4 E2M1, attention kept", "AGoQ + MLP recompute",
                  "uniform FP4 (attention too)", "uniform INT4 (attention too)", "uniform FP4 + head and loss too")


def _grad_errors(args: argparse.Namespace, impl: str, ids: torch.Tensor) -> dict[str, float]:
    """Relative L2 error of one step's full gradient vector (fp32 model) under each policy."""

    model = _model(_spec(args), args.seed, impl)

    def grads(pol: Any) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = _lm_loss_under(model, ids, pol)
        loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    ref = grads(None)
    return {label: float((grads(pol) - ref).norm() / ref.norm()) if pol is not None else 0.0
            for label, pol in _laaq_policies(args.quick).items()}


def _laaq_memory(args: argparse.Namespace, train: torch.Tensor) -> dict[str, Any]:
    from qwire.memory import LAAQPolicy, activation_unit, laaq

    B, S = (2, 32) if args.quick else (args.mem_batch, args.mem_seq)
    ids = _windows(args, S, B)[0]
    out: dict[str, Any] = {"batch": B, "seq": S, "rows": {}, "grad_batch": [args.batch, args.seq]}
    for impl in ("eager",) if args.quick else ("eager", "sdpa"):
        gerr = _grad_errors(args, impl, train[:args.batch])
        model = _model(_spec(args), args.seed, impl, torch.bfloat16)
        U = out["U_bytes"] = activation_unit(B, S, model.config.hidden_size)
        for label, pol in _laaq_policies(args.quick).items():
            pol = pol or LAAQPolicy(fmt="none")
            model.zero_grad(set_to_none=True)
            with laaq(model, pol) as s:
                loss = _lm_loss(model, ids)
            loss.backward()
            st = s.stats
            layers = [k for k in st.stored if k != "other"]
            kinds = {k: sum(st.stored[ly][k] for ly in layers) / len(layers) / U
                     for k in ("quantized", "attention", "small", "kept", "nonfloat")}
            out["rows"][f"{impl}|{label}"] = {
                "impl": impl, "policy": label, "spec": pol.describe(),
                "per_layer_U": st.mean_layer_units(U), "kinds_U": kinds,
                "other_U": sum(st.stored["other"].values()) / U if "other" in st.stored else 0.0,
                "raw_per_layer_U": sum(st.raw[ly] for ly in layers) / len(layers) / U,
                "peak_bytes": st.peak_bytes, "total_bytes": st.total_bytes(), "grad_rel_err": gerr[label],
            }
    return out


def _laaq_train(args: argparse.Namespace, train: torch.Tensor, val: torch.Tensor) -> dict[str, Any]:
    """Train the model under every policy, for ``--laaq-seeds`` model initializations each."""
    from qwire.memory import LAAQPolicy

    steps, B = args.laaq_steps, args.batch
    out: dict[str, Any] = {}
    eval_every = max(1, steps // 6)
    for label, pol in _laaq_policies(args.quick).items():
        if not args.quick and label not in TRAIN_POLICIES:
            continue
        runs = []
        for k in range(args.laaq_seeds):
            model = _model(_spec(args), args.seed + k)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
            losses, vals, t_step = [], [], []
            for step in range(steps):
                i0 = step * B % (len(train) - B + 1)
                ids = train[i0:i0 + B]
                t0 = time.perf_counter()
                loss = _lm_loss_under(model, ids, pol)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                t_step.append(time.perf_counter() - t0)
                losses.append(float(loss.detach()))
                if (step + 1) % eval_every == 0 or step + 1 == steps:
                    vals.append([step + 1, _val_loss(model, val, B)])
            runs.append({"seed": args.seed + k, "losses": losses, "val": vals,
                         "seconds_per_step": statistics.median(t_step)})
        n = len(runs)
        out[label] = {
            "spec": (pol or LAAQPolicy(fmt="none")).describe(), "seeds": runs,
            "losses": [sum(v) / n for v in zip(*(r["losses"] for r in runs))],
            "val": [[pts[0][0], sum(p[1] for p in pts) / n] for pts in zip(*(r["val"] for r in runs))],
            "val_final": [r["val"][-1][1] for r in runs],
            "seconds_per_step": statistics.median(r["seconds_per_step"] for r in runs),
        }
        finals = ", ".join(f"{v:.4f}" for v in out[label]["val_final"])
        print(f"  LAAQ {label}: final val {finals}", flush=True)
    return out


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------
def _simulate(res: dict[str, Any], bandwidths: list[float], latency_s: float) -> dict[str, Any]:
    """Simulated time of each method at each bandwidth: real time + bytes / bw + steps x latency."""
    sim: dict[str, Any] = {}
    for name, r in res.items():
        sim[name] = {}
        for bw in bandwidths:
            link = r["bytes"] * 8 / (bw * 1e9) + r["steps"] * latency_s
            sim[name][str(bw)] = {"link_s": link, "total_s": r["seconds"] + link}
    return sim


def _plot(results: dict[str, Any], path: Path) -> None:
    dp, lt = results.get("dp", {}), results.get("laaq_train", {})
    fig, axes = pyplot().subplots(1, 2, figsize=(13, 4.8))
    for name, r in dp.items():
        k = max(1, len(r["losses"]) // 15)
        axes[0].plot(smooth(r["losses"], k), label=HOOK_LABELS.get(name, name), lw=1.2)
    axes[0].set(title=f"DP={results['meta']['world']} training loss per DDP hook", xlabel="step",
                ylabel="train loss (moving average)")
    axes[0].legend(fontsize=7)
    for label, r in lt.items():
        k = max(1, len(r["losses"]) // 15)
        line, = axes[1].plot(smooth(r["losses"], k), label=label, lw=1.2)
        if r["val"]:
            s, v = zip(*r["val"])
            axes[1].plot(s, v, "o", color=line.get_color(), ms=3)
    axes[1].set(title="LAAQ: training loss (line) and validation loss (dots)", xlabel="step", ylabel="loss")
    axes[1].legend(fontsize=7)
    finish(fig, path)



def _markdown(results: dict[str, Any]) -> str:
    m = results["meta"]
    L: list[str] = ["# AGoQ: QuanGrad (8-bit DP gradients) and LAAQ (low-bit saved activations)", ""]
    L += [f"Produced by `{m['command']}` on {m['machine']} (torch {m['torch']}, {m['date']}). "
          f"Data: {m['data']}. Model: {_model_name(m)}, eager attention unless noted.", ""]
    merged = {p: v for p, v in m.get("sections", {}).items() if v.get("command") != m["command"]}
    if merged:
        L += ["Sections from earlier runs (kept when a later run measured other `--parts`): " + "; ".join(
            f"{PART_LABELS.get(p, p)}: `{v['command']}` ({v.get('date')})" for p, v in sorted(merged.items()))
            + ".", ""]
    ar = results.get("allreduce")
    if ar:
        bws = m["bandwidths_gbps"]
        L += ["## All-reduce of one gradient bucket (simulated link)", "",
              f"{m['world']} gloo ranks on this machine. **The link is simulated**: time = real gloo time "
              f"here + bytes this rank sends / bandwidth + {m['latency_us']:g} us x collective steps. Bytes "
              "are counted at the `torch.distributed` calls each hook makes (ring all-reduce: 2(W-1)/W of "
              "the tensor; all-to-all: (W-1)/W; all-gather: (W-1) x the input). Speed-ups are ratios to "
              "plain all-reduce measured in the same run; PowerSGD uses rank "
              f"{m['powersgd_rank']} on 1024x1024 (or 256x256) matrices.", ""]
        for mb, res in ar.items():
            sim = results["allreduce_sim"][mb]
            base = res["allreduce"]
            L += [f"### {float(mb):g} MB bucket ({res['allreduce']['numel']:,} fp32 elements)", ""]
            hdr = "| method | bytes sent / rank | less than fp32 | real time here | " + " | ".join(
                f"{bw:g} Gb/s: time (speed-up)" for bw in bws) + " |"
            L += [hdr, "|" + "---|" * (4 + len(bws))]
            for name, r in res.items():
                cells = [HOOK_LABELS[name], fmt_bytes(r["bytes"], 2), f"{base['bytes'] / r['bytes']:.2f}x",
                         f"{r['seconds'] * 1e3:.1f} ms"]
                for bw in bws:
                    t = sim[name][str(bw)]["total_s"]
                    cells.append(f"{t * 1e3:.1f} ms ({sim['allreduce'][str(bw)]['total_s'] / t:.2f}x)")
                L.append("| " + " | ".join(cells) + " |")
            L.append("")
        L += ["Link-only speed-up (what remains when codec time is negligible, e.g. fused GPU kernels) is "
              "the byte ratio: "
              + ", ".join(f"{HOOK_LABELS[n]} {next(iter(ar.values()))['allreduce']['bytes'] / r['bytes']:.2f}x"
                          for n, r in next(iter(ar.values())).items() if n != "allreduce") + ".", ""]
    dp = results.get("dp")
    if dp:
        base = dp["allreduce"]
        n = len(base["losses"])
        k = max(1, min(10, n // 5))
        L += ["## DP training with each hook", "",
              f"{m['world']} ranks, {n} steps, {m['batch']} sequences of {m['seq']} tokens per rank, AdamW "
              f"lr {m['lr']:g}, same seed and data for every hook. Train loss: mean of the last {k} steps "
              "(averaged over ranks); validation loss after the last step.", "",
              "| method | train loss | vs plain | val loss | vs plain | bytes / step / rank | less than fp32 |",
              "|---|---|---|---|---|---|---|"]
        bl = sum(base["losses"][-k:]) / k
        for name, r in dp.items():
            tl = sum(r["losses"][-k:]) / k
            L.append(f"| {HOOK_LABELS[name]} | {tl:.4f} | {100 * (tl / bl - 1):+.2f}% | {r['val_loss']:.4f} | "
                     f"{100 * (r['val_loss'] / base['val_loss'] - 1):+.2f}% | {fmt_bytes(r['bytes_per_step'], 2)} | "
                     f"{base['bytes_per_step'] / r['bytes_per_step']:.2f}x |")
        L.append("")
        acc = dp.get("quangrad_acc8", {}).get("accumulator")
        if acc:
            L += ["### 8-bit gradient accumulation buffer", "",
                  f"{_model_name(m, short=True)}: fp32 buffer {fmt_bytes(acc['fp32_bytes'], 2)} "
                  f"-> {fmt_bytes(acc['payload_bytes'], 2)} "
                  f"of payload ({100 * acc['saved_fraction']:.1f}% saved). "
                  + results.get("accumulator_7b", ""), ""]
    mem = results.get("laaq_mem")
    if mem:
        U = mem["U_bytes"]
        gb = mem.get("grad_batch", ["?", "?"])
        L += ["## LAAQ: saved-activation memory per transformer layer", "",
              f"Model in bf16, batch {mem['batch']} x {mem['seq']} tokens, U = B*S*H*2 = {fmt_bytes(U, 2)}. "
              "Bytes are what the pack hook stored (payload bytes for quantized tensors, storage bytes for "
              "kept ones; a tensor saved by several ops counted once; parameters not counted), averaged "
              "over the layers. Peak: the most bytes held by saved tensors at once during the step "
              "(whole model, including embedding, head and loss). Paper (Megatron, flash attention): "
              "BF16 28U -> AGoQ 7.75U. Gradient error: relative L2 error of one step's whole gradient "
              f"vector against no compression, fp32 model, one batch of {gb[0]} x {gb[1]} training tokens.", "",
              "| attention | policy | per layer | quantized | attention kept | other kept | raw (unquantized) "
              "| peak saved | gradient error |", "|---|---|---|---|---|---|---|---|---|"]
        for r in mem["rows"].values():
            kd = r["kinds_U"]
            L.append(f"| {r['impl']} | {r['policy']} | **{r['per_layer_U']:.2f}U** | {kd['quantized']:.2f}U | "
                     f"{kd['attention']:.2f}U | {kd['kept'] + kd['small'] + kd['nonfloat']:.2f}U | "
                     f"{r['raw_per_layer_U']:.2f}U | {fmt_bytes(r['peak_bytes'], 2)} | "
                     f"{100 * r.get('grad_rel_err', float('nan')):.1f}% |")
        L.append("")
    lt = results.get("laaq_train")
    if lt:
        first = next(iter(lt.values()))
        steps = len(first["losses"])
        n_seeds = len(first["val_final"])
        k = max(1, min(20, steps // 5))
        base_v = sum(first["val_final"]) / n_seeds
        L += ["## LAAQ: training loss vs uncompressed", "",
              f"fp32 model, {steps} steps, batch {m['batch']} x {m['seq']}, AdamW lr {m['lr']:g}, the same data "
              f"order for every run; {n_seeds} model initializations (seeds {m['seed']}..{m['seed'] + n_seeds - 1}) "
              f"per policy. Train loss: mean of the last {k} steps, averaged over seeds; validation loss after "
              "the last step, mean and per seed. Curves (seed means): `agoq_loss.png`.", "",
              "| policy | codec | train loss | val loss (mean) | vs uncompressed | val loss per seed | time / step |",
              "|---|---|---|---|---|---|---|"]
        for label, r in lt.items():
            tl = sum(r["losses"][-k:]) / k
            v = sum(r["val_final"]) / len(r["val_final"])
            per = ", ".join(f"{x:.3f}" for x in r["val_final"])
            L.append(f"| {label} | {r['spec']} | {tl:.4f} | {v:.4f} | {100 * (v / base_v - 1):+.2f}% | {per} | "
                     f"{r['seconds_per_step'] * 1e3:.0f} ms |")
        L.append("")
    sb = results.get("stage_bits")
    if sb:
        L += ["## Pipeline-stage bits", "",
              "`stage_bits(p)` with 1F1B, `N_i = min(m, p - i)` in-flight micro-batches, "
              "`b_i = max(4, 4 N_1 / N_i)` rounded down (keeps `N_i b_i <= N_1 b_1`) and capped at 8:", "",
              "| stages | N_i | bits (floor, cap 8) | bits (formula, no cap) |", "|---|---|---|---|"]
        for row in sb:
            L.append(f"| {row['stages']} | {row['in_flight']} | {row['bits']} | {row['exact']} |")
        L.append("")
    L += ["## Notes", ""] + [f"- {n}" for n in _notes(results)] + [""]
    return "\n".join(L)


def _model_name(m: dict[str, Any], short: bool = False) -> str:
    """The model of a result: ``llama-micro`` (hidden ..., ...) or, for results made before the bench took
    ``--model``, the tiny Llama described in them."""
    name = f"`{m['model_name']}`" if "model_name" in m else "tiny Llama"
    return name if short else f"{name} ({m['model']})"


def _accumulator_7b() -> str:
    """Analytic accumulation-buffer size for LLaMA-2-7B's parameter shapes."""
    from qwire.codecs import get_codec

    c = get_codec("blockwise8:block=256")
    h, f, v, n_layers = 4096, 11008, 32000, 32
    shapes = [(v, h), (v, h), (h,)] + n_layers * ([(h, h)] * 4 + [(f, h), (f, h), (h, f), (h,), (h,)])
    fp32 = sum(math.prod(s) * 4 for s in shapes)
    pay = sum(c.payload_nbytes(s, torch.float32) for s in shapes)
    return (f"LLaMA-2-7B shapes (analytic, `payload_nbytes`): {fp32 / 2 ** 30:.1f} GiB -> "
            f"{pay / 2 ** 30:.2f} GiB ({100 * (1 - pay / fp32):.1f}% saved).")


def _notes(results: dict[str, Any]) -> list[str]:
    """What to keep in mind when reading the tables, from what this result holds."""
    m = results["meta"]
    notes = []
    if results.get("allreduce"):
        impl = m.get("quangrad_impl")
        kind = "the eager torch reference" if impl == "torch" else "a compiled kernel"
        notes += ["The link of the all-reduce table is simulated: the ranks share one machine, so the real gloo time "
                  "is mostly codec and copy time, and link time is added from the bytes each method actually sent.",
                  "QuanGrad's encode/decode is part of the real time"
                  + (f" (its codec ran as `{impl}`: {kind})" if impl else "")
                  + "; the less time it takes, the closer the speed-up comes to the byte ratio at every bandwidth."]
    if results.get("dp"):
        notes.append("DP losses come from one seed; the noise-reference row (plain all-reduce from another model "
                     "initialization) shows how far two equally good runs land apart after the same steps.")
    lt = results.get("laaq_train")
    if lt:
        n = len(next(iter(lt.values()))["val_final"])
        notes.append(f"LAAQ losses are means over {n} model initialization{'s' if n != 1 else ''}, with every "
                     "seed's value listed.")
    notes.append("Times per training step are wall-clock on the machine above and only indicative; the all-reduce "
                 "table compares methods measured back to back in one run.")
    return notes


# the results of each --parts entry, and what each section of the page is labelled
PART_KEYS = {"allreduce": ("allreduce", "allreduce_sim"), "dp": ("dp", "accumulator_7b"),
             "laaq_mem": ("laaq_mem",), "laaq_train": ("laaq_train",)}
PART_LABELS = {"allreduce": "all-reduce", "dp": "DP training", "laaq_mem": "LAAQ memory",
               "laaq_train": "LAAQ training"}


QUICK = {"sizes_mb": "0.25", "reps": 1, "dp_steps": 2, "laaq_steps": 1, "laaq_seeds": 1, "batch": 2, "seq": 32}


def _keep_other_parts(results: dict[str, Any], path: Path, parts: set[str]) -> None:
    """A run of some ``--parts`` into a folder that already holds a page keeps the other parts' results
    (and the commands that produced them): nothing an earlier run measured is lost."""
    if parts >= set(PART_KEYS) or not path.exists():
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    om = old.get("meta", {})
    if bool(om.get("quick")) != bool(results["meta"].get("quick")):
        kept = sorted(p for p in set(PART_KEYS) - parts if any(k in old for k in PART_KEYS[p]))
        if kept:
            how = "with" if om.get("quick") else "without"
            print(f"qwire bench agoq: {path} holds {', '.join(kept)} of a run {how} --quick, which this page "
                  "cannot show beside this run's: they are not kept (run those parts "
                  "again, or give another --out)", file=sys.stderr, flush=True)
        return
    for part in set(PART_KEYS) - parts:
        if not any(k in old for k in PART_KEYS[part]):
            continue
        for k in PART_KEYS[part]:
            if k in old:
                results[k] = old[k]
        results["meta"]["sections"][part] = om.get("sections", {}).get(part) or {
            "command": om.get("command"), "date": om.get("date")}


def render(results: dict[str, Any], out: Path) -> None:
    """Write ``agoq.md`` and ``agoq_loss.png`` from an ``agoq.json`` result."""
    if "dp" in results or "laaq_train" in results:
        _plot(results, out / "agoq_loss.png")
    (out / "agoq.md").write_text(_markdown(results))


def run(args: argparse.Namespace) -> int:
    from qwire.memory import in_flight, stage_bits

    if args.render_only:
        return render_saved("agoq", Path(args.out), "agoq", render)

    t_start = time.time()
    command = bench_command("agoq", args, add_arguments)
    if args.quick:  # a quick run's sizes, for the options not given
        defaults = option_defaults(add_arguments)
        for name, value in QUICK.items():
            if getattr(args, name) == defaults[name]:
                setattr(args, name, value)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"allreduce", "dp", "laaq_mem", "laaq_train"}
    if unknown:
        print(f"unknown --parts {sorted(unknown)}", file=sys.stderr)
        return 2
    try:  # what the user can get wrong, before anything runs or is written
        bandwidths = number_list(args.bandwidths_gbps, "--bandwidths-gbps")
        sizes_mb = number_list(args.sizes_mb, "--sizes-mb")
        parse_corpus_spec(args.corpus)
        model_source(args.model)  # a preset, a config or a local model directory
        if args.world < 2:
            raise ValueError(f"--world must be >= 2 (data-parallel ranks), got {args.world}")
    except (ValueError, OSError) as e:
        print(f"qwire bench agoq: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    n_train = max(args.dp_steps * args.world, args.laaq_steps) * args.batch
    train, val, tok = _windows(args, args.seq, n_train, 8 * args.batch if not args.quick else 2 * args.batch)
    args._vocab = tok.vocab_size
    meta = {"command": command, "model_name": args.model, "model": model_summary(_model(_spec(args), args.seed)),
            **machine_info(), "date": datetime.date.today().isoformat(), "world": args.world,
            "data": f"corpus {args.corpus!r}, byte-level BPE vocab {tok.vocab_size}",
            "bandwidths_gbps": bandwidths, "latency_us": args.latency_us, "powersgd_rank": args.powersgd_rank,
            "batch": args.batch, "seq": args.seq, "lr": args.lr, "seed": args.seed, "quick": args.quick,
            "phase_seconds": {}}
    results: dict[str, Any] = {"meta": meta}
    t0 = time.time()
    meta["phase_seconds"]["data"] = round(t0 - t_start, 1)
    if parts & {"allreduce", "dp"}:
        from qwire.codecs import get_codec, kernels

        meta["quangrad_impl"] = kernels.implementation(get_codec("blockwise8:block=256"))
        cfg = {"parts": sorted(parts), "sizes_mb": sizes_mb,
               "reps": args.reps, "warmup": 3, "powersgd_rank": args.powersgd_rank, "seed": args.seed,
               "batch": args.batch, "lr": args.lr, "dp_steps": args.dp_steps, **_spec(args)}
        print(f"== DP workers ({args.world} gloo ranks)", flush=True)
        r0 = spawn_world(_dp_worker, args.world, (cfg, train, val), timeout=args.timeout)[0]
        if r0["allreduce"]:
            results["allreduce"] = r0["allreduce"]
            results["allreduce_sim"] = {mb: _simulate(res, bandwidths, args.latency_us * 1e-6)
                                        for mb, res in r0["allreduce"].items()}
        if r0["dp"]:
            results["dp"] = r0["dp"]
            results["accumulator_7b"] = _accumulator_7b()
        meta["phase_seconds"]["dp_workers"] = round(time.time() - t0, 1)
    if "laaq_mem" in parts:
        print("== LAAQ memory", flush=True)
        t1 = time.time()
        results["laaq_mem"] = _laaq_memory(args, train)
        meta["phase_seconds"]["laaq_mem"] = round(time.time() - t1, 1)
    if "laaq_train" in parts:
        print("== LAAQ training", flush=True)
        t1 = time.time()
        results["laaq_train"] = _laaq_train(args, train, val)
        meta["phase_seconds"]["laaq_train"] = round(time.time() - t1, 1)
    results["stage_bits"] = [{"stages": p, "in_flight": in_flight(p), "bits": stage_bits(p),
                              "exact": [round(4 * in_flight(p)[0] / n, 2) for n in in_flight(p)]}
                             for p in (2, 4, 8)]
    meta["seconds"] = round(time.time() - t_start, 1)
    meta["sections"] = {p: {"command": command, "date": meta["date"]} for p in sorted(parts)}
    _keep_other_parts(results, out / "agoq.json", parts)
    print(f"phases (s): {meta['phase_seconds']}", flush=True)
    (out / "agoq.json").write_text(json.dumps(results, indent=1))
    render(results, out)
    print((out / "agoq.md").read_text())
    return 0
