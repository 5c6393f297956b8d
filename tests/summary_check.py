#!/usr/bin/env python3
"""summary_check.py — TensorBoard's side of tests/summary_test.cc.

  summary_check.py PROTO_OUT EVENTS EXPECT T0 T1

Reads the event file EVENTS as TensorBoard does: TFRecords (length, masked
CRC-32C of the length, data, masked CRC-32C of the data; every CRC checked
here with an implementation of its own), each an Event parsed by protobuf
from tests/tensorboard_proto/*.proto (compiled by protoc into PROTO_OUT,
which must be on no other path). The first Event must be file_version
"brain.Event:2"; then one Event per line of EXPECT, in order:
  scalar <tag hex> <step> <value>
  histo <tag hex> <step> <v1,v2,...>   (values as %.17g)
with a wall_time in [T0, T1]. A histogram is checked against TensorFlow's
Histogram (tsl/lib/histogram), reimplemented below. Prints "ok N events".
"""
import bisect
import struct
import sys

sys.path.insert(0, sys.argv[1])
import event_pb2  # noqa: E402

DBL_MAX = sys.float_info.max


def crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


TABLE = crc32c_table()


def masked_crc(data):
    c = 0xFFFFFFFF
    for b in data:
        c = TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    c ^= 0xFFFFFFFF
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path):
    data = open(path, "rb").read()
    off = 0
    while off < len(data):
        if off + 12 > len(data):
            sys.exit("record at %d: truncated header" % off)
        (n,) = struct.unpack_from("<Q", data, off)
        (crc,) = struct.unpack_from("<I", data, off + 8)
        if crc != masked_crc(data[off:off + 8]):
            sys.exit("record at %d: bad length CRC" % off)
        body = data[off + 12:off + 12 + n]
        if len(body) != n or off + 16 + n > len(data):
            sys.exit("record at %d: truncated" % off)
        (crc,) = struct.unpack_from("<I", data, off + 12 + n)
        if crc != masked_crc(body):
            sys.exit("record at %d: bad data CRC" % off)
        yield body
        off += 16 + n


def default_edges():
    pos, v = [], 1.0e-12
    while v < 1.0e20:
        pos.append(v)
        v *= 1.1
    pos.append(DBL_MAX)
    return [-x for x in reversed(pos)] + [0.0] + pos


EDGES = default_edges()


def tf_histogram(values):
    counts = [0.0] * len(EDGES)
    for v in values:
        counts[min(bisect.bisect_right(EDGES, v), len(EDGES) - 1)] += 1
    limits, buckets, i = [], [], 0
    while i < len(EDGES):  # runs of empty buckets merged, as EncodeToProto does
        end, c = EDGES[i], counts[i]
        i += 1
        if c <= 0:
            while i < len(EDGES) and counts[i] <= 0:
                end, c = EDGES[i], counts[i]
                i += 1
        limits.append(end)
        buckets.append(c)
    return limits, buckets


def close(a, b):
    return a == b or abs(a - b) <= 1e-12 * max(abs(a), abs(b))


def main():
    _, _, events, expect, t0, t1 = sys.argv
    t0, t1 = float(t0), float(t1)
    recs = list(records(events))
    lines = [l.split() for l in open(expect) if l.strip()]
    if len(recs) != len(lines) + 1:
        sys.exit("%d records, want %d" % (len(recs), len(lines) + 1))
    first = event_pb2.Event.FromString(recs[0])
    if first.WhichOneof("what") != "file_version" or first.file_version != "brain.Event:2":
        sys.exit("first event: %s" % first)
    for k, (rec, line) in enumerate(zip(recs[1:], lines), 1):
        ev = event_pb2.Event.FromString(rec)
        where = "event %d" % k
        if ev.SerializeToString() != rec:
            # a canonical encoder writes the same bytes: fields in order, packed, no extras
            sys.exit("%s: protobuf re-encodes it differently" % where)
        if not t0 <= ev.wall_time <= t1:
            sys.exit("%s: wall_time %r not in [%r, %r]" % (where, ev.wall_time, t0, t1))
        kind, tag, step = line[0], bytes.fromhex(line[1]).decode("utf-8"), int(line[2])
        if ev.step != step or ev.WhichOneof("what") != "summary" or len(ev.summary.value) != 1:
            sys.exit("%s: %s" % (where, ev))
        val = ev.summary.value[0]
        if val.tag != tag:
            sys.exit("%s: tag %r, want %r" % (where, val.tag, tag))
        if kind == "scalar":
            want = struct.unpack("<f", struct.pack("<f", float(line[3])))[0]
            if val.WhichOneof("value") != "simple_value" or not close(val.simple_value, want):
                sys.exit("%s: %s, want simple_value %r" % (where, val, want))
        else:
            xs = [float(x) for x in line[3].split(",")] if len(line) > 3 else []
            h = val.histo
            if val.WhichOneof("value") != "histo":
                sys.exit("%s: not a histogram" % where)
            lo = min(xs) if xs else DBL_MAX
            hi = max(xs) if xs else -DBL_MAX
            s = 0.0
            sq = 0.0
            for x in xs:
                s += x
                sq += x * x
            for name, got, want in (("min", h.min, lo), ("max", h.max, hi), ("num", h.num, len(xs)),
                                    ("sum", h.sum, s), ("sum_squares", h.sum_squares, sq)):
                if not close(got, want):
                    sys.exit("%s: %s %r, want %r" % (where, name, got, want))
            limits, buckets = tf_histogram(xs)
            if list(h.bucket_limit) != limits or list(h.bucket) != buckets:
                sys.exit("%s: buckets %s %s, want %s %s" % (where, list(h.bucket_limit), list(h.bucket),
                                                             limits, buckets))
    print("ok %d events" % len(lines))


main()
