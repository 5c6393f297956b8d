#!/usr/bin/env python3
"""conv_torch.py — PyTorch's peer of bench_conv: F.conv2d (oneDNN) on the
same two ResNet-50 layers (batch 8, 56x56: 3x3 64->64 padding 1, 1x1
256->64), NCHW and channels_last, under torch.no_grad(); GFLOP/s, median of
--runs calls. Prints "@ conv.LAYER.torch[-cl] GFLOPS GFLOP/s"."""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(3)
    for name, c, o, k in (("3x3_64_64", 64, 64, 3), ("1x1_256_64", 256, 64, 1)):
        flops = 2.0 * a.batch * 56 * 56 * o * k * k * c
        for suffix, fmt in (("", torch.contiguous_format), ("-cl", torch.channels_last)):
            x = torch.randn(a.batch, c, 56, 56).to(memory_format=fmt)
            w = torch.randn(o, c, k, k).to(memory_format=fmt)
            with torch.no_grad():
                F.conv2d(x, w, padding=k // 2)  # warm-up
                ts = []
                for _ in range(a.runs):
                    t0 = time.perf_counter()
                    F.conv2d(x, w, padding=k // 2)
                    ts.append(time.perf_counter() - t0)
            g = flops / statistics.median(ts) * 1e-9
            print(f"torch conv {name:<16} {'channels_last' if suffix else 'NCHW':<13} {g:8.1f} GFLOP/s "
                  f"({torch.get_num_threads()} threads)")
            print(f"@ conv.{name}.torch{suffix} {g:.6g} GFLOP/s")


if __name__ == "__main__":
    main()
