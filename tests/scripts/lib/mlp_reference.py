"""Unsharded single-process PyTorch reference for `fsdp-train --model mlp --no-shuffle`.

Builds the mlp in the same order from the same seed (libtorch and PyTorch share the CPU
generator and the init functions, so the initial weights are identical), trains it with Adam
on the whole global batch of each step and prints one loss per step. With SAVE_DIR it also
writes the weights after every fifth step, SAVE_DIR/step-<S>.pt (torch.save of the state
dict: the keys and layout of `fsdp-ckpt consolidate`).
One thread (OpenMP and MKL, set before torch loads, and torch.set_num_threads(1)): GEMM
rounding follows the thread count, and the library's ranks run one each.
usage: $FSDP_PYTHON mlp_reference.py DATA_DIR STEPS BATCH LR [SAVE_DIR]
"""
import gzip
import os
import sys

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

data_dir, steps, B, lr = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
save_dir = sys.argv[5] if len(sys.argv) > 5 else None
torch.set_num_threads(1)
torch.manual_seed(0)


def idx(name, offset):
    return np.frombuffer(gzip.open(f"{data_dir}/{name}").read(), dtype=np.uint8, offset=offset)


pixels = torch.from_numpy(idx("train-images-idx3-ubyte.gz", 16).reshape(-1, 784).copy())
labels = torch.from_numpy(idx("train-labels-idx1-ubyte.gz", 8).astype(np.int64))
net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.Adam(net.parameters(), lr=lr)
for s in range(steps):
    i = torch.tensor([(s * B + k) % len(labels) for k in range(B)])  # --no-shuffle
    loss = F.cross_entropy(net(pixels[i].float().div_(255.0)), labels[i])
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
    print(repr(loss.item()))
    if save_dir and (s + 1) % 5 == 0:
        torch.save(net.state_dict(), f"{save_dir}/step-{s + 1}.pt")
