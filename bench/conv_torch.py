#!/usr/bin/env python3
"""conv_torch.py — PyTorch's peer of bench_conv: F.conv2d (oneDNN) on the
same four ResNet-50 layers (batch 8: 3x3 64->64 56x56, 1x1 256->64 56x56,
3x3 128->128 56x56 stride 2, the 7x7 stride-2 3->64 stem on 224x224;
padding k // 2), NCHW and channels_last: the forward pass under
torch.no_grad(), and the input and filter gradients each alone
(aten.convolution_backward with one output_mask entry, what autograd
calls). GFLOP/s, median of --runs calls. Prints "@ conv.LAYER.IMPL GFLOPS
GFLOP/s" with IMPL torch, torch-dx, torch-dw (NCHW) and the same with -cl
(channels_last)."""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

LAYERS = (("3x3_64_64", 64, 64, 3, 1, 56), ("1x1_256_64", 256, 64, 1, 1, 56),
          ("3x3s2_128_128", 128, 128, 3, 2, 56), ("7x7s2_3_64", 3, 64, 7, 2, 224))


def median_time(fn, runs):
    fn()  # warm-up
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    # as many threads as Kiln's pool (one per online CPU): torch 1.13 picks 1 here
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(3)
    for name, c, o, k, s, hw in LAYERS:
        if a.only and a.only != name:
            continue
        p = k // 2
        oh = (hw + 2 * p - k) // s + 1
        flops = 2.0 * a.batch * oh * oh * o * k * k * c
        for suffix, fmt in (("", torch.contiguous_format), ("-cl", torch.channels_last)):
            x = torch.randn(a.batch, c, hw, hw).to(memory_format=fmt)
            w = torch.randn(o, c, k, k).to(memory_format=fmt)
            dy = torch.randn(a.batch, o, oh, oh).to(memory_format=fmt)

            def fwd():
                F.conv2d(x, w, stride=s, padding=p)

            def grad(mask):
                return lambda: torch.ops.aten.convolution_backward(dy, x, w, None, [s, s], [p, p], [1, 1], False,
                                                                   [0, 0], 1, mask)

            layout = "channels_last" if suffix else "NCHW"
            with torch.no_grad():
                for impl, fn in (("", fwd), ("-dx", grad([True, False, False])), ("-dw", grad([False, True, False]))):
                    g = flops / median_time(fn, a.runs) * 1e-9
                    print(f"torch conv {name:<16} {layout:<13} {impl[1:] or 'fwd':<3} {g:8.1f} GFLOP/s "
                          f"({torch.get_num_threads()} threads)")
                    print(f"@ conv.{name}.torch{impl}{suffix} {g:.6g} GFLOP/s")


if __name__ == "__main__":
    main()
