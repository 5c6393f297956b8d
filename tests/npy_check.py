#!/usr/bin/env python3
"""npy_check.py — NumPy's side of tests/npy_test.cc.

  npy_check.py write DIR   np.save's files (every dtype Kiln loads, both byte
                           orders, C and Fortran order, format 1.0 and 2.0)
                           as DIR/<name>.npy, with DIR/<name>.raw holding the
                           elements Kiln must load (its dtype, little-endian,
                           row-major) and DIR/manifest.txt "name dtype dims".
  npy_check.py read DIR    np.load's every DIR/<name>.npy that Kiln wrote and
                           checks dtype, shape and bytes against <name>.raw
                           and the manifest; prints "checked N files".
"""
import os
import sys

import numpy as np

KILN = {"f32": "<f4", "f64": "<f8", "i32": "<i4", "i64": "<i8", "bool": "|b1", "f16": "<f2"}
# what Kiln loads each NumPy dtype as
LOADS_AS = {"f4": "f32", "f8": "f64", "f2": "f16", "i4": "i32", "i8": "i64", "b1": "bool",
            "i1": "i32", "u1": "i32", "i2": "i32", "u2": "i32", "u4": "i64", "u8": "i64"}


def values(rng, code, shape):
    n = int(np.prod(shape)) if shape else 1
    if code == "b1":
        a = rng.integers(0, 2, n).astype(bool)
    elif code[0] == "f":
        a = rng.standard_normal(n) * 100
        a[: min(n, 3)] = [np.nan, np.inf, -0.0][: min(n, 3)]
        a = a.astype("f" + code[1])
    else:
        info = np.iinfo(code)
        top = min(int(info.max), 2**63 - 1)  # Kiln refuses larger u8 values
        a = rng.integers(info.min, top, n, dtype=code, endpoint=True)
    return a.reshape(shape)


def write(d):
    rng = np.random.default_rng(5)
    lines = []
    k = 0
    for code in LOADS_AS:
        for shape in [(), (0,), (6,), (3, 4), (2, 3, 4), (4, 0, 2)]:
            for order in "<>":
                for fortran in (False, True):
                    if code in ("b1", "i1", "u1") and order == ">":
                        continue  # one byte: no byte order
                    a = values(rng, code, shape)
                    stored = a.astype(a.dtype.newbyteorder(order)) if a.dtype.itemsize > 1 else a
                    if fortran:
                        stored = np.asfortranarray(stored)  # a 0-d array becomes 1-d
                        a = a.reshape(stored.shape)
                    name = "n%d" % k
                    k += 1
                    with open(os.path.join(d, name + ".npy"), "wb") as f:
                        version = (2, 0) if k % 5 == 0 else None
                        np.lib.format.write_array(f, stored, version=version, allow_pickle=False)
                    kiln = LOADS_AS[code]
                    expect = np.ascontiguousarray(a.astype(KILN[kiln]))
                    with open(os.path.join(d, name + ".raw"), "wb") as f:
                        f.write(expect.tobytes())
                    dims = ",".join(str(x) for x in a.shape) or "-"
                    lines.append("%s %s %s\n" % (name, kiln, dims))
    with open(os.path.join(d, "manifest.txt"), "w") as f:
        f.writelines(lines)
    print("wrote %d files" % k)


def read(d):
    n = 0
    with open(os.path.join(d, "manifest.txt")) as f:
        for line in f:
            name, kiln, dims = line.split()
            shape = () if dims == "-" else tuple(int(x) for x in dims.split(","))
            path = os.path.join(d, name + ".npy")
            with open(path, "rb") as g:
                major, minor = np.lib.format.read_magic(g)
                hshape, fortran, dtype = np.lib.format._read_array_header(g, (major, minor))
                if g.tell() % 64:
                    sys.exit("%s: the data starts at %d, not 64-aligned" % (name, g.tell()))
            a = np.load(path, allow_pickle=False)
            raw = open(os.path.join(d, name + ".raw"), "rb").read()
            if (major, minor) != (1, 0) or fortran:
                sys.exit("%s: version %d.%d, fortran_order %s" % (name, major, minor, fortran))
            if a.dtype != np.dtype(KILN[kiln]) or a.shape != shape:
                sys.exit("%s: %s %s, want %s %s" % (name, a.dtype, a.shape, KILN[kiln], shape))
            if a.tobytes() != raw:
                sys.exit("%s: the elements differ" % name)
            n += 1
    print("checked %d files" % n)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "read"):
        sys.exit(__doc__)
    (write if sys.argv[1] == "write" else read)(sys.argv[2])
