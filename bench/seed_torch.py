#!/usr/bin/env python3
"""seed_torch.py: PyTorch eager's peer of bench/bench_seed.c: a 1000x1000 f32
matrix m ~ N(0, 1/1000) multiplied into x 200 times (x = x @ m), total
seconds, median of --runs. Prints "@ seed.chain.torch SECONDS s"."""
import argparse
import statistics
import sys
import time

N = 1000


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (Kiln's count)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"seed_torch: PyTorch is not importable by {sys.executable} ({e}); no peer")
        return 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(11)
    m = torch.randn(N, N) / N ** 0.5
    x0 = torch.randn(N, N)

    def chain(iters):
        x = x0
        t0 = time.perf_counter()
        for _ in range(iters):
            x = torch.matmul(x, m)
        return time.perf_counter() - t0, x.abs().mean().item()

    chain(3)  # warm-up
    times = []
    for _ in range(args.runs):
        dt, check = chain(args.iters)
        times.append(dt)
    med = statistics.median_low(times)
    print(f"seed: {N}x{N} f32, x = matmul(x, m) {args.iters} times, eager: torch {med:.3f} s "
          f"({2.0 * N ** 3 * args.iters / med / 1e9:.1f} GFLOP/s; median of {args.runs}; min {min(times):.3f})"
          f"  mean|x| {check:.3g}  [{torch.get_num_threads()} thread(s), torch {torch.__version__}]")
    print(f"@ seed.chain.torch {med:.6g} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
