#!/usr/bin/env python3
"""The baseline of bench/gpu_vs_ddp.sh: PyTorch DistributedDataParallel over
NCCL on the GPUs of one host. One process per GPU (started with
torch.multiprocessing.spawn, meeting on 127.0.0.1 at a free port), each
training the model of bench/pytorch_step.py (the cnn or the 32x32 resnet,
layer for layer as psflow builds them) on a synthetic batch of its own that
stays on its GPU: standardization, forward, cross-entropy, backward with DDP's
all-reduce of the gradients, and a plain SGD update; fp32 with PyTorch's
default math settings. After the warm-up steps, the timed steps run between
two torch.cuda.synchronize calls; the slowest process's time counts. Prints
one line, with the batch per GPU and the examples/s of all GPUs together:

  ddp model=resnet gpus=2 batch=128 examples/s=25771.3 step_ms=9.93 loss=2.3026

With --gpus=1 the step runs in this process with neither DDP nor a process
group: the model trained alone on one GPU.

  python3 bench/pytorch_ddp.py --model=resnet --gpus=2 --batch_size=128
"""
import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_step import Resnet, cnn, sgd_step  # noqa: E402  (psflow's models and step)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(rank, a):
    """Trains on cuda:rank as process rank of a.gpus; rank 0 prints the line."""
    world = a.gpus
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    if world > 1:
        dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.manual_seed(1)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    net = (cnn() if a.model == "cnn" else Resnet()).to(dev)
    net.train()
    model = DistributedDataParallel(net, device_ids=[rank]) if world > 1 else net
    opt = torch.optim.SGD(model.parameters(), lr=a.learning_rate)
    shape = (1, 28, 28) if a.model == "cnn" else (3, 32, 32)
    torch.manual_seed(100 + rank)  # a batch of its own on every GPU
    images = torch.rand((a.batch_size,) + shape, device=dev)
    labels = torch.randint(0, 10, (a.batch_size,), device=dev)

    def step():
        return sgd_step(model, opt, images, labels)

    def all_done():  # every queued step on every GPU has finished
        if world > 1:
            dist.all_reduce(torch.zeros(1, device=dev))
        torch.cuda.synchronize(dev)

    for _ in range(a.warmup):
        step()
    all_done()
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start
    if world > 1:
        slowest = torch.tensor([seconds], dtype=torch.float64, device=dev)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds = slowest.item()
    if rank == 0:
        print(f"ddp model={a.model} gpus={world} batch={a.batch_size} "
              f"examples/s={world * a.batch_size * a.steps / seconds:.1f} "
              f"step_ms={seconds * 1000.0 / a.steps:.2f} loss={loss.item():.4f}", flush=True)
    if world > 1:
        dist.destroy_process_group()


def main():
    # NCCL's NVLink multicast (NVLS) stays off unless the environment turns it on.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["cnn", "resnet"], default="resnet")
    p.add_argument("--gpus", type=int, default=0, help="GPUs (processes); 0 = all visible")
    p.add_argument("--batch_size", type=int, default=128, help="examples per GPU and step")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    p.add_argument("--steps", type=int, default=200, help="timed steps")
    p.add_argument("--learning_rate", type=float, default=0.05)
    a = p.parse_args()
    visible = torch.cuda.device_count()
    if a.gpus <= 0:
        a.gpus = visible
    if not 1 <= a.gpus <= visible:
        p.error(f"--gpus={a.gpus}, but {visible} GPU(s) are visible")
    if a.batch_size < 1 or a.warmup < 1 or a.steps < 1:
        p.error("--batch_size, --warmup and --steps must be positive")
    if a.gpus == 1:
        train(0, a)
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    mp.spawn(train, args=(a,), nprocs=a.gpus)


if __name__ == "__main__":
    main()
