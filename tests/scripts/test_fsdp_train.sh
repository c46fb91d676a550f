#!/usr/bin/env bash
# fsdp-train, the main job: short runs under each sharding strategy lower the loss and write
# well-formed metrics; a run is deterministic; bad flags fail fast with the right message;
# --estimate-memory prints every strategy; the cnn and the gpt train too, and all three models
# match unsharded single-process PyTorch (section 5): bit for bit for the mlp and the cnn
# (every optimizer, bf16 mixed precision, every strategy, 1 and 2 ranks; at 1 rank the final
# weights too).
# 2 ranks, short runs: about 4 minutes on the loaded 2-core machine.
set -euo pipefail
# shellcheck source=lib/fsdp_train_test.sh
source "$(dirname "$0")/lib/fsdp_train_test.sh"

# Prints the losses of a metrics file, one per line, after checking every line's schema;
# $2: the number of step lines expected (default 30).
losses() {
  "$PY" - "$1" "${2:-30}" <<'PY'
import json, sys
want = int(sys.argv[2])
steps, evals = [], []
for n, line in enumerate(open(sys.argv[1]), 1):
    j = json.loads(line)
    if "eval" in j:
        e = j["eval"]
        assert 0.0 <= e["accuracy"] <= 1.0, f"line {n}: accuracy {e['accuracy']} not a fraction"
        assert e["loss"] > 0, f"line {n}: eval loss {e['loss']}"
        evals.append(j)
        continue
    for k in ("step", "loss", "lr", "samples_per_s", "memory"):
        assert k in j, f"line {n}: missing '{k}' in {j}"
    m = j["memory"]
    for k in ("param_bytes", "grad_bytes", "optim_bytes", "unsharded_peak_bytes", "rss_bytes"):
        assert isinstance(m.get(k), int) and m[k] >= 0, f"line {n}: memory.{k} = {m.get(k)}"
    assert j["step"] == len(steps) + 1, f"line {n}: step {j['step']}, expected {len(steps) + 1}"
    steps.append(j)
assert len(steps) == want, f"{len(steps)} step lines, expected {want}"
assert len(evals) == 1, f"{len(evals)} eval lines, expected 1 (the final evaluation)"
for j in steps:
    print(repr(j["loss"]))
print("eval", repr(evals[0]["eval"]["loss"]), repr(evals[0]["eval"]["accuracy"]))
PY
}

# Sets first/last to the first and last training loss of $WORK/<name>.losses and fails
# unless the loss went down.
loss_went_down() {
  first="$(head -n 1 "$WORK/$1.losses")"
  last="$(grep -v eval "$WORK/$1.losses" | tail -n 1)"
  awk -v a="$last" -v b="$first" 'BEGIN { exit !(a < b) }' ||
    fail "$1: loss did not go down (first $first, last $last)"
}

# --- 1. each strategy trains and writes metrics ------------------------------------------
for strategy in full_shard shard_grad_op no_shard; do
  run --strategy "$strategy" --steps 30 --no-shuffle --metrics "$WORK/$strategy.jsonl"
  [[ $RC == 0 ]] || fail "$strategy: exit status $RC"
  grep -q "test accuracy:" "$OUT" || fail "$strategy: no summary line 'test accuracy:'"
  losses "$WORK/$strategy.jsonl" >"$WORK/$strategy.losses" || fail "$strategy: bad metrics file"
  loss_went_down "$strategy"
  pass "$strategy: 30 steps, loss $first -> $last, metrics well-formed"
done
# hybrid_shard (2 ranks, one shard group of 2: the shard + replica paths with a
# trivial replica group) and bf16 mixed precision train too.
for variant in "hybrid_shard:--strategy hybrid_shard --shard-group-size 2" "bf16:--mixed-precision bf16"; do
  name="${variant%%:*}"
  # shellcheck disable=SC2086
  run ${variant#*:} --steps 30 --no-shuffle --metrics "$WORK/$name.jsonl"
  [[ $RC == 0 ]] || { cat "$OUT"; fail "$name: exit status $RC"; }
  losses "$WORK/$name.jsonl" >"$WORK/$name.losses" || fail "$name: bad metrics file"
  loss_went_down "$name"
  pass "$name: 30 steps, loss $first -> $last"
done
# (Section 5 compares these runs with PyTorch bit for bit.)
# Same data, same initial weights, same math: the strategies agree on the first loss exactly.
f1="$(head -n 1 "$WORK/full_shard.losses")"
for strategy in shard_grad_op no_shard; do
  [[ "$(head -n 1 "$WORK/$strategy.losses")" == "$f1" ]] ||
    fail "first loss of $strategy ($(head -n 1 "$WORK/$strategy.losses")) differs from full_shard ($f1)"
done
pass "all strategies start from the same loss ($f1)"

# The schedule flags move collectives, never numbers: same losses bit for bit.
# --optimizer-in-backward steps each unit inside backward: the same numbers too, also with
# --offload-params (shards, gradients and Adam state on the host: here one memory with the device)
# and with --zero-copy-gather (the gathered parameters map the other rank's shard).
# --backward-prefetch pre is the default: that run repeats full_shard's flags, so it is also
# section 2's check that the same flags twice give the same losses and eval.
for flags in "--backward-prefetch none --forward-prefetch --bucket-cap-mb 8" "--backward-prefetch pre" \
  "--backward-prefetch post --bucket-cap-mb 8" "--optimizer-in-backward" \
  "--optimizer-in-backward --bucket-cap-mb 8" "--offload-params --optimizer-in-backward" \
  "--zero-copy-gather --optimizer-in-backward"; do
  # shellcheck disable=SC2086
  run --strategy full_shard --steps 30 --no-shuffle $flags --metrics "$WORK/schedule.jsonl"
  [[ $RC == 0 ]] || { cat "$OUT"; fail "$flags: exit status $RC"; }
  losses "$WORK/schedule.jsonl" >"$WORK/schedule.losses" || fail "$flags: bad metrics file"
  diff "$WORK/full_shard.losses" "$WORK/schedule.losses" >/dev/null || fail "$flags changed the losses"
  pass "$flags: identical losses"
done

# --- 2. determinism ----------------------------------------------------------------------
# Same flags twice, --no-shuffle: the --backward-prefetch pre run of section 1 (the default
# flags again) equals full_shard's losses and eval. Shuffled runs with the same seed (the
# permutation is seeded, identical on every rank): section 6's "shuffled" variant (--seed 3)
# runs 10 steps with checkpoints and 20 without, and their first 10 losses must be equal.

# --- 3. bad flags fail fast with the right message ---------------------------------------
expect_error() {  # expect_error "<message fragment>" args...
  local want="$1"; shift
  local t0 t1; t0=$(date +%s.%N)
  run "$@"
  t1=$(date +%s.%N)
  [[ $RC != 0 ]] || fail "fsdp-train $* exited 0, expected an error"
  grep -qF -- "$want" "$OUT" || fail "fsdp-train $*: message '$want' not found"
  awk -v a="$t0" -v b="$t1" 'BEGIN { exit !(b - a < 5) }' || fail "fsdp-train $* took more than 5 s to fail"
  pass "fsdp-train $* -> exit $RC, '$want'"
}
expect_error "unknown --strategy 'bogus'" --strategy bogus
expect_error "--shard-group-size applies to --strategy hybrid_shard only" --shard-group-size 2
expect_error "unknown --mixed-precision 'fp8'; expected none or bf16" --mixed-precision fp8
expect_error "unknown --backward-prefetch 'early'; expected pre, post or none" --backward-prefetch early
expect_error "--batch-size 63 does not divide by the world size 2" --batch-size 63
expect_error "cannot read $WORK/nope/train-images-idx3-ubyte.gz" --data "$WORK/nope"
expect_error "unknown --model 'rnn'; expected mlp, cnn or gpt" --model rnn
expect_error "--dim 10 does not divide into --heads 3" --model gpt --dim 10 --heads 3
expect_error "--text $WORK/nope.txt: cannot read the file" --model gpt --text "$WORK/nope.txt"
printf 'too short\n' >"$WORK/short.txt"
expect_error "--text $WORK/short.txt has 10 bytes: too short for --context 64" --model gpt --text "$WORK/short.txt"
expect_error "--context must be >= 1, got 0" --model gpt --context 0
expect_error "--layers applies to --model gpt only, not --model mlp" --layers 3
expect_error "--hidden applies to --model mlp only, not --model gpt" --model gpt --hidden 128
expect_error "--optimizer-in-backward needs gradients reduced during backward" --strategy zero1 --optimizer-in-backward
expect_error "--zero-copy-gather maps the sharded parameters FSDP gathers" --strategy zero2 --zero-copy-gather
expect_error "--mixed-precision bf16 gathers a cast copy: drop one of the two" --zero-copy-gather --mixed-precision bf16
expect_error "--offload-params keeps them away from the device: drop one of the two" --zero-copy-gather --offload-params
expect_error "--gpu-margin-mem-ratio places offloaded state back on the GPU; add --offload-params" --gpu-margin-mem-ratio 0.5
expect_error "--gpu-margin-mem-ratio with --strategy full_shard needs --optimizer-in-backward" --offload-params --gpu-margin-mem-ratio 0.5
expect_error "--gpu-margin-mem-ratio must be in [0, 1]" --offload-params --gpu-margin-mem-ratio 2
expect_error "unknown --device 'gpu'; expected cpu or cuda" --device gpu
expect_error "--optimizer cpu_adam steps host memory; with --device cuda use --optimizer adam" --device cuda --optimizer cpu_adam
# --device cuda on a machine without a GPU: one line, before any rank starts (where torch sees a
# GPU, scripts/gpu_check.sh's gpu run trains on it instead; this check is for GPU-less machines).
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  expect_error "fsdp-train: error: --device cuda: torch sees no CUDA device on this machine" --device cuda
  [[ $(grep -c . "$OUT") == 1 ]] || fail "--device cuda without a GPU printed more than one line: $(cat "$OUT")"
fi
# Under a launcher the world size is only known to the ranks: every rank must refuse.
run --batch-size 63 --nproc 1 --steps 1  # passes the pre-spawn check (63 % 1 == 0)
[[ $RC == 0 ]] || fail "--nproc 1 --batch-size 63 should run (exit $RC)"
RC=0
"$FSDP_BIN_DIR/fsdp-run" --nproc 2 -- "$TRAIN" --batch-size 63 >"$OUT" 2>&1 || RC=$?
[[ $RC != 0 ]] || fail "under fsdp-run --nproc 2, --batch-size 63 exited 0"
grep -q "rank[01].*does not divide by the world size 2" "$OUT" || fail "no rank reported the batch error"
# fsdp-run stops the other rank as soon as one fails, possibly before it printed anything, so
# each rank's own refusal is checked with the launcher's environment set by hand.
for r in 0 1; do
  RC=0
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 \
    "$TRAIN" --batch-size 63 >"$OUT" 2>&1 || RC=$?
  [[ $RC == 2 ]] || fail "rank $r of 2 with --batch-size 63: exit $RC, expected 2"
  grep -q "does not divide by the world size 2" "$OUT" || fail "rank $r did not report the batch error"
done
pass "under a launcher every rank reports a batch that does not divide"

# --- 4. --estimate-memory ----------------------------------------------------------------
run --estimate-memory
[[ $RC == 0 ]] || fail "--estimate-memory: exit $RC"
for s in NO_SHARD SHARD_GRAD_OP FULL_SHARD; do grep -q "^$s " "$OUT" || fail "--estimate-memory: no $s line"; done
grep -q "P = 669706 parameters, N = 2 ranks" "$OUT" || fail "--estimate-memory: wrong parameter count or world size"
# 16 * 669706 = 10715296 B = 10.22 MiB (NO_SHARD), 5.11 MiB (FULL_SHARD at N=2).
grep -q "^NO_SHARD .*10.22 MiB$" "$OUT" || fail "--estimate-memory: NO_SHARD total is not 10.22 MiB"
grep -q "^FULL_SHARD .*5.11 MiB$" "$OUT" || fail "--estimate-memory: FULL_SHARD total is not 5.11 MiB"
pass "--estimate-memory prints the three strategies"
# The same arithmetic for the other models; the ranks assert it matches the built model,
# and section 5 checks the count the training header prints.
run --estimate-memory --model cnn
grep -q "P = 20490 parameters" "$OUT" || fail "--estimate-memory --model cnn: wrong parameter count"
run --estimate-memory --model gpt --layers 3 --dim 32 --heads 2 --context 16
# 256*32 + 16*32 + 3*(12*32*32 + 13*32) + 2*32 + 256*32 = 8192 + 512 + 38112 + 64 + 8192 = 55072
grep -q "P = 55072 parameters" "$OUT" || fail "--estimate-memory --model gpt: wrong parameter count"
pass "--estimate-memory counts the cnn and the gpt"

# --- 5. cnn and gpt; every model against unsharded PyTorch ------------------------------
# Reference: unsharded single-process PyTorch ($PY: the torch wheel the build links) builds the same
# model in the same order from the same seed (libtorch and PyTorch share the CPU generator and
# the init functions, so the initial weights are identical), trains it on the global batch of
# each --no-shuffle step, and prints one loss per step. At REF_WORLD=1 that is plain PyTorch;
# at REF_WORLD=2 it computes the two rank slices' gradients one after the other and averages
# them in the library's order, so that float sums round alike. Adam and AdamW step with
# libtorch's arithmetic (torch.optim's 2.x Adam rounds exp_avg differently; the mlp is checked
# against it once, within 1e-6). With one thread on both sides the mlp and the cnn then agree
# to the bit for 30 steps: any wrong init, data window, gradient factor or optimizer update
# shows. The gpt's attention is written differently here
# (a tril mask): its losses agree to rounding only (measured 4.9e-8 over 10 steps).
# The reference program, $REF_PY DATA mlp|cnn <steps> <batch> <lr>
#                    or $REF_PY DATA gpt <steps> <batch> <lr> <text> <layers> <dim> <heads> <context>:
# REF_OPT=adam|adamw|sgd (REF_WD: weight decay, sgd: momentum 0.9), REF_MP=none|bf16,
# REF_SAVE=FILE: torch.save of the final state dict. Adam and AdamW step with libtorch's
# arithmetic (LibtorchAdam below); REF_TORCH_OPTIM=1: with torch.optim's, which since
# torch 2.x rounds differently (lerp_), so only a tolerance holds against it.
# REF_WORLD=N: the global batch is split into N rank slices whose gradients are reduced
# as the library does (each divided by the predivide factor, summed in rank order, divided
# by the rest of N, in the reduce dtype); the loss is the mean of the slices' losses.
REF_PY="$WORK/reference.py"
cat >"$REF_PY" <<'PY'
import copy, gzip, math, os, sys
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

data_dir, model, steps, B, lr = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
opt_name, wd = os.environ.get("REF_OPT", "adam"), float(os.environ.get("REF_WD", "0"))
mp, W = os.environ.get("REF_MP", "none"), int(os.environ.get("REF_WORLD", "1"))
assert os.environ.get("OMP_NUM_THREADS") == "1" and os.environ.get("MKL_NUM_THREADS") == "1", \
    "set OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 before torch loads (GEMM rounding follows the thread count)"
torch.set_num_threads(1)
torch.manual_seed(0)
if model in ("mlp", "cnn"):
    def idx(name, offset):
        return np.frombuffer(gzip.open(f"{data_dir}/{name}").read(), dtype=np.uint8, offset=offset)
    pixels = torch.from_numpy(idx("train-images-idx3-ubyte.gz", 16).reshape(-1, 784).copy())
    labels = torch.from_numpy(idx("train-labels-idx1-ubyte.gz", 8).astype(np.int64))
    if model == "mlp":
        net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    else:
        net = nn.Sequential(nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                            nn.Linear(1568, 10))
    params = list(net.parameters())
    def batch(m, s, lo, hi):  # --no-shuffle: sample i of step s is (s*B + i) mod 60000
        i = torch.tensor([(s * B + i) % len(labels) for i in range(lo, hi)])
        x = pixels[i].float().div_(255.0)
        return m(x if mp == "none" else x.to(torch.bfloat16)), labels[i]
else:
    text, L, d, H, T = sys.argv[6], *map(int, sys.argv[7:11])
    raw = open(text, "rb").read()
    train = torch.tensor(list(raw[: len(raw) - len(raw) // 10]), dtype=torch.int64)
    tok, pos = nn.Embedding(256, d), nn.Embedding(T, d)
    blocks = []
    for _ in range(L):
        blk = nn.ModuleDict()
        blk["ln1"] = nn.LayerNorm(d)
        for name in ("q", "k", "v", "proj"):
            blk[name] = nn.Linear(d, d)
        blk["ln2"] = nn.LayerNorm(d)
        blk["fc1"], blk["fc2"] = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        blocks.append(blk)
    ln_f, head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)
    net = nn.ModuleList([tok, pos, *blocks, ln_f, head])
    params = list(net.parameters())
    sees = torch.tril(torch.ones(T, T, dtype=torch.bool))  # position t sees positions 0..t
    def attention(blk, x):
        b, t, c = x.shape
        split = lambda y: y.view(b, t, H, c // H).transpose(1, 2)
        q, k, v = split(blk["q"](x)), split(blk["k"](x)), split(blk["v"](x))
        w = F.softmax((q @ k.transpose(-2, -1) / math.sqrt(c // H)).masked_fill(~sees[:t, :t], float("-inf")), -1)
        return blk["proj"]((w @ v).transpose(1, 2).reshape(b, t, c))
    def batch(m, s, lo, hi):  # --no-shuffle: window i of step s starts at ((s*B + i)*T) mod (n - T)
        tok, pos, *blocks, ln_f, head = m
        w = torch.stack([train[a : a + T + 1] for a in (((s * B + i) * T) % (len(train) - T) for i in range(lo, hi))])
        h = tok(w[:, :T]) + pos(torch.arange(T))
        for blk in blocks:
            h = h + attention(blk, blk["ln1"](h))
            h = h + blk["fc2"](F.gelu(blk["fc1"](blk["ln2"](h))))
        return head(ln_f(h)).reshape(-1, 256), w[:, 1:].reshape(-1)
class LibtorchAdam:
    """torch::optim::Adam / AdamW's arithmetic (default betas and eps): torch.optim's 2.x Adam
    updates exp_avg with lerp_ and takes bias_correction2 ** 0.5, libtorch with mul_/add_ and
    sqrt, which rounds differently (1.9e-7 rel. in the losses after 30 mlp steps)."""
    def __init__(self, params, lr, weight_decay, decoupled):
        self.params, self.lr, self.wd, self.decoupled, self.t = params, lr, weight_decay, decoupled, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for p, m, v in zip(self.params, self.m, self.v):
            g = p.grad
            if self.wd != 0 and self.decoupled:
                p.mul_(1 - self.lr * self.wd)
            elif self.wd != 0:
                g = g.add(p, alpha=self.wd)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(eps), value=-(self.lr / bc1))
if opt_name == "sgd":
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd)
elif os.environ.get("REF_TORCH_OPTIM") == "1":  # torch.optim's own Adam / AdamW
    opt = (torch.optim.AdamW if opt_name == "adamw" else torch.optim.Adam)(params, lr=lr, weight_decay=wd)
else:
    opt = LibtorchAdam(params, lr, wd, decoupled=opt_name == "adamw")
# bf16: forward and backward on a bf16 copy of the fp32 master weights, gradients
# reduced in bf16 (reduce dtype = param dtype), then cast back for the optimizer.
compute = net if mp == "none" else copy.deepcopy(net).to(torch.bfloat16)
pre = 1
while W % pre == 0 and W // pre > pre:
    pre *= 2
post = W / pre
for s in range(steps):
    if compute is not net:
        with torch.no_grad():
            for c, p in zip(compute.parameters(), params):
                c.copy_(p)
    total, losses = [None] * len(params), []
    for r in range(W):
        logits, y = batch(compute, s, r * B // W, (r + 1) * B // W)
        loss = F.cross_entropy(logits, y)
        compute.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        for k, c in enumerate(compute.parameters()):
            g = c.grad.clone() if pre == 1 else c.grad.div(pre)
            total[k] = g if r == 0 else total[k] + g
    for k, p in enumerate(params):
        p.grad = (total[k] if post == 1 else total[k].div(post)).to(p.dtype)
    opt.step()
    acc = 0.0
    for x in losses:
        acc += x
    print(repr(acc / W))
if os.environ.get("REF_SAVE"):
    torch.save(net.state_dict(), os.environ["REF_SAVE"])
PY
# references NAME [VAR=VALUE...] -- ARGS... ; ...: every reference run of this section in one
# Python process, so that torch loads once rather than once per run. Each run gets the
# reference program's arguments ARGS and its REF_* variables, starts from its own seed as the
# program does alone, and prints its losses into $WORK/NAME.ref.
references() {
  "$PY" - "$REF_PY" "$DATA" "$WORK" "$@" <<'PY' || fail "the PyTorch references failed"
import contextlib, os, runpy, sys
script, data, work, rest = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
runs = []
while rest:
    end = rest.index(";") if ";" in rest else len(rest)
    runs.append(rest[:end])
    rest = rest[end + 1:]
for name, *words in runs:
    cut = words.index("--")
    env = dict(w.split("=", 1) for w in words[:cut])
    for k in [k for k in os.environ if k.startswith("REF_")]:
        del os.environ[k]
    os.environ.update(env)
    sys.argv = [script, data, *words[cut + 1:]]
    try:
        with open(f"{work}/{name}.ref", "w") as out, contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    except BaseException as e:
        sys.exit(f"the reference {name} ({' '.join(words)}) failed: {e!r}")
PY
}
# Compares the losses of file $1 (fsdp-train) with the first ones, all of file $2 (the
# reference, REF_STEPS of them): every relative difference must be below REF_TOL (0: equal
# to the bit). Prints the largest.
REF_STEPS=10
REF_TOL=1e-6
compare_losses() {
  "$PY" -c '
import sys
a = [float(l) for l in open(sys.argv[1]) if not l.startswith("eval")]
b = [float(l) for l in open(sys.argv[2])]
assert len(b) == int(sys.argv[4]) and len(a) >= len(b), f"{len(a)} losses vs {len(b)} of the reference"
rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
print("%.2g" % max(rel))
tol = float(sys.argv[3])
ok = all(x == y for x, y in zip(a, b)) if tol == 0 else max(rel) < tol
assert ok, "\n".join(f"step {i + 1}: {x!r} vs {y!r}" for i, (x, y) in enumerate(zip(a, b)) if x != y)
' "$1" "$2" "${3:-$REF_TOL}" "${4:-$REF_STEPS}"
}
# exact <name> <reference file>: the 30 losses of $WORK/<name>.losses equal the reference's.
exact() {
  d="$(compare_losses "$WORK/$1.losses" "$2" 0 30 2>&1)" || fail "$1: losses differ from the unsharded PyTorch reference: $d"
}
check_run() {  # check_run <name> <steps> <header fragment> <summary fragment>
  [[ $RC == 0 ]] || fail "$1: exit status $RC"
  grep -qF -- "$3" "$OUT" || fail "$1: header '$3' not found"
  grep -qF -- "$4" "$OUT" || fail "$1: summary line '$4' not found"
  losses "$WORK/$1.jsonl" "$2" >"$WORK/$1.losses" || fail "$1: bad metrics file"
  first="$(head -n 1 "$WORK/$1.losses")"
  last="$(grep -v eval "$WORK/$1.losses" | tail -n 1)"
  awk -v a="$last" -v b="$first" 'BEGIN { exit !(a < b) }' || fail "$1: loss did not go down (first $first, last $last)"
}

# The mlp: one rank against plain PyTorch on the whole batch, then the section 1 runs (every
# strategy, bf16) and each optimizer at 2 ranks against the 2-slice reference.
# First every reference of this section (the mlp's, the cnn's, the gpt's).
GPL=/usr/share/common-licenses/GPL-3
references mlp1 REF_SAVE="$WORK/mlp1.ref.pt" -- mlp 30 64 0.001 \; \
  mlp1.torch_optim REF_TORCH_OPTIM=1 -- mlp 30 64 0.001 \; \
  mlp2 REF_WORLD=2 -- mlp 30 64 0.001 \; \
  mlp2_bf16 REF_WORLD=2 REF_MP=bf16 -- mlp 30 64 0.001 \; \
  sgd REF_WORLD=2 REF_OPT=sgd REF_WD=0 -- mlp 30 64 0.05 \; \
  sgd_nproc1 REF_WORLD=1 REF_OPT=sgd REF_WD=0 -- mlp 30 64 0.05 \; \
  adamw REF_WORLD=2 REF_OPT=adamw REF_WD=0.01 -- mlp 30 64 0.001 \; \
  cnn REF_WORLD=2 -- cnn 30 64 0.001 \; \
  cnn_bf16 REF_WORLD=2 REF_MP=bf16 -- cnn 30 64 0.001 \; \
  gpt REF_WORLD=2 -- gpt $REF_STEPS 32 0.001 "$GPL" 2 64 4 64
run --nproc 1 --steps 30 --no-shuffle --metrics "$WORK/mlp_nproc1.jsonl" --checkpoint-dir "$WORK/mlp1ck"
[[ $RC == 0 ]] || fail "mlp --nproc 1: exit status $RC"
losses "$WORK/mlp_nproc1.jsonl" >"$WORK/mlp_nproc1.losses" || fail "mlp --nproc 1: bad metrics file"
exact mlp_nproc1 "$WORK/mlp1.ref"
# The final weights too: the step-30 checkpoint, consolidated, against PyTorch's.
"$FSDP_BIN_DIR/fsdp-ckpt" consolidate "$WORK/mlp1ck/step-30" "$WORK/mlp1.pt" >/dev/null ||
  fail "fsdp-ckpt consolidate of the --nproc 1 run failed (build target fsdp-ckpt)"
"$PY" -c '
import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
assert list(a) == list(b), (list(a), list(b))
bad = [k for k in a if not torch.equal(a[k], b[k])]
assert not bad, f"weights differ: {bad}"
' "$WORK/mlp1.pt" "$WORK/mlp1.ref.pt" || fail "mlp --nproc 1: final weights differ from PyTorch's"
pass "mlp --nproc 1: 30 Adam steps equal plain unsharded PyTorch to the bit (losses and final weights)"
# torch.optim.Adam itself (lerp_ for exp_avg since torch 2.x): within 1e-6 relative, 30 steps.
d="$(compare_losses "$WORK/mlp_nproc1.losses" "$WORK/mlp1.torch_optim.ref" 1e-6 30 2>&1)" ||
  fail "mlp --nproc 1: losses differ from torch.optim.Adam's by 1e-6 or more: $d"
pass "mlp --nproc 1: 30 steps within $d relative of torch.optim.Adam's (its own rounding)"
for name in full_shard shard_grad_op no_shard hybrid_shard; do
  exact $name "$WORK/mlp2.ref"
done
pass "mlp full_shard, shard_grad_op, no_shard, hybrid_shard: 30 Adam steps equal PyTorch to the bit"
exact bf16 "$WORK/mlp2_bf16.ref"
pass "mlp --mixed-precision bf16: 30 steps equal PyTorch with the same casts to the bit"
# Each against the reference of its name above (cpu_adam: mlp2's, the same Adam at 2 ranks).
for variant in "sgd:--optimizer sgd:sgd:sgd" "sgd_nproc1:--optimizer sgd --nproc 1:sgd:sgd_nproc1" \
  "adamw:--optimizer adamw --weight-decay 0.01:adamw:adamw" "cpu_adam:--optimizer cpu_adam:adam:mlp2"; do
  IFS=: read -r name flags ref_opt ref <<<"$variant"
  # shellcheck disable=SC2086
  run $flags --steps 30 --no-shuffle --metrics "$WORK/$name.jsonl"
  [[ $RC == 0 ]] || fail "$name: exit status $RC"
  losses "$WORK/$name.jsonl" >"$WORK/$name.losses" || fail "$name: bad metrics file"
  if [[ $name == cpu_adam ]]; then
    # CPUAdam's fused kernel rounds as libtorch 1.13's Adam did; the wheel's ATen kernels
    # (vectorised addcmul/addcdiv) round some elements differently: close, not bitwise.
    d="$(compare_losses "$WORK/$name.losses" "$WORK/$ref.ref" 1e-6 30 2>&1)" ||
      fail "$name: losses differ from the unsharded PyTorch reference by 1e-6 or more: $d"
    pass "mlp $flags: 30 steps within $d relative of PyTorch's torch.optim.${ref_opt}"
    continue
  fi
  exact "$name" "$WORK/$ref.ref"
  pass "mlp $flags: 30 steps equal PyTorch's torch.optim.${ref_opt} to the bit"
done

run --model cnn --steps 30 --no-shuffle --metrics "$WORK/cnn.jsonl"
# root (the first Conv2d: 160 < --min-num-params 1000) + second Conv2d + Linear
check_run cnn 30 "cnn (20490 params, 3 units)" "test accuracy:"
cnn_acc="$(grep -o 'test accuracy: [0-9.]*%' "$OUT")"
exact cnn "$WORK/cnn.ref"
pass "cnn: 30 steps, loss $first -> $last, $cnn_acc, equal to PyTorch to the bit"
run --model cnn --mixed-precision bf16 --steps 30 --no-shuffle --metrics "$WORK/cnn_bf16.jsonl"
check_run cnn_bf16 30 "cnn (20490 params, 3 units)" "test accuracy:"
exact cnn_bf16 "$WORK/cnn_bf16.ref"
pass "cnn --mixed-precision bf16: 30 steps, loss $first -> $last, equal to PyTorch with the same casts to the bit"

run --model gpt --steps 30 --no-shuffle --metrics "$WORK/gpt.jsonl"
# root (embeddings, final norm, head) + one unit per block
check_run gpt 30 "gpt (136960 params, 3 units)" "validation next-byte accuracy:"
d="$(compare_losses "$WORK/gpt.losses" "$WORK/gpt.ref" 2>&1)" || fail "gpt: losses differ from the unsharded PyTorch reference: $d"
pass "gpt: 30 steps, loss $first -> $last, max rel. diff to PyTorch over $REF_STEPS steps $d"
# The other strategies on the custom model (the Sequential ones are covered by section 1).
for strategy in shard_grad_op no_shard; do
  run --model gpt --strategy $strategy --steps $REF_STEPS --no-shuffle --metrics "$WORK/gpt_$strategy.jsonl"
  check_run gpt_$strategy $REF_STEPS "gpt (136960 params, 3 units), $strategy" "validation next-byte accuracy:"
  d="$(compare_losses "$WORK/gpt_$strategy.losses" "$WORK/gpt.ref" 2>&1)" ||
    fail "gpt $strategy: losses differ from the unsharded PyTorch reference: $d"
  pass "gpt $strategy: loss $first -> $last, max rel. diff to PyTorch $d"
done

# Random windows: the same flags give the same losses (the draws are identical on every rank),
# and they are not the --no-shuffle windows.
for i in 1 2; do
  run --model gpt --steps 10 --metrics "$WORK/gs$i.jsonl"
  [[ $RC == 0 ]] || fail "gpt shuffled run $i: exit $RC"
  losses "$WORK/gs$i.jsonl" 10 >"$WORK/gs$i.losses" || fail "gpt shuffled run $i: bad metrics file"
done
diff "$WORK/gs1.losses" "$WORK/gs2.losses" >/dev/null ||
  fail "gpt: same flags, different losses: $(diff "$WORK/gs1.losses" "$WORK/gs2.losses" | head -n 4)"
[[ "$(head -n 1 "$WORK/gs1.losses")" != "$(head -n 1 "$WORK/gpt.losses")" ]] ||
  fail "gpt: shuffled and --no-shuffle runs start from the same loss (windows not drawn at random?)"
pass "gpt: same flags twice (random windows), identical losses and validation"
# --- 6. checkpoints and --resume ---------------------------------------------------------
# An uninterrupted run of 2K steps against: K steps with --checkpoint-dir, then --resume from
# DIR/step-K up to 2K. Same world size and strategy: the losses of steps K+1..2K and the final
# eval are bitwise equal (weights, Adam moments and steps, data position restored); another
# world size or strategy: equal within 1e-6 relative (measured 6e-8) (only float sums run in another order).
K=10
CK="$WORK/ckpt"
# same_losses A B TOL [noeval]: the step lines of B (steps s..2K) and its eval equal A's (TOL 0:
# exactly); noeval: B's eval (at another step) is not compared.
same_losses() {
  "$PY" -c '
import json, sys
def read(p):
    steps, ev = {}, None
    for line in open(p):
        j = json.loads(line)
        if "eval" in j: ev = j["eval"]["loss"]
        else: steps[j["step"]] = j["loss"]
    return steps, ev
(a, ea), (b, eb), tol = read(sys.argv[1]), read(sys.argv[2]), float(sys.argv[3])
assert b and ea is not None and eb is not None, "missing step or eval lines"
worst = 0.0
for s, x in sorted(b.items()) + ([("eval", eb)] if len(sys.argv) < 5 else []):
    y = a[s] if s != "eval" else ea
    rel = abs(x - y) / abs(y)
    worst = max(worst, rel)
    assert (x == y) if tol == 0 else rel < tol, f"step {s}: resumed {x!r} vs uninterrupted {y!r}"
print("%.2g" % worst, min(b), max(b))
' "$@"
}
for variant in "noshuffle:--no-shuffle" "shuffled:--seed 3"; do
  name="${variant%%:*}"
  flags="${variant#*:}"
  # shellcheck disable=SC2086
  run $flags --steps $((2 * K)) --metrics "$WORK/$name.full.jsonl"
  [[ $RC == 0 ]] || fail "$name: uninterrupted run: exit $RC"
  # shellcheck disable=SC2086
  # The noshuffle run saves asynchronously (the default), the shuffled one blocking.
  save_mode=--async-checkpoint
  [[ $name == shuffled ]] && save_mode=--no-async-checkpoint
  run $flags --steps $K --checkpoint-dir "$CK/$name" --checkpoint-every 4 --keep-checkpoints 0 $save_mode --metrics "$WORK/$name.first.jsonl"
  [[ $RC == 0 ]] || fail "$name: run with --checkpoint-dir: exit $RC"
  for s in 0 4 8 $K; do
    [[ -f "$CK/$name/step-$s/metadata.json" ]] || fail "$name: no checkpoint $CK/$name/step-$s (have: $(ls "$CK/$name"))"
  done
  [[ ! -e "$CK/$name/step-12" && ! -e "$CK/$name/step-$K.tmp" ]] || fail "$name: unexpected checkpoint directories: $(ls "$CK/$name")"
  # Checkpointing does not perturb the run.
  d="$(same_losses "$WORK/$name.full.jsonl" "$WORK/$name.first.jsonl" 0 noeval 2>&1)" ||
    fail "$name: the first $K steps with --checkpoint-dir differ from the uninterrupted run: $d"
  # shellcheck disable=SC2086
  run $flags --resume "$CK/$name/step-$K" --steps $((2 * K)) --checkpoint-dir "$CK/$name" --metrics "$WORK/$name.resumed.jsonl"
  [[ $RC == 0 ]] || fail "$name: --resume: exit $RC"
  grep -q "resumed from $CK/$name/step-$K at step $K" "$OUT" || fail "$name: no 'resumed from ... at step $K' line"
  d="$(same_losses "$WORK/$name.full.jsonl" "$WORK/$name.resumed.jsonl" 0 2>&1)" ||
    fail "$name: resumed losses differ from the uninterrupted run: $d"
  [[ "$(echo "$d" | cut -d' ' -f2-3)" == "$((K + 1)) $((2 * K))" ]] || fail "$name: the resumed run wrote steps $d, expected $((K + 1))..$((2 * K))"
  [[ -f "$CK/$name/step-$((2 * K))/metadata.json" ]] || fail "$name: no final checkpoint step-$((2 * K))"
  # The resumed run kept the default --keep-checkpoints 2: step-0, -4 and -8 are gone.
  [[ "$(ls "$CK/$name" | sort -V | tr '\n' ' ')" == "step-$K step-$((2 * K)) " ]] ||
    fail "$name: default --keep-checkpoints 2 left: $(ls "$CK/$name" | tr '\n' ' ')"
  pass "$name: $K steps + --resume step-$K to $((2 * K)): losses of steps $(echo "$d" | cut -d' ' -f2-3 | tr ' ' -) and eval bitwise equal to $((2 * K)) uninterrupted steps; step-0, -4, -8, -$K, -$((2 * K)) written, the default --keep-checkpoints 2 kept the last two"
done
# Other world sizes and strategies (batch 64 divides 1 and 4).
for variant in "nproc1:--nproc 1" "no_shard:--strategy no_shard" "nproc4_sgo:--nproc 4 --strategy shard_grad_op"; do
  name="${variant%%:*}"
  # shellcheck disable=SC2086
  run --no-shuffle ${variant#*:} --resume "$CK/noshuffle/step-$K" --steps $((2 * K)) --metrics "$WORK/$name.resumed.jsonl"
  [[ $RC == 0 ]] || fail "resume under $name: exit $RC"
  d="$(same_losses "$WORK/noshuffle.full.jsonl" "$WORK/$name.resumed.jsonl" 1e-6 2>&1)" ||
    fail "resume under $name: losses differ from the 2-rank FULL_SHARD run by more than 1e-6: $d"
  pass "resume (saved by 2 ranks FULL_SHARD) under ${variant#*:}: max rel. diff $(echo "$d" | cut -d' ' -f1) to the uninterrupted run"
done
# --resume auto with a damaged tensor file in the newest checkpoint, on one rank's part only
# (its metadata is fine, so only the load finds it): the load fails on both ranks and changes
# nothing ([Note: atomic load]), the run reports it, resumes from the one before, and steps
# 11..20 and the eval equal the uninterrupted run bit for bit.
cp -r "$CK/noshuffle" "$CK/auto"
shard="$CK/auto/step-$((2 * K))/shard_rank00001.bin"
at=$(($(stat -c %s "$shard") - 2))
byte=$(od -An -tu1 -j "$at" -N1 "$shard" | tr -d ' ')
printf "\\x$(printf %02x $((byte ^ 0x5a)))" | dd of="$shard" bs=1 seek="$at" conv=notrunc status=none
run --no-shuffle --checkpoint-dir "$CK/auto" --resume auto --steps $((2 * K)) --metrics "$WORK/auto.resumed.jsonl"
[[ $RC == 0 ]] || fail "--resume auto past a damaged step-$((2 * K)): exit $RC"
grep -qF "resume auto: skipped: fsdp: load_checkpoint('$CK/auto/step-$((2 * K))') failed on 1 of 2 ranks" "$OUT" ||
  fail "--resume auto: the damaged step-$((2 * K)) is not reported"
grep -qF "rank 1: fsdp checkpoint: checksum mismatch in file '$CK/auto/step-$((2 * K))/shard_rank00001.bin'" "$OUT" ||
  fail "--resume auto: the report does not name rank 1 and its file"
grep -q "resumed from $CK/auto/step-$K at step $K" "$OUT" || fail "--resume auto: no 'resumed from .../step-$K' line"
d="$(same_losses "$WORK/noshuffle.full.jsonl" "$WORK/auto.resumed.jsonl" 0 2>&1)" ||
  fail "--resume auto past a damaged checkpoint: losses differ from the uninterrupted run: $d"
pass "--resume auto: step-$((2 * K)) with a flipped byte in rank 1's file reported and passed over; from step-$K, steps $(echo "$d" | cut -d' ' -f2-3 | tr ' ' -) and eval bitwise equal"
expect_error "--resume $CK/nope: no checkpoint there" --resume "$CK/nope"
expect_error "the checkpoint was saved with --seed 3 but this run has --seed 0" --resume "$CK/shuffled/step-$K"
expect_error "saved with --no-shuffle given but this run has --no-shuffle not given; a resumed run must train the same model on the same data: add --no-shuffle" --resume "$CK/noshuffle/step-$K"
expect_error "--checkpoint-every needs --checkpoint-dir" --checkpoint-every 5
run --no-shuffle --resume "$CK/noshuffle/step-$((2 * K))" --steps $K
[[ $RC != 0 ]] && grep -qF "the checkpoint is at step $((2 * K)) but this run has only $K steps in all" "$OUT" ||
  fail "--resume past --steps: exit $RC, expected the 'checkpoint is at step' message"
pass "--resume step-$((2 * K)) --steps $K refused"
echo "all fsdp-train checks passed"
