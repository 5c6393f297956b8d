#!/usr/bin/env python3
"""lstm_torch.py — PyTorch eager's peer of bench_control's LSTM: nn.LSTM
(batch 32, input 128, hidden 128) over T = 100 steps, forward only, under
torch.no_grad(); ms per call, median of --runs runs of --calls calls.
Prints "@ control.lstm.step.torch MS ms" like the Kiln programs."""
import argparse
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(7)
    lstm = torch.nn.LSTM(128, 128)  # (T, B, input), as bench_control's xs
    xs = torch.rand(100, 32, 128) * 2 - 1
    h0 = torch.rand(1, 32, 128) - 0.5
    c0 = torch.rand(1, 32, 128) - 0.5
    with torch.no_grad():
        lstm(xs, (h0, c0))  # warm-up
        runs = []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            for _ in range(a.calls):
                lstm(xs, (h0, c0))
            runs.append((time.perf_counter() - t0) * 1e3 / a.calls)
    ms = statistics.median(runs)
    print(f"torch nn.LSTM T=100 forward: {ms:.3f} ms ({torch.get_num_threads()} threads)")
    print(f"@ control.lstm.step.torch {ms:.6g} ms")


if __name__ == "__main__":
    main()
