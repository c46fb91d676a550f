#!/usr/bin/env python3
"""Python PyTorch DDP and FSDP2 baselines for bench_strategies (not a test).

Trains the same models as bench/bench_strategies.cpp (MLP 784-1024-1024-10, or the
transformer-like stack: Linear 784->256, 4 blocks of [x + Linear(LayerNorm(x)),
x + Linear(GELU(Linear(x)))] with a 4x MLP, Linear 256->10) with torch.optim.Adam,
global batch 128 split over `--world` ranks, one intra-op thread per rank, Gloo over
loopback. Prints one JSON object (rank 0) with the same keys as bench_strategies.
With --zero the optimizer is torch.distributed.optim.ZeroRedundancyOptimizer over Adam
(PyTorch's ZeRO-1: each rank steps the parameters assigned to it and broadcasts them),
still under DDP, as its documentation pairs them.
With --fsdp2 the model is PyTorch's FSDP2 instead of DDP: torch.distributed.fsdp.fully_shard
on a 1-D CPU device mesh (Gloo) over every child of the Sequential that holds parameters
(each Linear of the mlp; each block and each projection of the transformer: the units
bench_strategies gives its FULL_SHARD rows), then on the root, with the defaults
(reshard_after_forward=True: FULL_SHARD), and plain Adam over the sharded parameters.
Run with the Python whose torch the build links (bench_strategies runs $FSDP_PYTHON):
  .venv/bin/python bench/ddp_baseline.py --model mlp [--zero | --fsdp2]
"""
import argparse
import datetime
import json
import os

# One intra-op thread per rank, as the C++ ranks run: the wheel's torch otherwise starts one
# OpenMP/MKL thread per core in each rank. Set before torch loads; the spawned workers
# inherit it, and each also calls torch.set_num_threads(1).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
import queue as queue_module
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.mix(self.norm(x))
        return x + self.fc2(F.gelu(self.fc1(x)))


def make_model(name):
    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10))
    return nn.Sequential(nn.Linear(784, 256), *[Block(256) for _ in range(4)], nn.Linear(256, 10))


def worker(rank, args, init_file, queue):
    torch.set_num_threads(1)
    # A rendezvous that cannot complete fails within a minute (main() retries).
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    if args.fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (args.world,))
        model = make_model(args.model)
        for child in model:
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(make_model(args.model))
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    per = args.batch // args.world
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(per, 784, generator=gen)
    y = torch.randint(0, 10, (per,), generator=gen)

    def step():
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    if rank == 0:
        n = args.world

        def local_bytes(t):  # FSDP2's parameters, gradients and Adam moments are DTensors: this rank's shard
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()

        param_bytes = sum(local_bytes(p) for p in model.parameters())
        grad_bytes = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        local = opt.optim if args.zero else opt  # ZeRO: this rank's partition only
        optim_bytes = sum(local_bytes(t) for s in local.state.values()
                          for k, t in s.items() if torch.is_tensor(t) and k != "step")
        step_s = elapsed.item() / args.steps
        # DDP all-reduces every gradient once (ring): 2 Psi (N-1)/N; ZeRO adds the broadcast
        # of every rank's updated parameters (Psi (N-1)/N each); FSDP2 (FULL_SHARD) gathers
        # every unit in forward and again in backward and reduce-scatters its gradients:
        # 3 Psi (N-1)/N, Psi the whole model's bytes (a DTensor's numel is the global one).
        # Not measured.
        psi = sum(p.numel() * p.element_size() for p in model.parameters())
        strategy = "PYTHON_FSDP2" if args.fsdp2 else "PYTHON_DDP+ZERO" if args.zero else "PYTHON_DDP"
        queue.put({
            "model": args.model, "strategy": strategy, "world_size": n,
            "step_ms": round(step_s * 1e3, 3), "samples_per_s": round(args.batch / step_s, 1),
            "bytes_communicated": int((3 if args.zero or args.fsdp2 else 2) * psi * (n - 1) / n),
            "param_bytes": param_bytes, "grad_bytes": grad_bytes, "optim_bytes": optim_bytes,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        })
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--zero", action="store_true", help="torch.distributed.optim.ZeroRedundancyOptimizer over Adam")
    ap.add_argument("--fsdp2", action="store_true", help="FSDP2 (fully_shard per unit and root) instead of DDP")
    args = ap.parse_args()
    if args.zero and args.fsdp2:
        ap.error("--zero and --fsdp2 exclude each other")
    # A worker that dies without a result (seen now and then at start-up on the
    # loaded VM: the process vanishes with no traceback) would leave the other
    # waiting for it forever; notice it, stop the survivors and try again.
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as d:
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            procs = [ctx.Process(target=worker, args=(r, args, os.path.join(d, "store"), queue))
                     for r in range(args.world)]
            for p in procs:
                p.start()
            result, deadline = None, time.monotonic() + 600
            while result is None and time.monotonic() < deadline:
                try:
                    result = queue.get(timeout=1)
                except queue_module.Empty:
                    dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead:
                        print(f"ddp_baseline: worker(s) {dead} (rank, exit code) died; attempt {attempt + 1}",
                              file=sys.stderr, flush=True)
                        break
            # Once rank 0 has reported, a rank that does not exit is stuck in Gloo's
            # teardown (seen: rank 1 waiting forever at exit); the result stands.
            for p in procs:
                if result is None:
                    p.kill()
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join()
            if result is not None:
                print(json.dumps(result), flush=True)
                return
    sys.exit(1)


if __name__ == "__main__":
    main()
