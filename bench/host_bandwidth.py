#!/usr/bin/env python3
"""The host's memory bandwidth, as a copy sees it: a copy of 256 MB of floats
(torch on the CPU), the best of five, with 1, 2, 4, 8 and 16 threads. Prints
GB/s counting the bytes read and the bytes written. The bound this gives a
ps and its workers on one host is in docs/performance.md ("A lane's fp32
uploads in one call, and what bounds the fp32 tail").

Usage: python3 bench/host_bandwidth.py   (needs torch)
"""
import sys
import time

try:
    import torch
except ImportError:
    sys.exit("host_bandwidth.py: python3 cannot import torch (pip install torch)")

src = torch.rand(64 << 20)
dst = torch.empty_like(src)
moved = 2 * src.numel() * src.element_size() / 1e9  # read + write, GB
for threads in (1, 2, 4, 8, 16):
    torch.set_num_threads(threads)
    dst.copy_(src)  # warm: pages touched, threads started
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    print(f"threads {threads}: copy {moved / best:.1f} GB/s (read + write)")
