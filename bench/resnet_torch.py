#!/usr/bin/env python3
"""resnet_torch.py — PyTorch's peer of bench_resnet: torchvision's resnet50
(oneDNN on the CPU), synthetic 224x224 images, the same batch.

Bench mode (bench_resnet runs it): images/s of a training step (forward,
cross-entropy, backward, SGD with momentum 0.9) in train mode and of
inference (eval mode, torch.no_grad), each in the default NCHW layout and in
channels_last; medians of --runs steps after --warmup ones. Prints
"@ resnet.bB.MODE.torch[-cl] VALUE img/s" lines and the parameter count.

Check mode (--check DIR; bench_resnet --check and tests/resnet_test.cc run
it): builds the small network that bench/resnet_model.h's resnet_check
describes in DIR/config.txt from torchvision's own Bottleneck blocks, loads
Kiln's initial weights (DIR/init.NAME.npy, HWIO filters and [in, out] dense
weights, transposed here to OIHW and [out, in]) and input (NHWC), in f64,
and writes what Kiln compares against: torch.logits.npy (eval mode),
torch.loss.npy and torch.grad.NAME.npy (train mode), then, from the same
weights, torch.stepS.loss.npy of each SGD-momentum step and
torch.final.NAME.npy of every state_dict entry after them (back in Kiln's
layouts)."""
import argparse
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torchvision.models.resnet import Bottleneck


class Net(nn.Module):
    """torchvision's ResNet with any number of stages (0 blocks ends them)."""

    def __init__(self, blocks, width, classes):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes = width
        self.stages = []
        for s, n in enumerate(blocks):
            if n == 0:
                break
            planes, stride = width << s, 1 if s == 0 else 2
            layers = []
            for b in range(n):
                down = None
                if b == 0 and (stride != 1 or inplanes != 4 * planes):
                    down = nn.Sequential(nn.Conv2d(inplanes, 4 * planes, 1, stride, bias=False),
                                         nn.BatchNorm2d(4 * planes))
                layers.append(Bottleneck(inplanes, planes, stride if b == 0 else 1, down))
                inplanes = 4 * planes
            name = f"layer{s + 1}"
            setattr(self, name, nn.Sequential(*layers))
            self.stages.append(name)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for name in self.stages:
            x = getattr(self, name)(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def to_torch(name, a):
    """Kiln's layout -> PyTorch's"""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if t.dim() == 4:  # HWIO -> OIHW
        return t.permute(3, 2, 0, 1).contiguous()
    if name == "fc.weight":
        return t.t().contiguous()
    return t


def to_kiln(name, t):
    t = t.detach()
    if t.dim() == 4:  # OIHW -> HWIO
        t = t.permute(2, 3, 1, 0)
    elif name == "fc.weight":
        t = t.t()
    return np.ascontiguousarray(t.numpy())


def check(d):
    with open(os.path.join(d, "config.txt")) as f:
        v = f.read().split()
    blocks, width, classes = [int(s) for s in v[:4]], int(v[4]), int(v[5])
    steps, lr = int(v[7]), float(v[8])
    torch.manual_seed(0)
    net = Net(blocks, width, classes).double()
    sd = net.state_dict()
    init = {}
    for name in sd:
        if name.endswith("num_batches_tracked"):
            continue
        init[name] = to_torch(name, np.load(os.path.join(d, f"init.{name}.npy")))
        if init[name].shape != sd[name].shape:
            sys.exit(f"resnet_torch.py: {name} has shape {tuple(init[name].shape)}, PyTorch's {tuple(sd[name].shape)}")
    missing = [n for n in sorted(os.listdir(d)) if n.startswith("init.") and n[5:-4] not in init]
    if missing:
        sys.exit(f"resnet_torch.py: Kiln has variables PyTorch's model lacks: {missing}")
    x = torch.from_numpy(np.load(os.path.join(d, "x.npy"))).permute(0, 3, 1, 2).contiguous()
    labels = torch.from_numpy(np.load(os.path.join(d, "labels.npy")))
    net.load_state_dict(init, strict=False)
    net.eval()
    with torch.no_grad():
        np.save(os.path.join(d, "torch.logits.npy"), net(x).numpy())
    net.train()
    loss = F.cross_entropy(net(x), labels)
    loss.backward()
    np.save(os.path.join(d, "torch.loss.npy"), loss.detach().numpy())
    for name, p in net.named_parameters():
        np.save(os.path.join(d, f"torch.grad.{name}.npy"), to_kiln(name, p.grad))
    net.zero_grad(set_to_none=True)
    net.load_state_dict(init, strict=False)  # the forward above moved the running statistics
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    for s in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(net(x), labels)
        loss.backward()
        opt.step()
        np.save(os.path.join(d, f"torch.step{s}.loss.npy"), loss.detach().numpy())
    for name, t in net.state_dict().items():
        if not name.endswith("num_batches_tracked"):
            np.save(os.path.join(d, f"torch.final.{name}.npy"), to_kiln(name, t))


def bench(a):
    torch.manual_seed(3)
    net = torchvision.models.resnet50()
    params = sum(p.numel() for p in net.parameters())
    print(f"torch resnet50: {params} parameters, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"torchvision {torchvision.__version__}")
    print(f"@ resnet.params.torch {params} parameters")
    x0 = torch.randn(a.batch, 3, 224, 224)
    labels = torch.randint(0, 1000, (a.batch,))
    # bench_resnet runs this twice: as is, and with glibc's malloc told to
    # keep freed memory (MALLOC_MMAP_THRESHOLD_ etc.): PyTorch's activations
    # are mmap'd and unmapped every layer otherwise, and on some virtual
    # machines the page faults take half its time. The "-mk" keys are the
    # latter.
    keep = "-mk" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else ""
    for suffix, fmt in (("", torch.contiguous_format), ("-cl", torch.channels_last)):
        layout = ("channels_last" if suffix else "NCHW") + (" malloc-keep" if keep else "")
        suffix += keep
        m = torchvision.models.resnet50().to(memory_format=fmt)
        x = x0.to(memory_format=fmt)
        for mode in a.modes.split(","):
            ts = []
            if mode == "train":
                m.train()
                opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
                for r in range(a.warmup + a.runs):
                    t0 = time.perf_counter()
                    opt.zero_grad()
                    F.cross_entropy(m(x), labels).backward()
                    opt.step()
                    t = time.perf_counter() - t0
                    if r >= a.warmup:
                        ts.append(t)
            elif mode == "infer":
                m.eval()
                with torch.no_grad():
                    for r in range(a.warmup + a.runs):
                        t0 = time.perf_counter()
                        m(x)
                        t = time.perf_counter() - t0
                        if r >= a.warmup:
                            ts.append(t)
            else:
                sys.exit(f"resnet_torch.py: unknown mode {mode}")
            ips = a.batch / statistics.median(ts)
            print(f"torch resnet50 {mode:<5} {layout:<25} batch {a.batch}: {ips:7.2f} img/s "
                  f"(median of {a.runs}, {statistics.median(ts) * 1e3:.0f} ms per step)", flush=True)
            print(f"@ resnet.b{a.batch}.{mode}.torch{suffix} {ips:.6g} img/s", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"torch resnet50 peak RSS {rss:.1f} GB")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", metavar="DIR")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--modes", default="train,infer")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.check:
        check(a.check)
    else:
        bench(a)


if __name__ == "__main__":
    main()
