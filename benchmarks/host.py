"""The machine a benchmark ran on, in one line: its seconds only compare with a host of the same speed.

Machines of this kind vary (an AMD host one week, an Intel one with AMX the next) and one host's speed
drifts while it is shared, so the timed benchmarks print this line before their cases and after
them: the CPU model and the float32 and bfloat16 matrix-product rates measured then.

    python benchmarks/host.py [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or 'unknown CPU' where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def matmul_rate(dtype_name: str = "float32", threads: int = 2, n: int = 1024, repeat: int = 5) -> float:
    """GFLOP/s of one n × n matrix product at `threads` intra-op threads, the best of `repeat` rounds of 5."""
    import torch

    dtype = getattr(torch, dtype_name)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # first call: kernel selection, packing buffers
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            for _ in range(5):
                a @ b
            best = min(best, (time.perf_counter() - t) / 5)
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / best / 1e9


def describe(threads: int = 2) -> str:
    """'# host: <CPU model>, <threads> threads: float32 matmul <r> GFLOP/s, bfloat16 <r>, load <1-min>'."""
    f32, bf16 = matmul_rate("float32", threads), matmul_rate("bfloat16", threads)
    return (
        f"# host: {cpu_model()}, {threads} threads: float32 matmul {f32:.0f} GFLOP/s, "
        f"bfloat16 {bf16:.0f} GFLOP/s (1024², best of 5), load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    print(describe(p.parse_args().threads))
