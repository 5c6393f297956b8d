#!/usr/bin/python3
# torch_ref.py — the PyTorch side of tests/torch_diff_test.cc: reads the cases
# the test wrote (op, attributes, inputs, cotangents), computes each with
# PyTorch 1.13 (python3-torch) and writes the outputs and the gradients of
# sum(output * cotangent) back. Run as `/usr/bin/python3 torch_ref.py IN OUT`.
#
# Where Kiln deliberately differs from PyTorch (it follows NumPy / TensorFlow),
# the reference is mapped to Kiln's documented semantics here, each with a
# comment naming the difference; include/kiln.h lists the same differences.
#
# File formats (little-endian), shared with torch_diff_test.cc:
#   IN:  "KTD1" u32 ncases, then per case: u16 len + op name, u32 n + i64 ints,
#        u32 n + f64 floats, u32 n + inputs, u32 n + cotangents (one per output,
#        none when no gradient is wanted).
#   tensor: u8 dtype (kiln_dtype), u8 rank, i64 shape[rank], raw elements.
#   OUT: "KTR1" u32 ncases, then per case: u8 ok, u16 len + error text,
#        u32 n + outputs, u32 n + (u8 present, tensor) per input.
import struct
import sys

import numpy as np
import torch

torch.set_num_threads(1)

F32, F64, I32, I64, BOOL, F16, BF16 = range(7)
TORCH_DT = {F32: torch.float32, F64: torch.float64, I32: torch.int32, I64: torch.int64,
            BOOL: torch.bool, F16: torch.float16, BF16: torch.bfloat16}
NP_DT = {F32: np.float32, F64: np.float64, I32: np.int32, I64: np.int64, BOOL: np.uint8,
         F16: np.float16, BF16: np.int16}
KILN_DT = {v: k for k, v in TORCH_DT.items()}


class Reader:
    def __init__(self, data):
        self.d, self.p = data, 0

    def take(self, fmt):
        v = struct.unpack_from("<" + fmt, self.d, self.p)
        self.p += struct.calcsize("<" + fmt)
        return v

    def tensor(self):
        dt, rank = self.take("BB")
        shape = self.take("%dq" % rank) if rank else ()
        n = int(np.prod(shape, dtype=np.int64))
        nb = n * np.dtype(NP_DT[dt]).itemsize
        a = np.frombuffer(self.d, dtype=NP_DT[dt], count=n, offset=self.p).copy()
        self.p += nb
        t = torch.from_numpy(a)
        if dt == BOOL:
            t = t.bool()
        elif dt == BF16:
            t = t.view(torch.bfloat16)
        return t.reshape(shape)


def put_tensor(out, t):
    t = t.detach().contiguous()
    dt = KILN_DT[t.dtype]
    out += struct.pack("<BB", dt, t.dim())
    out += struct.pack("<%dq" % t.dim(), *t.shape)
    if dt == BOOL:
        t = t.to(torch.uint8)
    elif dt == BF16:
        t = t.view(torch.int16)
    out += t.reshape(-1).numpy().tobytes()


def is_float(t):
    return t.dtype in (torch.float32, torch.float64)


# ---- the documented deliberate differences ----

def int_div(a, b):
    # Kiln: integer division truncates toward zero, as C (PyTorch's `/` is true
    # division; NumPy's // floors). INT_MIN / -1 wraps (PyTorch would trap).
    m1 = b == -1
    safe = torch.where(m1, torch.ones_like(b), b)
    return torch.where(m1, torch.neg(a), torch.div(a, safe, rounding_mode="trunc"))


def int_mod(a, b):
    # Kiln: integer mod takes the sign of the dividend (C's %, torch.fmod), not
    # of the divisor (Python, NumPy, torch.remainder). x % -1 is 0.
    m1 = b == -1
    safe = torch.where(m1, torch.ones_like(b), b)
    return torch.where(m1, torch.zeros_like(a), torch.fmod(a, safe))


def int_pow(a, b):
    # Kiln: integer pow with a negative exponent is 0 unless the base is 1 or
    # -1 (PyTorch raises); results wrap as repeated multiplication does.
    a, b = torch.broadcast_tensors(a, b)
    neg = b < 0
    r = torch.pow(a, torch.where(neg, torch.zeros_like(b), b))
    one = torch.ones_like(a)
    odd = (b % 2) != 0
    inv = torch.where(a == 1, one, torch.where(a == -1, torch.where(odd, -one, one), torch.zeros_like(a)))
    return torch.where(neg, inv, r)


def float_to_int(x, dt):
    # Kiln: float -> integer truncates toward zero, NaN gives 0 and values out
    # of range saturate (PyTorch and C leave both undefined: x86 gives INT_MIN).
    info = torch.iinfo(dt)
    x64 = x.double()
    r = torch.trunc(x64)
    r = torch.where(torch.isnan(r), torch.zeros_like(r), r)
    big = r >= float(info.max)
    small = r <= float(info.min)
    r = torch.where(big | small, torch.zeros_like(r), r)
    out = r.to(dt)
    out = torch.where(big, torch.full_like(out, info.max), out)
    return torch.where(small, torch.full_like(out, info.min), out)


def round_once(x, dt):
    # Kiln: f64 -> f16 / bf16 rounds once, to nearest even, as NumPy does.
    # PyTorch converts through f32 and so rounds twice (2049.0000000000005 ->
    # f16 2048; once: 2050). Exact rounding here, element by element.
    import math
    prec, min_exp, maxv = (11, -24, 65504.0) if dt == torch.float16 else (8, -133, 3.3895313892515355e38)
    flat = x.double().reshape(-1).tolist()
    res = []
    for v in flat:
        if v != v or v in (math.inf, -math.inf) or v == 0.0:
            res.append(v)
            continue
        _, e = math.frexp(v)
        q = max(e - prec, min_exp)
        r = math.ldexp(round(math.ldexp(v, -q)), q)  # round() on a float is exact, half to even
        if abs(r) > maxv:
            r = math.copysign(math.inf, v)
        res.append(r)
    # every value is now exact in the target type; the conversion through f32 is exact too
    return torch.tensor(res, dtype=torch.float64).reshape(x.shape).float().to(dt)


def cast(x, dt):
    if x.dtype == dt:
        return x.clone()
    if dt in (torch.int32, torch.int64) and (x.is_floating_point()):
        return float_to_int(x, dt)
    if dt in (torch.float16, torch.bfloat16) and x.dtype == torch.float64:
        return round_once(x, dt)
    return x.to(dt)


def reduce_axes(x, ints):
    keep, has = bool(ints[0]), ints[1]
    axes = list(ints[2:]) if has else list(range(x.dim()))
    return [a % x.dim() for a in axes] if x.dim() else [], keep


def reduce_minmax(x, ints, is_max):
    axes, keep = reduce_axes(x, ints)
    if not axes:
        return x.clone()
    empty = any(x.shape[a] == 0 for a in axes)
    if empty:
        # Kiln: max/min over an empty axis is the identity (-inf / +inf, the
        # integer type's min / max), as a fold from it; PyTorch raises.
        shape = [1 if i in axes else s for i, s in enumerate(x.shape)] if keep else \
            [s for i, s in enumerate(x.shape) if i not in axes]
        if x.is_floating_point():
            v = -float("inf") if is_max else float("inf")
        else:
            info = torch.iinfo(x.dtype)
            v = info.min if is_max else info.max
        return torch.full(shape, v, dtype=x.dtype)
    # PyTorch's amax/amin, like Kiln, share the gradient equally among ties
    f = torch.amax if is_max else torch.amin
    return f(x, dim=axes, keepdim=keep)


def reduce_prod(x, axes, keep):
    for a in sorted(axes, reverse=True):
        x = torch.prod(x, dim=a, keepdim=keep, dtype=x.dtype)
    return x


def gather(p, idx, axis):
    axis %= p.dim()
    flat = idx.reshape(-1).long()
    r = torch.index_select(p, axis, flat)
    return r.reshape(tuple(p.shape[:axis]) + tuple(idx.shape) + tuple(p.shape[axis + 1:]))


def one_hot(idx, depth, dt):
    # Kiln: an out-of-range index gives a row of zeros (as TensorFlow);
    # torch.nn.functional.one_hot raises.
    r = idx.long().unsqueeze(-1) == torch.arange(depth, dtype=torch.int64)
    return cast(r, dt)


def log1p(x):
    # A PyTorch bug, not a Kiln difference: torch 1.13's vectorized f64 log1p
    # returns inf for huge finite x (log1p(DBL_MAX) = inf, not 709.78). Where
    # 1 + x == x, log1p(x) = log(x) exactly enough.
    big = x > (1e300 if x.dtype == torch.float64 else 1e30)
    return torch.where(big, torch.log(torch.where(big, x, torch.ones_like(x))), torch.log1p(x))


def sign(x):
    # Kiln: sign(-0.0) is -0.0 (zeros pass through; NumPy and PyTorch give
    # +0.0) and sign(NaN) is NaN (as NumPy; PyTorch gives 0)
    if not x.is_floating_point():
        return torch.sign(x)
    return torch.where((x == 0) | torch.isnan(x), x.detach(), torch.sign(x))


class KilnPow(torch.autograd.Function):
    # The gradient of a^b with respect to b is a^b log(a) where a > 0 and 0
    # elsewhere in Kiln, as TensorFlow; PyTorch gives NaN for a < 0 and
    # -inf/inf for a == 0 with b < 0. With respect to a both take
    # b a^(b-1), and 0 where b == 0.
    @staticmethod
    def forward(ctx, a, b):
        out = torch.pow(a, b)
        ctx.save_for_backward(a, b, out)
        return out

    @staticmethod
    def backward(ctx, g):
        a, b, out = ctx.saved_tensors
        ga = g * torch.where(b == 0, torch.zeros_like(out), b * torch.pow(a, b - 1))
        pos = a > 0
        loga = torch.where(pos, torch.log(torch.where(pos, a, torch.ones_like(a))), torch.zeros_like(a))
        gb = g * out * loga
        return ga.sum_to_size(a.shape), gb.sum_to_size(b.shape)


class KilnRsqrt(torch.autograd.Function):
    # Kiln's gradient of rsqrt is -out / (2x): at -0 that is -inf, as at +0;
    # PyTorch's -out^3 / 2 gives +inf at -0 (rsqrt(-0) = -inf). Elsewhere
    # PyTorch's own formula.
    @staticmethod
    def forward(ctx, x):
        out = torch.rsqrt(x)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        d = -0.5 * out * out * out
        return g * torch.where(x == 0, torch.full_like(x, -float("inf")), d)


UNARY = {
    "neg": torch.neg, "abs": torch.abs, "sign": lambda x: sign(x), "exp": torch.exp, "log": torch.log,
    "log1p": lambda x: log1p(x), "sqrt": torch.sqrt, "rsqrt": lambda x: KilnRsqrt.apply(x), "square": torch.square,
    "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "floor": torch.floor, "ceil": torch.ceil, "identity": lambda x: x.clone(),
    "stop_gradient": lambda x: x.detach().clone(), "logical_not": torch.logical_not,
}
COMPARE = {
    "equal": torch.eq, "not_equal": torch.ne, "less": torch.lt, "less_equal": torch.le,
    "greater": torch.gt, "greater_equal": torch.ge, "logical_and": torch.logical_and,
    "logical_or": torch.logical_or,
}


class KilnRelu(torch.autograd.Function):
    # The gradient of relu is dy where x > 0: 0 at 0 in both, and 0 at NaN in
    # Kiln (PyTorch passes dy through a NaN).
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.relu(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.where(x > 0, g, torch.zeros_like(g))


def relu(x):
    return KilnRelu.apply(x) if x.requires_grad else torch.relu(x)


class KilnExtremum(torch.autograd.Function):
    # PyTorch 1.13's rule: the winner takes the gradient, equal operands get
    # half each (so does Kiln). Where either operand is NaN, Kiln gives the
    # whole gradient to b (neither a > b nor a == b); PyTorch gives it to both.
    @staticmethod
    def forward(ctx, a, b, is_max):
        ctx.save_for_backward(a, b)
        ctx.is_max = is_max
        return torch.maximum(a, b) if is_max else torch.minimum(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        a_wins = a > b if ctx.is_max else a < b
        b_wins = b > a if ctx.is_max else b < a
        tie = a == b
        nan = torch.isnan(a) | torch.isnan(b)
        z = torch.zeros_like(g)
        ga = torch.where(a_wins, g, torch.where(tie, g / 2, z))
        gb = torch.where(b_wins | nan, g, torch.where(tie, g / 2, z))
        return ga.sum_to_size(a.shape), gb.sum_to_size(b.shape), None


def maximum(a, b, is_max):
    if a.requires_grad or b.requires_grad:
        return KilnExtremum.apply(a, b, is_max)
    return torch.maximum(a, b) if is_max else torch.minimum(a, b)


def compute(op, ints, fls, xs):
    if op in UNARY:
        return [UNARY[op](xs[0])]
    if op == "relu":
        return [relu(xs[0])]
    if op in COMPARE:
        return [COMPARE[op](xs[0], xs[1])]
    if op in ("add", "sub", "mul"):
        return [{"add": torch.add, "sub": torch.sub, "mul": torch.mul}[op](xs[0], xs[1])]
    if op == "div":
        return [torch.div(xs[0], xs[1]) if is_float(xs[0]) else int_div(xs[0], xs[1])]
    if op == "mod":
        # float mod is fmod (the sign of the dividend), as C; NumPy's % and
        # torch.remainder take the divisor's sign
        return [torch.fmod(xs[0], xs[1]) if is_float(xs[0]) else int_mod(xs[0], xs[1])]
    if op == "pow":
        return [KilnPow.apply(xs[0], xs[1]) if is_float(xs[0]) else int_pow(xs[0], xs[1])]
    if op in ("maximum", "minimum"):
        return [maximum(xs[0], xs[1], op == "maximum")]
    if op == "select":
        c, a, b = torch.broadcast_tensors(*xs)
        return [torch.where(c, a, b)]
    if op == "cast":
        return [cast(xs[0], TORCH_DT[ints[0]])]
    if op in ("reduce_sum", "reduce_mean", "reduce_prod"):
        x = xs[0]
        axes, keep = reduce_axes(x, ints)
        if not axes:
            return [x.clone()]
        if op == "reduce_sum":
            return [torch.sum(x, dim=axes, keepdim=keep, dtype=x.dtype)]  # ints: no promotion to i64
        if op == "reduce_mean":
            if not is_float(x):
                # Kiln: the mean of integers stays an integer, truncated toward
                # zero as integer div (PyTorch raises; NumPy returns a float)
                cnt = 1
                for a in axes:
                    cnt *= x.shape[a]
                s = torch.sum(x, dim=axes, keepdim=keep, dtype=x.dtype)
                return [int_div(s, torch.full_like(s, cnt))]
            return [torch.mean(x, dim=axes, keepdim=keep)]
        return [reduce_prod(x, axes, keep)]
    if op in ("reduce_max", "reduce_min"):
        return [reduce_minmax(xs[0], ints, op == "reduce_max")]
    if op == "argmax":
        return [torch.argmax(xs[0], dim=ints[0])]
    if op == "matmul":
        return [torch.matmul(xs[0], xs[1])]
    if op == "reshape":
        return [xs[0].reshape(tuple(ints))]
    if op == "transpose":
        x = xs[0]
        perm = list(ints[1:]) if ints[0] else list(range(x.dim()))[::-1]
        return [x.permute(perm).clone()]
    if op == "broadcast_to":
        return [torch.broadcast_to(xs[0], tuple(ints)).clone()]
    if op == "expand_dims":
        return [xs[0].unsqueeze(ints[0])]
    if op == "squeeze":
        return [xs[0].squeeze(ints[0])]
    if op == "slice":
        x = xs[0]
        r = x.dim()
        idx = tuple(slice(b, x.shape[i] if s == -1 else b + s) for i, (b, s) in
                    enumerate(zip(ints[:r], ints[r:])))
        return [x[idx].clone()]
    if op == "index":
        return [xs[0][ints[0]].clone()]
    if op == "concat":
        return [torch.cat(xs, dim=ints[0])]
    if op == "split":
        return [t.clone() for t in torch.chunk(xs[0], ints[0], dim=ints[1])] if xs[0].shape[ints[1]] else \
            [xs[0].clone() for _ in range(ints[0])]
    if op == "stack":
        return [torch.stack(xs, dim=ints[0])]
    if op == "gather":
        return [gather(xs[0], xs[1], ints[0])]
    if op == "scatter_add":
        axis, shape = ints[0], tuple(ints[1:])
        upd, idx = xs
        axis %= len(shape)
        z = torch.zeros(shape, dtype=upd.dtype)
        flat = idx.reshape(-1).long()
        u = upd.reshape(tuple(shape[:axis]) + (flat.numel(),) + tuple(shape[axis + 1:]))
        return [z.index_add(axis, flat, u)]
    if op == "one_hot":
        return [one_hot(xs[0], ints[0], TORCH_DT[ints[1]])]
    if op == "softmax":
        return [torch.softmax(xs[0], dim=ints[0])]
    if op == "log_softmax":
        return [torch.log_softmax(xs[0], dim=ints[0])]
    if op == "softmax_cross_entropy":
        labels, logits = xs
        return [-(labels * torch.log_softmax(logits, dim=-1)).sum(-1)]
    if op == "sparse_softmax_cross_entropy":
        labels, logits = xs
        c = logits.shape[-1]
        r = torch.nn.functional.cross_entropy(logits.reshape(-1, c), labels.reshape(-1).long(),
                                              reduction="none")
        return [r.reshape(labels.shape)]
    if op == "clip_by_norm":
        t = xs[0]
        m = fls[0]
        # Kiln takes the norm as where(s > 0, sqrt(s), 0) so that the gradient
        # of an all-zero tensor is finite (plain sqrt gives 0 * inf = NaN)
        s = (t * t).sum()
        pos = s > 0
        n = torch.where(pos, torch.sqrt(torch.where(pos, s, torch.ones_like(s))), torch.zeros_like(s))
        return [t * (m / torch.maximum(n, torch.tensor(m, dtype=t.dtype)))]
    if op in ("conv2d", "max_pool2d", "avg_pool2d"):
        # Kiln: NHWC images, HWIO filters, padding (top, bottom, left, right),
        # which may be uneven: padded here with F.pad. Pooling never counts
        # the padding: -inf for max, and average pooling divides by the
        # count of image elements in each window (TensorFlow's rule; PyTorch's
        # count_include_pad=False, here as window sums over window counts).
        fn = torch.nn.functional
        x = xs[0].permute(0, 3, 1, 2).contiguous()  # slow_conv2d's backward wants contiguous tensors
        pt, pb, pl, pr = ints[4:8]
        if op == "conv2d":
            w = xs[1].permute(3, 2, 0, 1).contiguous()
            y = fn.conv2d(fn.pad(x, (pl, pr, pt, pb)), w, stride=tuple(ints[0:2]), dilation=tuple(ints[2:4]),
                          groups=ints[8])
        elif op == "max_pool2d":
            y = fn.max_pool2d(fn.pad(x, (pl, pr, pt, pb), value=-float("inf")), tuple(ints[0:2]),
                              stride=tuple(ints[2:4]))
        else:
            k, st = tuple(ints[0:2]), tuple(ints[2:4])
            total = fn.avg_pool2d(fn.pad(x, (pl, pr, pt, pb)), k, stride=st, divisor_override=1)
            count = fn.avg_pool2d(fn.pad(torch.ones_like(x), (pl, pr, pt, pb)), k, stride=st, divisor_override=1)
            y = total / count
        return [y.permute(0, 2, 3, 1)]
    if op == "batch_norm":
        x, mean, var, offset, scale = xs
        eps = fls[0]
        y = (x - mean) / torch.sqrt(var + eps) * scale + offset
        c = x.shape[-1]
        ref = torch.nn.functional.batch_norm(x.detach().reshape(-1, c), mean.detach(), var.detach(),
                                             scale.detach(), offset.detach(), training=False, eps=eps)
        tol = 1e-4 if x.dtype == torch.float32 else 1e-10
        got = y.detach().reshape(-1, c)
        tame = torch.isfinite(got) & torch.isfinite(ref) & (x.detach().reshape(-1, c).abs() < 1e10)
        if not torch.allclose(got[tame], ref[tame], rtol=tol, atol=tol):  # edge values round apart
            raise ValueError("batch_norm: the formula and F.batch_norm disagree")
        return [y]
    raise ValueError("torch_ref.py: unknown op " + op)


def run_case(op, ints, fls, xs, cts):
    want_grad = len(cts) > 0
    leaves = []
    for x in xs:
        if want_grad and is_float(x):
            x = x.clone().requires_grad_(True)
        leaves.append(x)
    with torch.set_grad_enabled(want_grad):
        ys = compute(op, ints, fls, leaves)
    grads = [None] * len(xs)
    if want_grad:
        terms = [(y * ct).sum() for y, ct in zip(ys, cts) if y.requires_grad]
        srcs = [x for x in leaves if x.requires_grad]
        if terms and srcs:
            total = terms[0]
            for t in terms[1:]:
                total = total + t
            gs = torch.autograd.grad(total, srcs, allow_unused=True)
            k = 0
            for i, x in enumerate(leaves):
                if x.requires_grad:
                    grads[i] = gs[k]
                    k += 1
        for i, x in enumerate(leaves):  # no dependence: zeros (Kiln may give NULL)
            if grads[i] is None and is_float(x):
                grads[i] = torch.zeros_like(x)
    return ys, grads


def main():
    data = open(sys.argv[1], "rb").read()
    r = Reader(data)
    assert r.take("4s")[0] == b"KTD1", "torch_ref.py: not a case file"
    (n,) = r.take("I")
    out = bytearray(b"KTR1" + struct.pack("<I", n))
    for _ in range(n):
        (ln,) = r.take("H")
        op = r.take("%ds" % ln)[0].decode()
        (ni,) = r.take("I")
        ints = list(r.take("%dq" % ni)) if ni else []
        (nf,) = r.take("I")
        fls = list(r.take("%dd" % nf)) if nf else []
        (nx,) = r.take("I")
        xs = [r.tensor() for _ in range(nx)]
        (nc,) = r.take("I")
        cts = [r.tensor() for _ in range(nc)]
        try:
            ys, grads = run_case(op, ints, fls, xs, cts)
            out += struct.pack("<BH", 1, 0)
            out += struct.pack("<I", len(ys))
            for y in ys:
                put_tensor(out, y)
            out += struct.pack("<I", len(grads))
            for g in grads:
                out += struct.pack("<B", g is not None)
                if g is not None:
                    put_tensor(out, g)
        except Exception as e:  # reported by the test with the case
            msg = ("%s: %s" % (type(e).__name__, e)).encode()[:2000]
            out += struct.pack("<BH", 0, len(msg)) + msg
            out += struct.pack("<II", 0, 0)
    with open(sys.argv[2], "wb") as f:
        f.write(out)


if __name__ == "__main__":
    main()
