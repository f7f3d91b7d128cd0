"""Joining one attempt of a torchrun job.

torchrun restarts every worker of a job after one fails (``--max-restarts``), and its agents share one
store (``MASTER_ADDR:MASTER_PORT``) across all the attempts: the static rendezvous (``--master-addr``) keeps
it for the job's life, and so does the c10d one (``--rdzv-backend c10d``), whose workers join through the
agents' store. torch's ``env://`` rendezvous adds no prefix per attempt to it, so a restarted rank read the
addresses that the dead attempt's ranks had published and failed to connect, or waited until --timeout.

A prefix from ``TORCHELASTIC_RESTART_COUNT`` does not serve: under the c10d rendezvous an agent whose own
workers are well restarts them when another machine's failed (a change of membership), without counting a
restart, so the machines' counts differ and their attempts never meet. The ranks of an attempt therefore
agree on its name through the store itself (:func:`join_attempt`).
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import time
from typing import Any

import torch.distributed as dist

NAME_KEY = "qwire/attempt"  # the name the latest attempt's rank 0 gave it
# Set for the ranks of qwire's launchers (local and the network lab's), which hold the job's store themselves
# (:func:`launcher_store`)
LAUNCHER_STORE_ENV = "QWIRE_LAUNCHER_STORE"
POLL_S = 0.05


class JoinTimeout(RuntimeError):
    pass


def _here(name: str, rank: int) -> str:
    return f"{NAME_KEY}/{name}/here/{rank}"


def _go(name: str) -> str:
    return f"{NAME_KEY}/{name}/go"


def join_attempt(store: Any, rank: int, world: int, timeout: float, *, where: str = "the job's store",
                 clock=time.monotonic) -> str:
    """The name that every rank of this attempt agrees on, through ``store`` (which outlives the attempts).

    Rank 0 names the attempt (a fresh random token) under ``qwire/attempt``. Every other rank reads the name,
    says it is there with a token of its own, and waits for rank 0's go, which lists the tokens rank 0 saw. A
    rank that read an earlier attempt's name (its rank 0 is gone) finds no go, or one without its token, and
    reads the name again until rank 0 of its own attempt has written it. Raises :class:`JoinTimeout`, naming
    the ranks that did not come, after ``timeout`` seconds."""
    deadline = clock() + timeout
    if rank == 0:
        name = secrets.token_hex(8)
        store.set(NAME_KEY, name)
        others = [_here(name, r) for r in range(1, world)]
        while others and not store.check(others):
            if clock() > deadline:
                missing = [r for r in range(1, world) if not store.check([_here(name, r)])]
                raise JoinTimeout(f"ranks {', '.join(map(str, missing))} of {world} did not join this attempt of "
                                  f"the job within --timeout {timeout:g} s ({where}); are they running?")
            time.sleep(POLL_S)
        vals = store.multi_get(others) if hasattr(store, "multi_get") else [store.get(k) for k in others]
        tokens = {str(r): v.decode() for r, v in zip(range(1, world), vals)}
        store.set(_go(name), json.dumps(tokens))
        return name
    me = secrets.token_hex(8)
    while True:
        while not store.check([NAME_KEY]):  # rank 0 of the job's first attempt has not started yet
            _wait(clock, deadline, timeout, where)
        name = store.get(NAME_KEY).decode()
        store.set(_here(name, rank), me)
        while True:
            if store.check([_go(name)]):
                if json.loads(store.get(_go(name))).get(str(rank)) == me:
                    return name
                break  # an earlier attempt's go: wait for this attempt's name
            if store.get(NAME_KEY).decode() != name:
                break  # rank 0 of this attempt has named it since
            _wait(clock, deadline, timeout, where)
        while store.get(NAME_KEY).decode() == name:
            _wait(clock, deadline, timeout, where)


def _wait(clock, deadline: float, timeout: float, where: str) -> None:
    if clock() > deadline:
        raise JoinTimeout(f"rank 0 did not start this attempt of the job within --timeout {timeout:g} s ({where}); "
                          "is it running?")
    time.sleep(POLL_S)


def launcher_store(timeout: float, host: str = "127.0.0.1", port: int = 0) -> Any:
    """The job's store, held by qwire's launcher (by default on a free port on loopback, ``.port``) for the ranks
    it starts, as torchrun's agent holds one: a rank that dies (rank 0 included) takes no store with it, so the
    others' heartbeats still reach it and name the rank that failed, and nothing of theirs finds it gone. The
    network lab's launcher makes it in rank 0's namespace, at rank 0's address and ``port``."""
    return dist.TCPStore(host, port, None, True, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def attempt_store(world: int, timeout: datetime.timedelta) -> tuple[Any, str]:
    """Under torchrun, the job's store with this attempt's prefix, and the attempt's name; under qwire's launchers
    (local and the network lab's), their store (:func:`launcher_store`) and "0"; (None, "0") elsewhere (torch's
    ``env://`` rendezvous, whose store rank 0 holds)."""
    launcher = os.environ.get(LAUNCHER_STORE_ENV) == "1"
    if not launcher and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None, "0"
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    if launcher:
        return store, "0"
    name = join_attempt(store, int(os.environ["RANK"]), world, timeout.total_seconds(),
                        where=f"torchrun's store at {host}:{port}")
    return dist.PrefixStore(f"{NAME_KEY}/{name}/", store), name


GPU_KEY = "qwire/gpu"  # each rank's GPU, for --backend auto (:func:`gpu_backend`)


def gpu_name(device: Any) -> str:
    """What tells ``device`` (a CUDA device) apart from every other GPU: its UUID (the same whichever of a
    machine's GPUs ``CUDA_VISIBLE_DEVICES`` lets a process see, and under whatever index), else the machine's
    name and the GPU's PCI address."""
    import socket

    import torch

    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}"
    pci = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    return f"{socket.gethostname()}/{':'.join(map(str, pci)) if None not in pci else device}"


def gpu_backend(store: Any, rank: int, world: int, gpu: str) -> str:
    """``--backend auto`` on CUDA: ``nccl`` when no two ranks of the job run on one GPU (NCCL refuses that),
    else ``gloo``. Each rank posts its GPU (:func:`gpu_name`) to the job's store and reads every rank's, so
    all ranks decide from the same list and join with the same transport, whatever GPUs each machine has, and
    whether a scheduler shows each rank all of them or its own one (``CUDA_VISIBLE_DEVICES``). Waits for the
    other ranks as long as the store's timeout (a rank that never posts raises the store's error)."""
    store.set(f"{GPU_KEY}/{rank}", gpu)
    gpus = [store.get(f"{GPU_KEY}/{r}").decode() for r in range(world)]
    return "nccl" if len(set(gpus)) == world else "gloo"
