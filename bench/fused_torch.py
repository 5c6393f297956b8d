#!/usr/bin/env python3
"""fused_torch.py: PyTorch eager's peer of bench/bench_fused.c: tanh(x*a+b)*c+x
on 16M f32 (a, b, c scalars), in GB/s counting x read once and the result
written once (as bench_fused does), median of --runs runs, on 1 thread and on
--threads threads. Prints "@ fused.t1.torch GB/s" and "@ fused.tall.torch GB/s"
lines for scripts/bench_issue6.sh."""
import argparse
import statistics
import sys
import time

N = 16 * 1024 * 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1, help="Kiln's thread count (kiln_num_threads)")
    ap.add_argument("--runs", type=int, default=9, help="timed runs, median reported")
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"fused_torch: PyTorch is not importable by {sys.executable} ({e}); no peer")
        return 0
    x = (torch.arange(N, dtype=torch.float32) % 1000) * 0.002 - 1  # bench_fused's data
    a, b, c = 0.5, 0.25, 2.0
    for cfg, threads in (("t1", 1), ("tall", args.threads)):
        if cfg == "tall" and threads == 1:
            continue
        torch.set_num_threads(threads)
        times = []
        with torch.no_grad():
            for r in range(-1, args.runs):  # run -1 warms up
                t0 = time.perf_counter()
                y = torch.tanh(x * a + b) * c + x
                dt = time.perf_counter() - t0
                del y
                if r >= 0:
                    times.append(dt)
        gbs = 2.0 * N * 4 / statistics.median(times) / 1e9
        print(f"{cfg} ({threads} thread(s)): torch eager tanh(x*a+b)*c+x {gbs:6.2f} GB/s "
              f"({statistics.median(times) * 1e3:.1f} ms, median of {args.runs}; torch {torch.__version__})")
        print(f"@ fused.{cfg}.torch {gbs:.6g} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
