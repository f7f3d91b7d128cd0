"""Real tensors at a pipeline boundary: train a tiny causal LM briefly, save its middle activations.

``capture_boundary`` trains a preset model (default ``llama-tiny``) on a corpus
(default the Python standard library's source, always on the machine) for a
few hundred steps, split into two pipeline stages, then runs validation
batches through it and saves the hidden state crossing the stage boundary
(forward activations, ``[B, S, H]``) and the gradient of the loss with
respect to it (what the backward pass sends back). Used by
``qwire bench codecs``; ``scripts/capture_activations.py`` runs it alone.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_CAPTURE = Path(".cache") / "codecs" / "boundary-llama-tiny.pt"


def capture_boundary(path: str | Path = DEFAULT_CAPTURE, steps: int = 300, batch_size: int = 8,
                     seq_len: int = 128, preset: str = "llama-tiny", corpus: str = "stdlib",
                     lr: float = 1e-3, capture_batches: int = 4, seed: int = 0,
                     log: Any = print) -> dict[str, Any]:
    """Train ``preset`` for ``steps`` steps, then save boundary activations and gradients to ``path``.

    The model is split into 2 stages (the boundary is after the middle decoder
    layer); ``capture_batches`` validation batches of ``batch_size`` sequences are
    concatenated. Returns the saved dict: ``activation`` and ``gradient`` (fp32
    ``[capture_batches * batch_size, seq_len, hidden]``) and ``meta``.
    """
    from qwire.data import build_datasets, iterate_batches
    from qwire.models import build_model, lm_loss, split_model

    t0 = time.time()
    torch.manual_seed(seed)
    train_ds, val_ds, tok = build_datasets(corpus=corpus, seq_len=seq_len, vocab_size=4096, seed=seed)
    model = build_model(preset, vocab_size=tok.vocab_size, seed=seed)
    stages = split_model(model, 2)
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup))
    losses = []
    step, epoch = 0, 0
    while step < steps:
        for ids, labels, _ in iterate_batches(train_ds, batch_size, seed=seed, epoch=epoch):
            if step >= steps:
                break
            loss = lm_loss(stages[1](stages[0](ids)), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            step += 1
            if step % max(1, steps // 10) == 0 or step == steps:
                log(f"capture: step {step}/{steps} loss {sum(losses[-10:]) / len(losses[-10:]):.3f}")
        epoch += 1
    acts, grads, vloss = [], [], []
    for i, (ids, labels, _) in enumerate(iterate_batches(val_ds, batch_size, seed=seed, shuffle=False)):
        if i >= capture_batches:
            break
        h = stages[0](ids).detach().requires_grad_(True)
        loss = lm_loss(stages[1](h), labels)
        loss.backward()
        acts.append(h.detach().float())
        grads.append(h.grad.float())
        vloss.append(float(loss.detach()))
    out = {
        "activation": torch.cat(acts),
        "gradient": torch.cat(grads),
        "meta": {
            "preset": preset, "corpus": corpus, "steps": steps, "batch_size": batch_size, "seq_len": seq_len,
            "lr": lr, "seed": seed, "boundary": _boundary(model),
            "train_loss_first": losses[0] if losses else None,
            "train_loss_last10": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "val_loss": sum(vloss) / max(1, len(vloss)),
            "seconds": round(time.time() - t0, 1),
        },
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(out, tmp)
    tmp.replace(path)
    log(f"capture: saved {tuple(out['activation'].shape)} activations and gradients to {path} "
        f"({out['meta']['seconds']} s)")
    return out


def _boundary(model: Any) -> str:
    n = getattr(model.config, "num_hidden_layers", None) or getattr(model.config, "n_layer", None)
    return f"after decoder layer {n - n // 2} of {n}" if n else "between the 2 stages"


def load_or_capture(path: str | Path = DEFAULT_CAPTURE, steps: int = 300, log: Any = print) -> dict[str, Any]:
    """The capture at ``path`` if it exists (and was trained for ``steps``), else a fresh one."""
    path = Path(path)
    if path.is_file():
        data = torch.load(path, weights_only=True)
        if data.get("meta", {}).get("steps") == steps:
            return data
        log(f"capture: {path} was trained for {data.get('meta', {}).get('steps')} steps, not {steps}; redoing it")
    return capture_boundary(path, steps=steps, log=log)
