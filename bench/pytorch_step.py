#!/usr/bin/env python3
"""The baseline of bench/gpu_step.sh: the training step of psflow-bench-step,
written in PyTorch eager mode: the same models (cnn and the 32x32 resnet,
layer for layer), fp32 with PyTorch's default math settings, synthetic inputs
that stay on the GPU, standardization, forward, cross-entropy, backward and a
plain SGD update. Prints one line per batch size in psflow-bench-step's
format, with mode=torch.

  python3 bench/pytorch_step.py --model=cnn --batch_sizes=64,512 [--device=cuda:0]
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 20, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(20, 50, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(50 * 4 * 4, 500), nn.ReLU(), nn.Linear(500, 10))


class Block(nn.Module):
    """A basic residual block as psflow's resnet spec builds it."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.proj = None
        if stride != 1 or cin != cout:
            self.proj = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.proj is None else self.proj(x)))


class Resnet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        blocks, cin = [], 64
        for stage in range(4):
            cout = 64 << stage
            for block in range(2):
                stride = 2 if block == 0 and stage > 0 else 1
                blocks.append(Block(cin, cout, stride))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.blocks(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def sgd_step(model, opt, images, labels):
    """One step as psflow's: standardize, forward, cross-entropy, backward, SGD."""
    x = (images - 0.5) / 0.2
    loss = F.cross_entropy(model(x), labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["cnn", "resnet"], default="cnn")
    p.add_argument("--batch_sizes", default="64")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup_steps", type=int, default=10)
    p.add_argument("--learning_rate", type=float, default=0.01)
    a = p.parse_args()
    dev = torch.device(a.device)
    shape = (1, 28, 28) if a.model == "cnn" else (3, 32, 32)
    torch.manual_seed(1)
    for batch in [int(b) for b in a.batch_sizes.split(",")]:
        net = (cnn() if a.model == "cnn" else Resnet()).to(dev)
        net.train()
        opt = torch.optim.SGD(net.parameters(), lr=a.learning_rate)
        images = torch.rand((batch,) + shape, device=dev)
        labels = torch.randint(0, 10, (batch,), device=dev)

        def step():
            return sgd_step(net, opt, images, labels)

        for _ in range(a.warmup_steps):
            step()
        torch.cuda.synchronize(dev)
        times = []
        for _ in range(a.repeats):
            start = time.perf_counter()
            for _ in range(a.steps):
                loss = step()
            loss.item()  # waits for the last step, like psflow-bench-step's FinishStep
            times.append((time.perf_counter() - start) * 1000.0 / a.steps)
        times.sort()
        ms = times[len(times) // 2]
        print(f"step model={a.model} device={a.device} batch={batch} mode=torch ms={ms:.3f} "
              f"examples_per_s={batch * 1000.0 / ms:.0f} loss={loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
