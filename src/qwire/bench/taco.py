"""``qwire bench taco``: FP8 tensor-parallel compression (TACO) — codec error, collective time, TP steps.

Writes ``taco.json`` and ``taco.md`` into ``--out`` (default ``docs/results``); ``--render-only``
re-renders ``taco.md`` from the ``taco.json`` there.

1. **Codec error** (normalized MSE and SNR) on tensor-parallel traffic: the
   outputs of the row-parallel layers (``o_proj``, ``down_proj``: what the
   forward all-reduce carries) and the gradients at those outputs (what the
   backward carries) of a randomly initialized ``qwire.models`` preset (``--model``,
   default ``llama-tiny``; ``llama-micro`` with ``--quick``) on a batch of ``qwire.data``
   corpus tokens (``--corpus``), plus dense near-zero Gaussian tensors. TACO's dual-scale Hadamard FP8 vs
   plain per-group FP8 vs bf16 (and the block-wise int8 codecs when
   registered), E4M3 vs E5M2, group sizes 32..512.
2. **Collectives**: qwire's two-shot all-reduce (and all-gather /
   reduce-scatter) on gloo over loopback for fp32, bf16, fp8, timed side by side
   in one run, plus a *simulated* link: each collective step adds
   ``bytes sent by one rank / bandwidth + latency`` to the measured time, using
   the real payload sizes. Speedups are ratios to the fp32 codec in the same run.
3. **TP training steps** (skipped with ``--quick``): the same model with TP=2,
   uncompressed (fp32 codec) vs fp8, real step time on this machine plus the
   simulated transfer time of the step's collectives, and the training loss on a
   fixed batch of corpus tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from qwire.bench import add_out_argument
from qwire.bench.report import bench_command, fmt_bytes, machine_info, model_summary, render_saved
from qwire.bench.runner import number_list, spawn_world
from qwire.data.corpus import parse_corpus_spec
from qwire.models import model_source

BANDWIDTHS_GBIT = (0.1, 1.0, 10.0)


WORLDS = "2,4"  # --worlds' default

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small tensors, few sizes, no TP steps (smoke test)")
    add_out_argument(p, "folder for taco.json and taco.md")
    p.add_argument("--bandwidths", default=",".join(f"{b:g}" for b in BANDWIDTHS_GBIT),
                   help="simulated link bandwidths in Gbit/s, comma-separated")
    p.add_argument("--latency-us", type=float, default=50.0, help="simulated per-step link latency (microseconds)")
    p.add_argument("--worlds", default=WORLDS, help="world sizes for the collective timings (--quick: 2)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per collective (median reported)")
    p.add_argument("--tp-steps", type=int, default=20, help="training steps per codec in the TP section")
    p.add_argument("--model", default="llama-tiny",
                   help="qwire.models preset (or config / model directory); --quick uses llama-micro")
    p.add_argument("--corpus", default="stdlib", help="qwire.data corpus spec the token batches come from")
    p.add_argument("--vocab-size", type=int, default=4096, help="ids of the corpus's byte-level BPE tokenizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--render-only", action="store_true",
                   help="re-render taco.md from the taco.json in --out (no measurement)")


# ---------------------------------------------------------------------------------------------
# small process launcher (gloo on loopback, file rendezvous, timeouts)

def _launch(fn_name: str, world: int, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
    return spawn_world(globals()[fn_name], world, kwargs=kwargs, timeout=timeout, threads=1)


# ---------------------------------------------------------------------------------------------
# 1. codec error

def _model(spec: dict[str, Any], seed: int) -> torch.nn.Module:
    """``spec["model"]`` from :func:`qwire.models.build_model` for ``spec["vocab"]`` ids, seeded."""
    from qwire.models import build_model

    return build_model(spec["model"], vocab_size=spec["vocab"], seed=seed)


def _batch(corpus: str, vocab_size: int, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, int]:
    """``batch`` windows of ``seq`` tokens from the training split of ``corpus`` (seeded), and the vocabulary."""
    from qwire.data import build_datasets

    train, _val, tok = build_datasets(corpus=corpus, seq_len=seq - 1, vocab_size=vocab_size, seed=seed)
    idx = torch.randint(0, len(train), (batch,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([train[int(i)][0] for i in idx]).long(), tok.vocab_size


def _capture_tp_tensors(spec: dict[str, Any], ids: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """Row-parallel outputs (forward traffic) and the gradients at them (backward traffic) for ``ids``."""
    model = _model(spec, seed)
    hidden = model.config.hidden_size
    outs: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []

    def hook(mod: torch.nn.Module, inp: Any, out: torch.Tensor) -> None:
        outs.append(out.detach().clone())
        out.register_hook(lambda g: grads.append(g.detach().clone()))

    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(hook)
        layer.mlp.down_proj.register_forward_hook(hook)
    model(input_ids=ids, labels=ids).loss.backward()
    g = torch.Generator().manual_seed(seed + 1)
    n = ids.numel() * hidden
    # "Massive activations": two channels of every token 1000x larger than the rest, as trained LLMs show.
    outl = torch.randn(n // hidden, hidden, generator=g) * 1e-2
    outl[:, [3, hidden // 2 + 5]] *= 1000.0
    return {
        "row-parallel outputs": torch.cat([o.reshape(-1) for o in outs]),
        "their gradients": torch.cat([x.reshape(-1) for x in grads]),
        "gaussian std 1e-2": torch.randn(n, generator=g) * 1e-2,
        "gaussian std 1e-4": torch.randn(n, generator=g) * 1e-4,
        "gaussian + 1000x channel outliers": outl.reshape(-1),
    }


OUTLIER_TENSOR = "gaussian + 1000x channel outliers"


def _codec_rows(quick: bool) -> list[tuple[str, str]]:
    """(label, spec) for the main comparison at G = 128."""
    from qwire.codecs import available

    rows = [
        ("TACO fp8 E4M3 (Hadamard, dual scale)", "fp8:format=e4m3,group=128"),
        ("TACO fp8 E5M2 (Hadamard, dual scale)", "fp8:format=e5m2,group=128"),
        ("fp8 E4M3 dual scale, no Hadamard", "fp8:format=e4m3,group=128,hadamard=false"),
        ("plain per-group fp8 E4M3", "fp8plain:format=e4m3,group=128"),
        ("plain per-group fp8 E5M2", "fp8plain:format=e5m2,group=128"),
        ("bf16", "bf16"),
    ]
    have = set(available())
    if "blockwise8" in have:
        rows.append(("block-wise int8 (block 256)", "blockwise8"))
    if "int8" in have:
        rows.append(("int8 asymmetric (tile 32)", "int8"))
    return rows


def _snr(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    nmse = float((y - x).double().pow(2).sum() / x.double().pow(2).sum().clamp_min(1e-300))
    return nmse, -10 * math.log10(max(nmse, 1e-30))


def _error(spec: str, x: torch.Tensor, outliers: torch.Tensor | None = None) -> dict[str, float]:
    """NMSE / SNR of one round trip; with an outlier mask also the SNR of the *other* elements."""
    from qwire.codecs import get_codec

    c = get_codec(spec)
    y = c.decode(c.encode(x), x.shape, x.dtype)
    nmse, snr = _snr(x, y)
    out = {"nmse": nmse, "snr_db": snr, "bits_per_element": c.bits_per_element(x.shape, x.dtype)}
    if outliers is not None:
        out["snr_db_non_outliers"] = _snr(x[~outliers], y[~outliers])[1]
    return out


def codec_error(quick: bool, spec: dict[str, Any], ids: torch.Tensor, seed: int) -> dict[str, Any]:
    tensors = _capture_tp_tensors(spec, ids, seed)
    stats = {k: {"numel": v.numel(), "rms": float(v.pow(2).mean().sqrt()), "absmax": float(v.abs().max())}
             for k, v in tensors.items()}
    mask = tensors[OUTLIER_TENSOR].abs() > 1.0  # the 1000x channels (|x| ~ 10), none of the rest (~0.01)
    masks = {OUTLIER_TENSOR: mask}
    main = [{"label": label, "spec": spec, **{k: _error(spec, x, masks.get(k)) for k, x in tensors.items()}}
            for label, spec in _codec_rows(quick)]
    families = {
        "TACO fp8 E4M3": "fp8:format=e4m3,group={g}",
        "TACO fp8 E5M2": "fp8:format=e5m2,group={g}",
        "fp8 E4M3 no Hadamard": "fp8:format=e4m3,group={g},hadamard=false",
        "plain fp8 E4M3": "fp8plain:format=e4m3,group={g}",
        "plain fp8 E5M2": "fp8plain:format=e5m2,group={g}",
    }
    groups = (32, 128, 512) if quick else (32, 64, 128, 256, 512)
    sweep_on = ("row-parallel outputs",) if quick else ("row-parallel outputs", "their gradients")
    sweep = [{"family": fam, "group": g, "tensor": t, **_error(pattern.format(g=g), tensors[t])}
             for fam, pattern in families.items() for g in groups for t in sweep_on]
    return {"tensors": stats, "main": main, "sweep": sweep}


# ---------------------------------------------------------------------------------------------
# 2. collectives

def _collective_worker(rank: int, world: int, sizes: list[int], specs: list[str], reps: int) -> list[dict]:
    import torch.distributed as dist

    from qwire.comm import all_gather, all_reduce, reduce_scatter

    ops = {"all_reduce": all_reduce, "reduce_scatter": reduce_scatter,
           "all_gather": lambda x, c: all_gather(x, c)}
    rows = []
    g = torch.Generator().manual_seed(rank)
    for n in sizes:
        x = torch.randn(n, generator=g) * 1e-2
        for kind, fn in ops.items():
            xin = x[: max(1, n // world)] if kind == "all_gather" else x  # gather shards of an n-element tensor
            for spec in specs:
                fn(xin, spec)  # warm-up
                times = []
                for _ in range(reps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn(xin, spec)
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank sets the time
                    times.append(float(dt))
                rows.append({"kind": kind, "numel": n, "spec": spec, "real_s": statistics.median(times)})
            if kind == "all_reduce":  # torch's own (ring) all-reduce, for reference
                times = []
                for _ in range(reps):
                    y = x.clone()
                    dist.barrier()
                    t0 = time.perf_counter()
                    dist.all_reduce(y)
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    times.append(float(dt))
                rows.append({"kind": kind, "numel": n, "spec": "torch.distributed fp32",
                             "real_s": statistics.median(times)})
    return rows


def _simulate(row: dict, world: int, bandwidths: list[float], latency_s: float) -> dict:
    from qwire.comm import wire_bytes

    if row["spec"].startswith("torch"):
        n = row["numel"]
        steps = 2 * (world - 1)  # ring: reduce-scatter + all-gather, one chunk per step
        per_step = 4 * (-(-n // world))
        wb = {"steps": steps, "bytes_per_step": per_step, "bytes_total": steps * per_step}
    else:
        shape = (max(1, row["numel"] // world),) if row["kind"] == "all_gather" else (row["numel"],)
        wb = wire_bytes(row["kind"], shape, torch.float32, row["spec"], world)
    sim = {f"{b:g}": row["real_s"] + wb["steps"] * latency_s + wb["bytes_total"] * 8 / (b * 1e9) for b in bandwidths}
    return {**row, "world": world, "wire": wb, "sim_s": sim}


def collectives(quick: bool, worlds: list[int], bandwidths: list[float], latency_s: float,
                reps: int) -> list[dict]:
    from qwire.codecs import available

    sizes = [1 << 12] if quick else [1 << 12, 1 << 16, 1 << 20, 1 << 22]
    specs = ["fp32", "bf16", "fp8"]
    if not quick:
        specs.append("fp8plain")
        if "blockwise8" in available():
            specs.append("blockwise8")
    out = []
    for world in worlds:
        rows = _launch("_collective_worker", world, sizes=sizes, specs=specs, reps=reps)[0]
        out += [_simulate(r, world, bandwidths, latency_s) for r in rows]
    return out


# ---------------------------------------------------------------------------------------------
# 3. TP training steps

def _tp_worker(rank: int, world: int, codecs: list[str], steps: int, spec: dict[str, Any], ids: torch.Tensor,
               seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from qwire.parallel.tp import apply_tp

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for codec in codecs:
        model = _model(spec, seed)
        out["shape"], out["layers"] = [*ids.shape, model.config.hidden_size], model.config.num_hidden_layers
        model = apply_tp(model, mesh, codec)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        losses, times = [], []
        for _ in range(steps):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        out[codec] = {"losses": losses, "step_s": statistics.median(times[1:] or times)}
    return out


def tp_steps(specs: list[str], steps: int, bandwidths: list[float], latency_s: float, model: dict[str, Any],
             ids: torch.Tensor, seed: int) -> dict:
    from qwire.comm import wire_bytes

    world = 2
    res = _launch("_tp_worker", world, codecs=specs, steps=steps, spec=model, ids=ids, seed=seed)[0]
    b, s, h = res["shape"]
    n_allreduce = 4 * res["layers"]  # o/down forward + the two block inputs' gradients backward, per layer
    for spec in specs:
        wb = wire_bytes("all_reduce", (b, s, h), torch.float32, spec, world)
        r = res[spec]
        r["wire_bytes_per_step"] = n_allreduce * wb["bytes_total"]
        r["sim_step_s"] = {f"{bw:g}": r["step_s"] + n_allreduce * (wb["steps"] * latency_s
                                                                   + wb["bytes_total"] * 8 / (bw * 1e9))
                           for bw in bandwidths}
    res["world"] = world
    res["allreduces_per_step"] = n_allreduce
    return res


# ---------------------------------------------------------------------------------------------
# report

def _implementations(specs: list[str]) -> dict[str, str]:
    """The implementation each codec ran with here ("torch": the eager reference; else a compiled kernel)."""
    from qwire.codecs import get_codec, kernels

    return {spec: kernels.implementation(get_codec(spec)) for spec in specs if spec != "fp32"}


def _findings(res: dict[str, Any]) -> list[str]:
    """A few sentences computed from the numbers above (so they stay true when the run changes)."""
    main = {r["spec"]: r for r in res["codec_error"]["main"]}
    had, noh = main.get("fp8:format=e4m3,group=128"), main.get("fp8:format=e4m3,group=128,hadamard=false")
    plain = main.get("fp8plain:format=e4m3,group=128")
    L = ["", "### Reading the numbers", ""]
    if had and noh and plain:
        t = "row-parallel outputs"
        gap = had[t]["snr_db"] - noh[t]["snr_db"]
        effect = ("changes nothing measurable (under 0.3 dB)" if abs(gap) < 0.3
                  else f"{'gains' if gap > 0 else 'loses'} {abs(gap):.1f} dB")
        L.append(f"- On the {t} the Hadamard rotation {effect} for FP8 "
                 f"(E4M3 {had[t]['snr_db']:.1f} dB with it, {noh[t]['snr_db']:.1f} dB without, "
                 f"{plain[t]['snr_db']:.1f} dB plain): floating point gives every element the same "
                 "relative precision, and the pre-scale alpha is absorbed by the absmax scale s.")
        o = OUTLIER_TENSOR
        h_o, p_o = had[o]["snr_db_non_outliers"], plain[o]["snr_db_non_outliers"]
        L.append(f"- With 1000x channel outliers the ordinary elements get {h_o:.1f} dB with the Hadamard vs "
                 f"{p_o:.1f} dB plain (overall SNR {had[o]['snr_db']:.1f} vs {plain[o]['snr_db']:.1f} dB)"
                 + (": the rotation spreads each outlier over its whole group, and the group's scale with it. For "
                    "FP8 on tensors with massive activations, `fp8:hadamard=false` or `fp8plain` is the safer "
                    "choice." if h_o < p_o - 1.0 else "."))
        e5 = main.get("fp8:format=e5m2,group=128")
        if e5:
            L.append(f"- E5M2 costs {had[t]['snr_db'] - e5[t]['snr_db']:.1f} dB against E4M3 on the {t} (one "
                     "mantissa bit less: ~6 dB); its wider exponent range is not needed once each group has its "
                     "own scale.")
    ar = [r for r in res["collectives"] if r["kind"] == "all_reduce" and r["spec"] in ("fp32", "fp8")]
    if ar:
        biggest = max(r["numel"] for r in ar)
        pick = {(r["world"], r["spec"]): r for r in ar if r["numel"] == biggest}
        worlds = sorted({w for w, _ in pick})
        impl = res["meta"].get("implementations", {}).get("fp8")
        per_world = []
        for w in worlds:
            f32, f8 = pick[(w, "fp32")], pick[(w, "fp8")]
            sims = ", ".join(f"{f32['sim_s'][k] / f8['sim_s'][k]:.2f}x at {k}" for k in f32["sim_s"])
            per_world.append(f"{w} ranks: {f8['real_s'] * 1e3:.0f} ms for fp8 vs {f32['real_s'] * 1e3:.0f} ms for "
                             f"fp32 ({f32['real_s'] / f8['real_s']:.2f}x) with no link, simulated {sims} Gbit/s")
        f32, f8 = pick[(worlds[0], "fp32")], pick[(worlds[0], "fp8")]
        L.append(f"- Collectives ({biggest}-element all-reduce): fp8 puts "
                 f"{f32['wire']['bytes_total'] / f8['wire']['bytes_total']:.2f}x fewer bytes on the wire than fp32. "
                 "Measured loopback time, which includes encode/decode, and the simulated speedup: "
                 + "; ".join(per_world) + ". The faster the link, the closer the speedup comes to the loopback "
                 "ratio, which is a CPU measurement on a shared machine"
                 + (f" (fp8 ran as `{impl}`)." if impl else "."))
    return L


def _model_text(meta: dict[str, Any]) -> str:
    """The model and the tokens the TP traffic came from (results made before ``--model`` had random tokens)."""
    if "model_name" not in meta:
        return "Llama on random tokens"
    b, s = meta["tokens"]
    return f"`{meta['model_name']}` ({meta['model']}) on {b} x {s} tokens of {meta['data']}"


def _markdown(res: dict[str, Any]) -> str:
    meta = res["meta"]
    L = [
        "# TACO: FP8 compression of tensor-parallel communication",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}"
        + (f", torch {meta['torch']} (gloo over loopback)" if "torch" in meta else "") + ".  ",
        f"Date: {meta['date']}. Total run time {meta['seconds']:.0f} s.",
        "",
        "All numbers below come from that one command. Timings are medians of repeated runs on a shared "
        "machine; read them as ratios measured side by side, not as absolute speeds.",
        "",
        "## 1. Codec error on tensor-parallel traffic",
        "",
        "SNR in dB (higher is better; `-10 log10(NMSE)`, NMSE = ||x_hat - x||^2 / ||x||^2) and wire bits "
        "per element. Tensors: the outputs of every `o_proj` and `down_proj` (what the forward all-reduce "
        "carries) and the gradients at those outputs (what the backward carries) of a randomly initialized "
        f"{_model_text(meta)}; dense near-zero Gaussian tensors.",
        "",
    ]
    ce = res["codec_error"]
    names = list(ce["tensors"])
    L.append("| tensor | elements | rms | absmax |")
    L.append("|---|---|---|---|")
    for k, s in ce["tensors"].items():
        L.append(f"| {k} | {s['numel']} | {s['rms']:.3g} | {s['absmax']:.3g} |")
    L += ["", "| codec | spec | bits/elem | " + " | ".join(f"SNR dB: {n}" for n in names)
          + f" | SNR dB: {OUTLIER_TENSOR}, non-outlier elements only |",
          "|---|---|---|" + "---|" * (len(names) + 1)]
    for row in ce["main"]:
        bpe = row[names[0]]["bits_per_element"]
        L.append(f"| {row['label']} | `{row['spec']}` | {bpe:.3f} | "
                 + " | ".join(f"{row[n]['snr_db']:.1f}" for n in names)
                 + f" | {row[OUTLIER_TENSOR]['snr_db_non_outliers']:.1f} |")
    groups = sorted({r["group"] for r in ce["sweep"]})
    for t in sorted({r["tensor"] for r in ce["sweep"]}, reverse=True):
        L += ["", f"Group size sweep on {'their gradients' if t == 'their gradients' else 'the ' + t}: "
              "SNR dB (bits/element)", "",
              "| codec | " + " | ".join(f"G={g}" for g in groups) + " |", "|---|" + "---|" * len(groups)]
        for fam in dict.fromkeys(r["family"] for r in ce["sweep"]):
            cells = []
            for g in groups:
                r = next(r for r in ce["sweep"] if r["family"] == fam and r["group"] == g and r["tensor"] == t)
                cells.append(f"{r['snr_db']:.1f} ({r['bits_per_element']:.2f})")
            L.append(f"| {fam} | " + " | ".join(cells) + " |")

    bws = meta["bandwidths_gbit"]
    L += ["", "## 2. Compressed collectives: measured gloo time + simulated link", "",
          "`real` is the measured time of qwire's collective on gloo over loopback (encode, all-to-all / "
          "all-gather, decode, fp32 sums), the slowest rank's, median of the repetitions. "
          f"**Simulated** columns add, per collective step, `bytes one rank sends / bandwidth + "
          f"{meta['latency_us']:g} us` for the real payload sizes — a model of a slow link, not a measurement. "
          "Speedup = fp32 codec time / this codec's time, same size, same world size, same link. "
          "`torch.distributed fp32` is gloo's own ring all-reduce (2(w-1) steps) for reference.", ""]
    hdr = "| world | collective | elements | codec | wire bytes/rank | real ms | " + " | ".join(
        f"sim ms @ {b:g} Gbit/s | speedup @ {b:g}" for b in bws) + " |"
    L += [hdr, "|---|---|---|---|---|---|" + "---|---|" * len(bws)]
    rows = res["collectives"]
    base = {(r["world"], r["kind"], r["numel"]): r for r in rows if r["spec"] == "fp32"}
    for r in rows:
        b0 = base[(r["world"], r["kind"], r["numel"])]
        cells = []
        for b in bws:
            key = f"{b:g}"
            cells.append(f"{r['sim_s'][key] * 1e3:.2f} | {b0['sim_s'][key] / r['sim_s'][key]:.2f}x")
        L.append(f"| {r['world']} | {r['kind']} | {r['numel']} | `{r['spec']}` | "
                 f"{fmt_bytes(r['wire']['bytes_total'])} | {r['real_s'] * 1e3:.2f} | " + " | ".join(cells) + " |")

    L += _findings(res)
    tp = res.get("tp")
    L += ["", "## 3. Tensor-parallel training steps (TP=2)", ""]
    if tp:
        b, s, h = tp["shape"]
        n_steps = len(tp[meta["tp_specs"][0]]["losses"])
        L += [f"The same model, TP={tp['world']} with "
              f"`apply_tp` ({tp['allreduces_per_step']} compressed all-reduces of `[{b}, {s}, {h}]` per step), "
              f"SGD on that fixed batch for {n_steps} steps. "
              "Step time = measured (this machine, loopback) + simulated transfer of the step's all-reduces.", "",
              "| codec | wire bytes/step/rank | real step ms | " + " | ".join(
                  f"sim step ms @ {bw:g} Gbit/s | speedup" for bw in bws) + " | first loss | last loss |",
              "|---|---|---|" + "---|---|" * len(bws) + "---|---|"]
        fp32 = tp.get("fp32")
        for spec in meta["tp_specs"]:
            r = tp[spec]
            cells = []
            for bw in bws:
                k = f"{bw:g}"
                sp = fp32["sim_step_s"][k] / r["sim_step_s"][k] if fp32 else float("nan")
                cells.append(f"{r['sim_step_s'][k] * 1e3:.1f} | {sp:.2f}x")
            L.append(f"| `{spec}` | {fmt_bytes(r['wire_bytes_per_step'])} | {r['step_s'] * 1e3:.1f} | "
                     + " | ".join(cells) + f" | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} |")
    else:
        L.append("Skipped (`--quick`).")
    L.append("")
    return "\n".join(L)


def render(res: dict[str, Any], out: Path) -> None:
    """Write ``taco.md`` from a ``taco.json`` result."""
    (Path(out) / "taco.md").write_text(_markdown(res))


def run(args: argparse.Namespace) -> int:
    if args.render_only:
        return render_saved("taco", Path(args.out), "taco", render)
    t0 = time.time()
    try:  # what the user can get wrong, before anything runs
        bandwidths = number_list(args.bandwidths, "--bandwidths")
        worlds = number_list(args.worlds, "--worlds", int)
        if args.quick and args.worlds == WORLDS:  # a quick run's own, unless --worlds was given
            worlds = [2]
        if min(worlds) < 2:
            raise ValueError(f"--worlds: each world size must be >= 2, got {args.worlds!r}")
        parse_corpus_spec(args.corpus)
        model_source(args.model)  # a preset, a config or a local model directory
    except (ValueError, OSError) as e:
        print(f"qwire bench taco: {e}", file=sys.stderr)
        return 2
    reps = min(args.reps, 2) if args.quick else args.reps
    latency = args.latency_us * 1e-6
    tp_specs = ["fp32", "bf16", "fp8"]
    model = "llama-micro" if args.quick and args.model == "llama-tiny" else args.model
    batch, seq = (1, 32) if args.quick else (4, 128)
    ids, vocab = _batch(args.corpus, args.vocab_size, batch, seq, args.seed)
    spec = {"model": model, "vocab": vocab}
    res: dict[str, Any] = {"meta": {"command": bench_command("taco", args, add_arguments), **machine_info(),
                                    "quick": bool(args.quick), "model_name": model,
                                    "model": model_summary(_model(spec, args.seed)),
                                    "data": f"corpus {args.corpus!r}, byte-level BPE vocab {vocab}",
                                    "tokens": [batch, seq],
                                    "bandwidths_gbit": bandwidths, "latency_us": args.latency_us,
                                    "worlds": worlds, "reps": reps, "seed": args.seed, "tp_specs": tp_specs,
                                    "date": time.strftime("%Y-%m-%d")}}
    print("codec error ...", flush=True)
    res["codec_error"] = codec_error(args.quick, spec, ids, args.seed)
    print("collectives ...", flush=True)
    res["collectives"] = collectives(args.quick, worlds, bandwidths, latency, reps)
    res["meta"]["implementations"] = _implementations(
        list(dict.fromkeys(r["spec"] for r in res["collectives"] if not r["spec"].startswith("torch"))))
    if not args.quick and args.tp_steps > 0:
        print("TP steps ...", flush=True)
        res["tp"] = tp_steps(tp_specs, args.tp_steps, bandwidths, latency, spec, ids, args.seed)
    res["meta"]["seconds"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "taco.json").write_text(json.dumps(res, indent=1))
    render(res, out)
    print(f"wrote {out / 'taco.json'} and {out / 'taco.md'}")
    return 0
