#!/usr/bin/env python3
"""The PyTorch DistributedDataParallel baseline of the bench scripts: on the
GPUs of one host over NCCL (bench/gpu_vs_ddp.sh, gpu_vs_ddp_4.sh), or in
processes on the CPU over gloo (--device=cpu: bench/allreduce_cpu.sh). One
process per GPU or per --procs (started with torch.multiprocessing.spawn,
meeting on 127.0.0.1 at a free port), each training the model of
bench/pytorch_step.py (the cnn or the 32x32 resnet, layer for layer as psflow
builds them) on a synthetic batch of its own that stays on its device (made
once, the same every step): standardization, forward, cross-entropy, backward
with DDP's all-reduce of the gradients, and a plain SGD update; fp32 with
PyTorch's default math and DDP settings. After the warm-up steps, the timed
steps run between a barrier of all processes and the last step's end (on a GPU,
torch.cuda.synchronize); the slowest process's time counts. Prints one line,
with the batch per process and the examples/s of all processes together:

  ddp model=resnet gpus=2 batch=128 examples/s=25771.3 step_ms=9.93 loss=2.3026
  ddp model=cnn device=cpu procs=2 threads=1 backend=gloo batch=64 examples/s=8123.4 step_ms=15.76 loss=2.2967

With --gpus=1 (or --device=cpu --procs=1) the step runs in this process with
neither DDP nor a process group: the model trained alone. On the CPU every
process runs PyTorch's kernels on --threads threads (torch.set_num_threads;
1 by default, as psflow's --compute_threads=1).

  python3 bench/pytorch_ddp.py --model=resnet --gpus=2 --batch_size=128
  python3 bench/pytorch_ddp.py --model=cnn --device=cpu --procs=2 --threads=1 --batch_size=64
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
    """Trains as process rank of a.procs, on cuda:rank or the CPU; rank 0 prints the line."""
    world = a.procs
    cpu = a.device == "cpu"
    if cpu:
        torch.set_num_threads(a.threads)  # kernels (and autograd) on this many threads
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
    if world > 1:
        dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world)
    torch.manual_seed(1)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    net = (cnn() if a.model == "cnn" else Resnet()).to(dev)
    net.train()
    if world > 1:
        model = DistributedDataParallel(net) if cpu else DistributedDataParallel(net, device_ids=[rank])
    else:
        model = net
    opt = torch.optim.SGD(model.parameters(), lr=a.learning_rate)
    shape = (1, 28, 28) if a.model == "cnn" else (3, 32, 32)
    torch.manual_seed(100 + rank)  # a batch of its own in every process
    images = torch.rand((a.batch_size,) + shape, device=dev)
    labels = torch.randint(0, 10, (a.batch_size,), device=dev)

    def step():
        return sgd_step(model, opt, images, labels)

    def synchronize():  # this process's queued work has finished (CPU work is done when it returns)
        if not cpu:
            torch.cuda.synchronize(dev)

    def all_done():  # every queued step in every process has finished
        if world > 1:
            dist.all_reduce(torch.zeros(1, device=dev))
        synchronize()

    for _ in range(a.warmup):
        step()
    all_done()
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    synchronize()
    seconds = time.perf_counter() - start
    if world > 1:
        slowest = torch.tensor([seconds], dtype=torch.float64, device=dev)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds = slowest.item()
    if rank == 0:
        where = (f"device=cpu procs={world} threads={a.threads} backend={'gloo' if world > 1 else 'none'}"
                 if cpu else f"gpus={world}")
        print(f"ddp model={a.model} {where} batch={a.batch_size} "
              f"examples/s={world * a.batch_size * a.steps / seconds:.1f} "
              f"step_ms={seconds * 1000.0 / a.steps:.2f} loss={loss.item():.4f}", flush=True)
    if world > 1:
        dist.destroy_process_group()


def main():
    # NCCL's NVLink multicast (NVLS) stays off unless the environment turns it on.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["cnn", "resnet"], default="resnet")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: a process per GPU over NCCL; cpu: --procs processes over gloo")
    p.add_argument("--gpus", type=int, default=0, help="GPUs (processes); 0 = all visible")
    p.add_argument("--procs", type=int, default=2, help="with --device=cpu: processes")
    p.add_argument("--threads", type=int, default=1,
                   help="with --device=cpu: torch.set_num_threads of every process")
    p.add_argument("--batch_size", type=int, default=128, help="examples per process and step")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    p.add_argument("--steps", type=int, default=200, help="timed steps")
    p.add_argument("--learning_rate", type=float, default=0.05)
    a = p.parse_args()
    if a.device == "cpu":
        if a.procs < 1 or a.threads < 1:
            p.error("--procs and --threads must be positive")
        # The rendezvous and gloo's pairs stay on loopback, whatever the host name resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # Spawned processes start their OpenMP pools at this size (train() sets it again).
        os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    else:
        visible = torch.cuda.device_count()
        if a.gpus <= 0:
            a.gpus = visible
        if not 1 <= a.gpus <= visible:
            p.error(f"--gpus={a.gpus}, but {visible} GPU(s) are visible")
        a.procs = a.gpus
    if a.batch_size < 1 or a.warmup < 1 or a.steps < 1:
        p.error("--batch_size, --warmup and --steps must be positive")
    if a.procs == 1:
        train(0, a)
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    mp.spawn(train, args=(a,), nprocs=a.procs)


if __name__ == "__main__":
    main()
