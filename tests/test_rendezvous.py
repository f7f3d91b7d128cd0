"""The ranks of a torchrun attempt agree on its name through a store that outlives the attempts
(qwire.rendezvous), whatever earlier attempts left in it and in whatever order the ranks arrive."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from qwire.rendezvous import NAME_KEY, JoinTimeout, gpu_backend, join_attempt


@pytest.fixture
def server():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
    yield s


def _client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))


def _in_threads(world: int, call) -> dict[int, object]:
    """``call(r)`` for every rank r, each from its own thread: what each returned or raised."""
    got: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            got[r] = call(r)
        except Exception as e:  # noqa: BLE001 - reported by the test
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def _join_all(server, world: int, delay: dict[int, float], timeout: float = 20.0) -> dict[int, object]:
    """Every rank joins from its own thread and store client, rank r after ``delay[r]`` seconds."""

    def join(r: int) -> str:
        time.sleep(delay.get(r, 0.0))
        return join_attempt(_client(server), r, world, timeout)

    return _in_threads(world, join)


def test_the_ranks_of_an_attempt_agree_on_a_fresh_name_after_earlier_attempts(server) -> None:
    first = _join_all(server, 3, {0: 0.3})  # the others come first and wait for rank 0
    assert len(set(first.values())) == 1 and isinstance(first[0], str), first
    # a restart: the store still holds the first attempt's name and its go; the other ranks read it first
    again = _join_all(server, 3, {0: 0.5})
    assert len(set(again.values())) == 1 and isinstance(again[0], str), again
    assert again[0] != first[0]
    # an attempt that died before its rank 0 said go (a rank never came): its name is left without one
    server.set(NAME_KEY, "dead")
    third = _join_all(server, 3, {0: 0.5, 2: 0.1})
    assert len(set(third.values())) == 1 and third[0] not in ("dead", first[0], again[0]), third
    # rank 0 first, the others later
    fourth = _join_all(server, 4, {1: 0.2, 2: 0.4, 3: 0.1})
    assert len(set(fourth.values())) == 1 and isinstance(fourth[0], str), fourth


def test_a_rank_that_never_comes_is_named_after_the_timeout(server) -> None:
    with pytest.raises(JoinTimeout, match=r"ranks 1, 2 of 3 did not join this attempt of the job within "
                                          r"--timeout 0.5 s \(the job's store\)"):
        join_attempt(_client(server), 0, 3, 0.5)
    # a rank whose rank 0 never names its attempt (here: the name left by the attempt above, never said go)
    with pytest.raises(JoinTimeout, match=r"rank 0 did not start this attempt of the job within --timeout 0.5 s"):
        join_attempt(_client(server), 1, 3, 0.5)
    fresh = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # rank 0 never started at all
    with pytest.raises(JoinTimeout, match=r"rank 0 did not start"):
        join_attempt(fresh, 2, 3, 0.3)


def _backends(server, gpus: list[str], prefix: str) -> dict[int, object]:
    """``gpu_backend`` of ranks on ``gpus`` (rank r on ``gpus[r]``), each from its own thread and store client."""
    return _in_threads(len(gpus), lambda r: gpu_backend(dist.PrefixStore(prefix, _client(server)), r, len(gpus),
                                                        gpus[r]))


def test_backend_auto_is_nccl_only_where_no_two_ranks_share_a_gpu(server) -> None:
    """Every rank decides from every rank's GPU, so all decide alike: two machines, one with a GPU per rank and
    one whose two ranks share a GPU, take gloo everywhere (counting the GPUs each rank sees, the first machine's
    ranks took nccl and the second's gloo: the job never formed); ranks that each see only their own GPU
    (``CUDA_VISIBLE_DEVICES``, one visible GPU each) take nccl."""
    mixed = _backends(server, ["GPU-a", "GPU-b", "GPU-c", "GPU-c"], "mixed/")
    assert mixed == dict.fromkeys(range(4), "gloo"), mixed
    own = _backends(server, ["GPU-a", "GPU-b", "GPU-c", "GPU-d"], "own/")
    assert own == dict.fromkeys(range(4), "nccl"), own
    short = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError):  # a rank that never posts its GPU: the store's timeout, not a hang
        gpu_backend(dist.PrefixStore("alone/", short), 0, 2, "GPU-a")


def test_a_gpu_is_named_by_its_uuid_else_by_machine_and_pci_address(monkeypatch) -> None:
    import socket
    import types

    import torch

    from qwire.rendezvous import gpu_name

    props = types.SimpleNamespace(uuid="8f2c-11", pci_domain_id=0, pci_bus_id=65, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    assert gpu_name("cuda:0") == "GPU-8f2c-11"
    del props.uuid
    assert gpu_name("cuda:0") == f"{socket.gethostname()}/0:65:0"
