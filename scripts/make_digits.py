#!/usr/bin/python3
"""make_digits.py — writes scikit-learn's digits set (1797 8x8 grey images of
handwritten digits, 10 classes) as the small .npy files examples/digits_cnn.c,
bench/bench_digits.c and tests/digits_cnn_test.cc read:

  examples/data/digits_{train,test}_images.npy  uint8 [n, 8, 8, 1] (NHWC), 0..16
  examples/data/digits_{train,test}_labels.npy  uint8 [n], 0..9

A stratified split with a fixed seed: 1437 training and 360 test images. The
pixels stay the set's own integers 0..16 as one byte each (115 KB in all;
float32 would be 460 KB): a reader scales them to [0, 1] by dividing by 16.
Needs python3-sklearn (Debian) and numpy. Run from anywhere:
  /usr/bin/python3 scripts/make_digits.py [OUT_DIR]
The output is deterministic: running it again gives the same bytes.
"""
import os
import sys

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SEED = 16
TEST_SIZE = 360


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "examples", "data")
    os.makedirs(out, exist_ok=True)

    digits = load_digits()
    images = digits.images  # float64 [1797, 8, 8], integers 0..16
    labels = digits.target  # int64 [1797], 0..9
    assert images.shape == (1797, 8, 8) and images.min() >= 0 and images.max() <= 16
    assert np.array_equal(images, np.round(images))
    images = images.astype(np.uint8).reshape(-1, 8, 8, 1)
    labels = labels.astype(np.uint8)

    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=TEST_SIZE, stratify=labels, random_state=SEED)
    files = {
        "digits_train_images.npy": x_train,
        "digits_train_labels.npy": y_train,
        "digits_test_images.npy": x_test,
        "digits_test_labels.npy": y_test,
    }
    total = 0
    for name, array in files.items():
        path = os.path.join(out, name)
        np.save(path, np.ascontiguousarray(array), allow_pickle=False)
        size = os.path.getsize(path)
        total += size
        print(f"{path}: {array.dtype} {list(array.shape)}, {size} bytes")
    print(f"{total} bytes in all; classes in the test set: {np.bincount(y_test).tolist()}")


if __name__ == "__main__":
    main()
