#!/usr/bin/env python3
"""The one-GPU GPT benchmark of bench/bench_gpu_gpt.cpp in Python PyTorch (not a test).

The same model, data and math as bench_gpu_gpt (see its header): a GPT of ~1.3 B parameters
(24 pre-LayerNorm blocks of width 2048, 16 heads, causal F.scaled_dot_product_attention, 4x
exact-GELU MLP, biases, tied token embedding, vocabulary 32000), batch 8 x 1024 tokens, bf16
compute with fp32 master weights, torch.optim.Adam(fused=True) (lr 1e-4), loss in fp32. Every
parameter is created on the GPU in the C++ program's order from torch.manual_seed(0), and the
tokens from torch.manual_seed(1234), so both programs start from the same weights and data (the
first losses agree to bf16 rounding). Two modes, alternating in rounds in one process:

  * PYTHON_PLAIN: fp32 parameters; the forward casts each to bf16 where it uses it (once per
    parameter per step), so backward accumulates fp32 .grad: the C++ PLAIN mode, to cross-check it.
  * PYTHON_FSDP2: torch.distributed.fsdp.fully_shard on every block, then on the root, over a
    one-rank NCCL process group (file store: no network, not even loopback TCP for the store),
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32; --reduce-dtype bf16), defaults
    otherwise (reshard_after_forward=True: FULL_SHARD). The forward's casts are then no-ops.
  * PYTHON_FSDP2_OFFLOAD (--modes fsdp2_offload, not run by default): PYTHON_FSDP2 with
    fully_shard(offload_policy=CPUOffloadPolicy()): fp32 shards, gradients and Adam state on the
    host, torch.optim.Adam (its default implementation) stepping them there after backward; the counterpart of
    bench_gpu_gpt's FULL_SHARD_OFFLOAD.

Timing, memory and output as bench_gpu_gpt: --warmup untimed steps then --steps timed steps per
phase, each step between torch.cuda.synchronize() calls; step_ms is the median of a mode's timed
steps; peak_bytes is torch.cuda.max_memory_allocated over a phase's timed steps (reset before
them) less the bytes the other mode's model and optimizer state hold meanwhile. One JSON object
per line per mode, then {"target": "python_fsdp2_vs_plain", ...}. Without a CUDA device it says
so and exits 0.

  python3 bench/fsdp2_gpt.py [--steps 10] [--warmup 2] [--rounds 3] [--modes plain,fsdp2] [--tiny]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

NO_GPU = "no CUDA device: this benchmark runs on a GPU machine (scripts/gpu_bench.sh)"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--modes", default="plain,fsdp2",
                    help="plain, fsdp2 and/or fsdp2_offload, in each round's order")
    ap.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--tiny", action="store_true",
                    help="2 blocks, width 128, 4 heads, vocabulary 1000, batch 2 x 64 (smoke tests)")
    a = ap.parse_args()
    full = dict(layers=24, width=2048, heads=16, vocab=32000, batch=8, seq=1024)
    tiny = dict(layers=2, width=128, heads=4, vocab=1000, batch=2, seq=64)
    for k, v in (tiny if a.tiny else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.modes = [m for m in a.modes.split(",") if m]
    for m in a.modes:
        if m not in ("plain", "fsdp2", "fsdp2_offload"):
            ap.error("--modes takes plain, fsdp2 and/or fsdp2_offload, got %r" % m)
    if a.width % a.heads:
        ap.error("--width must be a multiple of --heads")
    return a


def main():
    a = parse_args()
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU)
        print(json.dumps({"bench": "fsdp2_gpt", "skipped": "no CUDA device"}))
        return 0

    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    casts = [0]

    def bf16(p):
        # FSDP2's unsharded parameters are bf16 already (param_dtype); plain fp32 ones are cast.
        if p.dtype == torch.bfloat16:
            return p
        casts[0] += 1
        return p.to(torch.bfloat16)

    def normal(shape, f):
        return torch.empty(shape, **f).normal_(0.0, 0.02)

    class Block(nn.Module):
        def __init__(self, width, heads, f):
            super().__init__()
            c = width
            self.heads = heads
            self.ln1_w = nn.Parameter(torch.ones(c, **f))
            self.ln1_b = nn.Parameter(torch.zeros(c, **f))
            self.qkv_w = nn.Parameter(normal((3 * c, c), f))
            self.qkv_b = nn.Parameter(torch.zeros(3 * c, **f))
            self.proj_w = nn.Parameter(normal((c, c), f))
            self.proj_b = nn.Parameter(torch.zeros(c, **f))
            self.ln2_w = nn.Parameter(torch.ones(c, **f))
            self.ln2_b = nn.Parameter(torch.zeros(c, **f))
            self.fc1_w = nn.Parameter(normal((4 * c, c), f))
            self.fc1_b = nn.Parameter(torch.zeros(4 * c, **f))
            self.fc2_w = nn.Parameter(normal((c, 4 * c), f))
            self.fc2_b = nn.Parameter(torch.zeros(c, **f))

        def forward(self, x):
            b, t, c = x.shape
            d = c // self.heads
            h = F.layer_norm(x, (c,), bf16(self.ln1_w), bf16(self.ln1_b), 1e-5)
            q, k, v = F.linear(h, bf16(self.qkv_w), bf16(self.qkv_b)).split(c, dim=2)
            q = q.view(b, t, self.heads, d).transpose(1, 2)
            k = k.view(b, t, self.heads, d).transpose(1, 2)
            v = v.view(b, t, self.heads, d).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(b, t, c)
            x = x + F.linear(y, bf16(self.proj_w), bf16(self.proj_b))
            h = F.layer_norm(x, (c,), bf16(self.ln2_w), bf16(self.ln2_b), 1e-5)
            return x + F.linear(F.gelu(F.linear(h, bf16(self.fc1_w), bf16(self.fc1_b))),
                                bf16(self.fc2_w), bf16(self.fc2_b))

    class Gpt(nn.Module):
        def __init__(self, f):
            super().__init__()
            self.width = a.width
            self.wte = nn.Parameter(normal((a.vocab, a.width), f))
            self.wpe = nn.Parameter(normal((a.seq, a.width), f))
            self.h = nn.ModuleList([Block(a.width, a.heads, f) for _ in range(a.layers)])
            self.lnf_w = nn.Parameter(torch.ones(a.width, **f))
            self.lnf_b = nn.Parameter(torch.zeros(a.width, **f))

        def forward(self, idx):
            emb = bf16(self.wte)  # one cast for both uses (tied)
            pos = torch.arange(idx.size(1), device=idx.device)
            x = F.embedding(idx, emb) + F.embedding(pos, bf16(self.wpe))
            for blk in self.h:
                x = blk(x)
            x = F.layer_norm(x, (self.width,), bf16(self.lnf_w), bf16(self.lnf_b), 1e-5)
            return F.linear(x, emb)

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    f = dict(device=dev, dtype=torch.float32)
    store = None
    if any(m != "plain" for m in a.modes):
        store = os.path.join(tempfile.gettempdir(), "fsdp2_gpt.%d.store" % os.getpid())
        if os.path.exists(store):
            os.remove(store)
        dist.init_process_group("nccl", init_method="file://" + store, rank=0, world_size=1, device_id=dev)

    torch.manual_seed(1234)
    tokens = torch.randint(0, a.vocab, (a.batches, a.batch, a.seq + 1), device=dev)
    xs = [tokens[i, :, :a.seq].contiguous() for i in range(a.batches)]
    ys = [tokens[i, :, 1:].contiguous() for i in range(a.batches)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)

    class Mode:
        def __init__(self, key):
            self.key = key
            self.name = {"plain": "PYTHON_PLAIN", "fsdp2": "PYTHON_FSDP2", "fsdp2_offload": "PYTHON_FSDP2_OFFLOAD"}[key]
            self.model = self.opt = None
            self.footprint = 0
            self.params = 0
            self.ms, self.round_ms, self.losses = [], [], []
            self.peak_raw = self.peak_alone = self.other_bytes = 0
            self.casts = self.timed_steps = self.next_batch = 0
            self.error = ""

    modes = [Mode(k) for k in a.modes]

    def footprints():
        return sum(m.footprint for m in modes)

    for m in modes:
        try:
            torch.manual_seed(0)  # the same initial weights in every mode (and as in C++)
            model = Gpt(f)
            m.params = sum(p.numel() for p in model.parameters())
            if m.key in ("fsdp2", "fsdp2_offload"):
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

                mesh = init_device_mesh("cuda", (1,))
                mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.float32 if a.reduce_dtype == "fp32" else torch.bfloat16)
                off = CPUOffloadPolicy() if m.key == "fsdp2_offload" else OffloadPolicy()
                for blk in model.h:
                    fully_shard(blk, mesh=mesh, mp_policy=mp, offload_policy=off)
                fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=off)
            m.model = model
            # On host parameters (DTensors) Adam's default implementation, as FSDP2's docs use it.
            m.opt = torch.optim.Adam(model.parameters(), lr=a.lr, fused=m.key != "fsdp2_offload" or None)
            torch.cuda.synchronize()
            m.footprint = torch.cuda.memory_allocated(dev) - base - footprints()
        except Exception as e:  # noqa: BLE001 - reported in the mode's JSON line
            m.error = "construction: %s: %s" % (type(e).__name__, e)
            m.model = m.opt = None
            torch.cuda.empty_cache()

    def step(m):
        m.opt.zero_grad(set_to_none=True)
        i = m.next_batch % a.batches
        m.next_batch += 1
        logits = m.model(xs[i])
        loss = F.cross_entropy(logits.reshape(-1, a.vocab).float(), ys[i].reshape(-1))
        loss.backward()
        m.opt.step()
        return loss.detach()

    for r in range(a.rounds):
        for m in modes:
            if m.model is None:
                continue
            try:
                for _ in range(a.warmup):
                    m.losses.append(step(m).item())
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
                casts0 = casts[0]
                this_round = []
                for _ in range(a.steps):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    loss = step(m)
                    torch.cuda.synchronize()
                    this_round.append((time.perf_counter() - t0) * 1e3)
                    m.losses.append(loss.item())
                m.casts += casts[0] - casts0
                m.timed_steps += a.steps
                others = footprints() - m.footprint
                peak = torch.cuda.max_memory_allocated(dev)
                if peak > m.peak_raw:
                    m.peak_raw, m.other_bytes, m.peak_alone = peak, others, peak - others
                m.ms += this_round
                m.round_ms.append(this_round)
                m.opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                m.footprint = torch.cuda.memory_allocated(dev) - base - others
            except Exception as e:  # noqa: BLE001
                m.error = "round %d: %s: %s" % (r, type(e).__name__, e)
                m.model = m.opt = None
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                m.footprint = 0

    tokens_per_step = a.batch * a.seq
    gib = 1.0 / (1 << 30)
    for m in modes:
        if not m.ms:
            print("%-13s failed: %s" % (m.name, m.error))
            continue
        ms = statistics.median(m.ms)
        print("%-13s %8.1f ms/step  %8.0f tokens/s  peak %.2f GiB (raw %.2f GiB)%s" % (
            m.name, ms, tokens_per_step / (ms * 1e-3), m.peak_alone * gib, m.peak_raw * gib,
            ("  error: " + m.error) if m.error else ""))
    plain = next((m for m in modes if m.key == "plain"), None)
    for m in modes:
        row = {"bench": "fsdp2_gpt", "model": "gpt", "strategy": m.name, "world_size": 1,
               "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "params": m.params,
               "layers": a.layers, "width": a.width, "heads": a.heads, "vocab": a.vocab, "batch": a.batch,
               "seq": a.seq, "tokens_per_step": tokens_per_step, "param_dtype": "bf16", "master_dtype": "fp32",
               "optimizer": "adam" if m.key == "fsdp2_offload" else "fused_adam", "embedding": "tied"}
        if m.key != "plain":
            row.update(reduce_dtype=a.reduce_dtype, backend="nccl")
        if m.ms:
            ms = statistics.median(m.ms)
            row.update(step_ms=round(ms, 3), step_ms_min=round(min(m.ms), 3),
                       step_ms_mean=round(sum(m.ms) / len(m.ms), 3),
                       tokens_per_s=round(tokens_per_step / (ms * 1e-3), 1),
                       samples_per_s=round(a.batch / (ms * 1e-3), 2), timed_steps=m.timed_steps,
                       peak_bytes=m.peak_alone, peak_allocated_bytes=m.peak_raw, other_mode_bytes=m.other_bytes,
                       casts_per_step=m.casts / m.timed_steps,
                       step_ms_per_round=[round(statistics.median(r), 3) for r in m.round_ms])
            if m.key != "plain":
                row["units"] = a.layers + 1
                if plain is not None and plain.losses:
                    n = min(len(plain.losses), len(m.losses))
                    row["max_loss_diff_vs_plain"] = round(
                        max([abs(plain.losses[i] - m.losses[i]) for i in range(n)] or [0.0]), 6)
            row["losses"] = [round(x, 5) for x in m.losses]
        if m.error:
            row["error"] = m.error
        print(json.dumps(row))
    fsdp2 = next((m for m in modes if m.key == "fsdp2"), None)
    if plain is not None and fsdp2 is not None and plain.ms and fsdp2.ms:
        per_round = [statistics.median(p) / statistics.median(q) for p, q in zip(plain.round_ms, fsdp2.round_ms)]
        print(json.dumps({"bench": "fsdp2_gpt", "target": "python_fsdp2_vs_plain",
                          "ratio": round(statistics.median(plain.ms) / statistics.median(fsdp2.ms), 3),
                          "ratio_per_round": [round(x, 3) for x in per_round],
                          "median_ratio": round(statistics.median(per_round), 3)}))
    sys.stdout.flush()
    if store is not None:
        dist.destroy_process_group()
        try:
            os.remove(store)
        except OSError:
            pass
    return 1 if any(m.error for m in modes) else 0


if __name__ == "__main__":
    sys.exit(main())
