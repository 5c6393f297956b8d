#!/usr/bin/env python3
"""l2hmc_torch.py: PyTorch eager's peer of bench/bench_l2hmc.c: an L2HMC-like
sampler step (10 leapfrog steps, batch 200, energy U(x) = 0.5*|y|^2 with
y = tanh(x W1 + b1) W2 + b2 a 2-10-2 MLP, dU/dx by torch.autograd.grad in each
half step), ms per sample step, median of --runs runs of --steps steps.
--init FILE starts from `bench_l2hmc --dump FILE`'s numbers, so the checksum
matches Kiln's. Prints "@ l2hmc.torch MS ms"."""
import argparse
import statistics
import sys
import time

BATCH, DIM, HID, LEAPFROGS = 200, 2, 10, 10


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (Kiln's count)")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--init", help="W1 b1 W2 b2 x p written by bench_l2hmc --dump")
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"l2hmc_torch: PyTorch is not importable by {sys.executable} ({e}); no peer")
        return 0
    torch.set_num_threads(args.threads)
    shapes = [(DIM, HID), (HID,), (HID, DIM), (DIM,), (BATCH, DIM), (BATCH, DIM)]
    if args.init:
        with open(args.init, "rb") as f:
            raw = bytearray(f.read())
        vals, off = [], 0
        for s in shapes:
            n = 1
            for d in s:
                n *= d
            vals.append(torch.frombuffer(raw, dtype=torch.float32, count=n, offset=off).reshape(s).clone())
            off += 4 * n
        if off != len(raw):
            ap.error(f"{args.init}: {len(raw)} bytes, expected {off}")
    else:
        torch.manual_seed(5)
        vals = [torch.randn(s) * k for s, k in zip(shapes, (0.5, 0.1, 0.5, 0.1, 1, 1))]
    w1, b1, w2, b2, x0, p0 = vals

    def grad_energy(x):
        x = x.detach().requires_grad_()
        y = torch.tanh(x @ w1 + b1) @ w2 + b2
        u = (y * y).sum() * 0.5
        (g,) = torch.autograd.grad(u, x)
        return g

    def sample_step(x, p):
        for _ in range(LEAPFROGS):
            p = p - 0.05 * grad_energy(x)
            x = x + 0.1 * p
            p = p - 0.05 * grad_energy(x)
        return x, p

    x, p = sample_step(x0, p0)
    check = x.sum().item() + 2 * p.sum().item()
    for _ in range(args.steps):  # warm-up
        sample_step(x0, p0)
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            sample_step(x0, p0)
        times.append((time.perf_counter() - t0) / args.steps)
    ms = statistics.median_low(times) * 1e3
    print(f"l2hmc sample step ({LEAPFROGS} leapfrogs, batch {BATCH}): torch eager {ms:.4f} ms "
          f"(median of {args.runs} runs x {args.steps} steps; min {min(times) * 1e3:.4f})  check {check:.6f}"
          f"  [{torch.get_num_threads()} thread(s), torch {torch.__version__}]")
    print(f"@ l2hmc.torch {ms:.6g} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
