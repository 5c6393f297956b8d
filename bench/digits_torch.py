#!/usr/bin/env python3
"""digits_torch.py — PyTorch's peer of bench_digits: the digits convnet's
training step (examples/digits_model.h: conv 3x3 1->32 SAME, relu, max pool
2x2, conv 3x3 32->64, relu, max pool 2x2, dense 256->10, cross-entropy, Adam
lr 0.01 eps 1e-7) on the first B images of examples/data/, NCHW (PyTorch's
default) and channels_last; ms per step, median of --runs runs of --steps
steps after a warm-up. Prints "@ digits.bB.torch[-cl] MS ms/step"."""
import argparse
import os
import statistics
import sys
import time


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default=os.path.join(here, "..", "examples", "data"))
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default: 20 at batch 64, 10 at 256)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (Kiln's count)")
    a = ap.parse_args()
    try:
        import numpy as np
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"digits_torch: PyTorch or NumPy is not importable by {sys.executable} ({e}); no peer")
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    images = np.load(os.path.join(a.data, "digits_train_images.npy"))  # uint8 [n, 8, 8, 1]
    labels = np.load(os.path.join(a.data, "digits_train_labels.npy"))
    x_all = torch.from_numpy(images.astype(np.float32) / 16.0).permute(0, 3, 1, 2).contiguous()  # NCHW
    y_all = torch.from_numpy(labels.astype(np.int64))

    for batch in (int(b) for b in a.batches.split(",")):
        steps = a.steps or (20 if batch <= 64 else 10)
        for suffix, fmt in (("", torch.contiguous_format), ("-cl", torch.channels_last)):
            torch.manual_seed(42)
            w1 = (torch.randn(32, 1, 3, 3) * (2 / 9) ** 0.5).to(memory_format=fmt).requires_grad_()
            b1 = torch.zeros(32, requires_grad=True)
            w2 = (torch.randn(64, 32, 3, 3) * (2 / 288) ** 0.5).to(memory_format=fmt).requires_grad_()
            b2 = torch.zeros(64, requires_grad=True)
            w3 = (torch.randn(256, 10) * (2 / 256) ** 0.5).requires_grad_()
            b3 = torch.zeros(10, requires_grad=True)
            params = [w1, b1, w2, b2, w3, b3]
            opt = torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.999), eps=1e-7)
            x = x_all[:batch].contiguous(memory_format=fmt)
            y = y_all[:batch].contiguous()

            def step():
                opt.zero_grad(set_to_none=True)
                h = F.max_pool2d(F.relu(F.conv2d(x, w1, b1, padding=1)), 2)
                h = F.max_pool2d(F.relu(F.conv2d(h, w2, b2, padding=1)), 2)
                # flatten in NHWC order, as Kiln's reshape of [n, 2, 2, 64] does
                logits = h.permute(0, 2, 3, 1).reshape(-1, 256) @ w3 + b3
                loss = F.cross_entropy(logits, y)
                loss.backward()
                opt.step()
                return loss

            loss0 = step().item()
            ts = []
            for _ in range(a.runs):
                t0 = time.perf_counter()
                for _ in range(steps):
                    loss = step()
                ts.append((time.perf_counter() - t0) / steps * 1e3)
            ms = statistics.median(ts)
            name = "torch" + suffix
            print(f"digits cnn batch {batch:3d}  {name:<8} {ms:8.3f} ms/step  (median of {a.runs} runs x {steps} "
                  f"steps; min {min(ts):.3f} max {max(ts):.3f})  loss {loss0:.4f} -> {loss.item():.4f}  "
                  f"[{torch.get_num_threads()} thread(s), {'channels_last' if suffix else 'NCHW'}]")
            print(f"@ digits.b{batch}.{name} {ms:.6g} ms/step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
