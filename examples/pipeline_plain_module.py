"""Compressed pipeline boundaries for your own training loop, on a plain nn.Module.

Two processes, one stage each, PyTorch's own 1F1B schedule on gloo; the
activations cross the boundary as 4-bit TAH-Quant payloads and the gradients
as 6-bit per-channel payloads.

    python examples/pipeline_plain_module.py
"""

import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import Schedule1F1B

from qwire import boundary_bytes, compressed_pipeline_stage

BATCH, MICROBATCHES, WIDTH = 32, 4, 64


def run(rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)  # same data and initial weights on both ranks
    x, target = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    stages = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(world)]
    module = stages[rank]

    # The one call: any module you would hand to PipelineStage, plus an example micro-batch input.
    stage = compressed_pipeline_stage(module, rank, world, "cpu",
                                      input_args=torch.zeros(BATCH // MICROBATCHES, WIDTH),
                                      fwd="tahquant", bwd="perchannel6")
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(20):
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=target, losses=losses)
            if step % 5 == 0 or step == 19:
                print(f"step {step:2d} loss {torch.stack(losses).mean():.4f}", flush=True)
        opt.step()
    sent = boundary_bytes(stage)
    print(f"rank {rank} sent {sent['fwd']} B of activations and {sent['bwd']} B of gradients "
          f"(fp32 would be {sent['fp32']} B)", flush=True)
    dist.destroy_process_group()


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(rank, world)


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port), nprocs=2)
