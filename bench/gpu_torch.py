#!/usr/bin/env python3
"""gpu_torch.py: PyTorch-on-CUDA's peer of bench/bench_gpu.c, on cuda:0:
  fused  tanh(x*a+b)*c+x over 256M f32, eager (five kernels), in GB/s of the
         bytes the expression must move, beside a device-to-device copy;
  sgemm  4096 x 4096 f32 (TF32 off, as Kiln's default), GFLOP/s;
  seed   x = x @ m 200 times, 1000 x 1000 f32, total seconds;
  mlp    one training step of an MLP 784-256-256-10 (relu, cross-entropy,
         SGD lr 0.01), batch 64, ms/step.
Each time is the median of --runs runs after a warm-up, each run ending with
torch.cuda.synchronize(). Prints "@ gpu.KEY.torch VALUE UNIT" lines for
scripts/bench_issue7.sh; without PyTorch or CUDA it says so and exits 0."""
import argparse
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer runs")
    ap.add_argument("--only", choices=["fused", "sgemm", "seed", "mlp"])
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"gpu_torch: PyTorch is not importable by {sys.executable} ({e}): no peer, skipped")
        return 0
    if not torch.cuda.is_available():
        print(f"gpu_torch: no GPU: skipped (torch {torch.__version__} sees no CUDA device)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda:0")
    runs = 3 if args.quick else args.runs
    n_fused = (32 if args.quick else 256) << 20
    seed_iters = 50 if args.quick else 200
    mlp_steps = 10 if args.quick else 50
    print(f"cuda:0 is {torch.cuda.get_device_name(0)}; torch {torch.__version__}")

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median_low(times)

    def fig(key, value, unit):
        print(f"@ {key} {value:.6g} {unit}", flush=True)

    if args.only in (None, "fused"):
        x = (torch.arange(n_fused, device=dev, dtype=torch.float32) % 1000) * 0.002 - 1
        a, b, c = (torch.tensor(v, device=dev, dtype=torch.float32) for v in (0.5, 0.25, 2.0))
        dst = torch.empty_like(x)
        copy = timed(lambda: dst.copy_(x))
        eager = timed(lambda: torch.tanh(x * a + b) * c + x)
        gb = 2.0 * n_fused * 4 / 1e9
        print(f"fused tanh(x*a+b)*c+x, {n_fused >> 20} M f32: copy {gb / copy:.0f} GB/s | "
              f"torch eager {gb / eager:.0f} GB/s = {100 * copy / eager:.0f}% of copy")
        fig("gpu.fused.copy.torch", gb / copy, "GB/s")
        fig("gpu.fused.torch", gb / eager, "GB/s")
        del x, dst

    if args.only in (None, "sgemm"):
        n = 4096
        torch.manual_seed(7)
        a = torch.randn(n, n, device=dev)
        b = torch.randn(n, n, device=dev)
        t = timed(lambda: a @ b)
        print(f"sgemm {n} f32: torch {2.0 * n ** 3 / t / 1e9:.0f} GFLOP/s")
        fig("gpu.sgemm4096.torch", 2.0 * n ** 3 / t / 1e9, "GFLOP/s")

    if args.only in (None, "seed"):
        n = 1000
        torch.manual_seed(11)
        m = torch.randn(n, n, device=dev) / n ** 0.5
        x0 = torch.randn(n, n, device=dev)

        def chain():
            x = x0
            for _ in range(seed_iters):
                x = x @ m
            return x

        t = timed(chain)
        print(f"seed chain: x = x @ m {seed_iters} times, {n} x {n} f32: torch {t:.3f} s "
              f"({t / seed_iters * 1e3:.2f} ms per matmul)")
        fig("gpu.seed.chain.torch", t, "s")

    if args.only in (None, "mlp"):
        from mlp_torch import IN, OUT, SHAPES, sgd_step  # the same step as the CPU peer's

        torch.manual_seed(42)
        params = [(torch.randn(s, device=dev) * 0.05).requires_grad_() for s in SHAPES]
        x = torch.randn(64, IN, device=dev)
        y = torch.randint(0, OUT, (64,), device=dev)
        opt = torch.optim.SGD(params, lr=0.01)

        def steps():
            for _ in range(mlp_steps):
                sgd_step(params, x, y, opt)

        t = timed(steps) / mlp_steps
        print(f"mlp 784-256-256-10, batch 64: torch {t * 1e3:.3f} ms/step")
        fig("gpu.mlp.b64.torch", t * 1e3, "ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
