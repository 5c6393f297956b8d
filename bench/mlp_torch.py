#!/usr/bin/env python3
"""mlp_torch.py: PyTorch eager's peer of bench/bench_mlp.c: one training step of
an MLP 784-256-256-10 (relu, softmax cross-entropy on integer labels, SGD lr
0.01) in ms per step, printed in bench_mlp's format, and as an
"@ mlp.bB.torch MS ms/step" line for scripts/bench_issue6.sh. --init FILE starts from
the numbers `bench_mlp --dump FILE` wrote, so the two losses can be compared."""
import argparse
import statistics
import sys
import time

IN, HID, OUT = 784, 256, 10
SHAPES = [(IN, HID), (HID,), (HID, HID), (HID,), (HID, OUT), (OUT,)]


def sgd_step(params, x, y, opt):
    """One training step of the MLP (params: w1, b1, w2, b2, w3, b3, with
    gradients; opt: their SGD); the loss before the update. gpu_torch.py runs
    it too."""
    import torch.nn.functional as F
    w1, b1, w2, b2, w3, b3 = params
    opt.zero_grad(set_to_none=True)
    h = F.relu(x @ w1 + b1)
    h = F.relu(h @ w2 + b2)
    loss = F.cross_entropy(h @ w3 + b3, y)
    loss.backward()
    opt.step()
    return loss


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (Kiln's count)")
    ap.add_argument("--steps", type=int, default=0,
                    help="timed steps per run (default: 50 at batch 64, 200 at batch 1)")
    ap.add_argument("--runs", type=int, default=9, help="timed runs, median reported")
    ap.add_argument("--batch", type=int, default=0, help="only this batch size (default: 64 then 1)")
    ap.add_argument("--train", type=int, default=300, help="the loss is printed at step N")
    ap.add_argument("--init", help="initial values written by bench_mlp --dump")
    args = ap.parse_args()
    if args.runs < 1 or args.steps < 0 or not 0 <= args.batch <= 64 or args.train < 1:
        ap.error("bad --runs, --steps, --batch or --train")

    try:
        import torch
    except ImportError as e:
        print(f"mlp_torch: PyTorch is not importable by {sys.executable} ({e}); no peer")
        return 0

    torch.set_num_threads(args.threads)
    torch.manual_seed(42)
    shapes = SHAPES
    if args.init:
        with open(args.init, "rb") as f:
            raw = bytearray(f.read())
        init, off = [], 0
        for s in shapes + [(64, IN)]:
            n = 1
            for d in s:
                n *= d
            init.append(torch.frombuffer(raw, dtype=torch.float32, count=n, offset=off).reshape(s).clone())
            off += 4 * n
        x64 = init.pop()
        y64 = torch.frombuffer(raw, dtype=torch.int64, count=64, offset=off).clone()
        if off + 8 * 64 != len(raw):
            ap.error(f"{args.init}: {len(raw)} bytes, expected {off + 8 * 64}")
    else:
        init = [torch.randn(s) * 0.05 for s in shapes]
        x64 = torch.randn(64, IN)
        y64 = torch.randint(0, OUT, (64,))

    def bench(batch, steps):
        params = [p.clone().requires_grad_() for p in init]
        x, y = x64[:batch].contiguous(), y64[:batch].contiguous()
        opt = torch.optim.SGD(params, lr=0.01)

        def step():
            return sgd_step(params, x, y, opt)

        loss0 = step().item()  # before any update, as bench_mlp
        done = 1
        for _ in range(steps):  # warm-up
            step()
            done += 1
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times.append((time.perf_counter() - t0) / steps)
            done += steps
        while done < args.train - 1:
            step()
            done += 1
        loss = step().item()
        done += 1
        times.sort()
        print(f"mlp 784-256-256-10 batch {batch:2d}  torch  {statistics.median_low(times) * 1e3:8.4f} ms/step"
              f"  (median of {args.runs} runs x {steps} steps; min {times[0] * 1e3:.4f}"
              f" max {times[-1] * 1e3:.4f})  loss {loss0:.6f} -> {loss:.6f} at step {done - 1}"
              f"  [{torch.get_num_threads()} thread(s), torch {torch.__version__}]")
        print(f"@ mlp.b{batch}.torch {statistics.median_low(times) * 1e3:.6g} ms/step", flush=True)

    if args.batch in (0, 64):
        bench(64, args.steps or 50)
    if args.batch in (0, 1):
        bench(1, args.steps or 200)
    if args.batch not in (0, 1, 64):
        bench(args.batch, args.steps or 50)
    return 0


if __name__ == "__main__":
    sys.exit(main())
