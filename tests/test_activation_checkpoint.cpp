// fsdp::checkpoint without FSDP: the gradients, outputs and the random stream after backward
// are those of the same computation without the checkpoint, bit for bit (dropout included),
// for tensor and non-tensor arguments, arguments without grad, nested checkpoints and the
// module form; end-of-backward callbacks queued inside the nested backward run at the end of
// the outer one.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/autograd/activation_checkpoint.h"
#include "fsdp/autograd/checkpoint_wrapper.h"
#include "fsdp/autograd/end_of_backward.h"
#include "harness/gpu.h"

namespace {

// LayerNorm, a Linear, dropout, GELU, another Linear: random numbers inside.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t dim) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    up = register_module("up", torch::nn::Linear(dim, 2 * dim));
    drop = register_module("drop", torch::nn::Dropout(0.3));
    down = register_module("down", torch::nn::Linear(2 * dim, dim));
  }
  torch::Tensor forward(torch::Tensor x) { return x + down(torch::gelu(drop(up(norm(x))))); }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Block);

// Every gradient and value, bitwise.
void expect_same_grads(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pa[i].value().grad().defined()) << pa[i].key();
    ASSERT_TRUE(pb[i].value().grad().defined()) << pb[i].key();
    EXPECT_TRUE(torch::equal(pa[i].value().grad(), pb[i].value().grad())) << pa[i].key();
  }
}

Block make_block(uint64_t seed) {
  torch::manual_seed(seed);
  return Block(8);
}

// Runs `step` (forward and backward) after seeding; returns a draw from the stream after it.
template <typename F>
torch::Tensor stream_after(F step) {
  torch::manual_seed(123);
  step();
  return torch::rand({16});
}

}  // namespace

TEST(ActivationCheckpoint, DropoutRecomputesBitForBitAndStreamContinues) {
  auto ref = make_block(0), ck = make_block(0);
  auto x0 = torch::randn({4, 8});
  torch::Tensor xr = x0.clone().requires_grad_(true), xc = x0.clone().requires_grad_(true);
  torch::Tensor out_r, out_c;
  auto after_r = stream_after([&] {
    out_r = ref(ref(xr));
    out_r.pow(2).sum().backward();
  });
  auto after_c = stream_after([&] {
    auto h = fsdp::checkpoint([&](const torch::Tensor& t) { return ck(t); }, xc);
    out_c = fsdp::checkpoint([&](const torch::Tensor& t) { return ck(t); }, h);
    out_c.pow(2).sum().backward();
  });
  EXPECT_TRUE(torch::equal(out_r, out_c));
  EXPECT_TRUE(torch::equal(xr.grad(), xc.grad()));
  expect_same_grads(*ref, *ck);
  EXPECT_TRUE(torch::equal(after_r, after_c)) << "the random stream after backward differs";
  // The checkpoint really dropped the activations: its result's node saves only the argument.
  EXPECT_NE(out_c.grad_fn()->name().find("CheckpointFunction"), std::string::npos) << out_c.grad_fn()->name();
}

// The CUDA generator of the arguments' device is replayed too (skips without a GPU).
TEST(ActivationCheckpoint, CudaDropoutRecomputesBitForBit) {
  FSDP_SKIP_WITHOUT_GPU(1);
  auto ref = make_block(6), ck = make_block(6);
  ref->to(torch::kCUDA);
  ck->to(torch::kCUDA);
  auto x0 = torch::randn({4, 8}, torch::kCUDA);
  auto xr = x0.clone().requires_grad_(true), xc = x0.clone().requires_grad_(true);
  torch::cuda::manual_seed_all(11);
  ref(xr).pow(2).sum().backward();
  auto after_r = torch::rand({16}, torch::kCUDA);
  torch::cuda::manual_seed_all(11);
  fsdp::checkpoint([&](const torch::Tensor& t) { return ck(t); }, xc).pow(2).sum().backward();
  auto after_c = torch::rand({16}, torch::kCUDA);
  EXPECT_TRUE(torch::equal(xr.grad(), xc.grad()));
  expect_same_grads(*ref, *ck);
  EXPECT_TRUE(torch::equal(after_r, after_c)) << "the CUDA random stream after backward differs";
}

TEST(ActivationCheckpoint, NonTensorArgumentsAndTensorLists) {
  auto ref = make_block(1), ck = make_block(1);
  auto x0 = torch::randn({3, 8}), y0 = torch::randn({3, 8});
  auto f = [](Block& b, const torch::Tensor& x, int64_t repeat, double scale, const std::vector<at::Tensor>& extra) {
    torch::Tensor h = x;
    for (int64_t i = 0; i < repeat; ++i) h = b(h) * scale;
    for (const auto& e : extra) h = h + e;
    return std::make_tuple(h, h.sum(1));
  };
  auto xr = x0.clone().requires_grad_(true), yr = y0.clone().requires_grad_(true);
  auto xc = x0.clone().requires_grad_(true), yc = y0.clone().requires_grad_(true);
  torch::manual_seed(5);
  auto [hr, sr] = f(ref, xr, 2, 0.5, {yr});
  (hr.sum() + sr.pow(2).sum()).backward();
  torch::manual_seed(5);
  auto [hc, sc] = fsdp::checkpoint(
      [&](const torch::Tensor& x, int64_t repeat, double scale, const std::vector<at::Tensor>& extra) {
        return f(ck, x, repeat, scale, extra);
      },
      xc, int64_t(2), 0.5, std::vector<at::Tensor>{yc});
  (hc.sum() + sc.pow(2).sum()).backward();
  EXPECT_TRUE(torch::equal(hr, hc));
  EXPECT_TRUE(torch::equal(xr.grad(), xc.grad()));
  ASSERT_TRUE(yc.grad().defined()) << "a tensor inside a std::vector argument got no gradient";
  EXPECT_TRUE(torch::equal(yr.grad(), yc.grad()));
  expect_same_grads(*ref, *ck);
}

TEST(ActivationCheckpoint, ArgumentsWithoutGradStillTrainTheParameters) {
  auto ref = make_block(2), ck = make_block(2);
  auto x = torch::randn({5, 8});  // requires no grad
  torch::manual_seed(7);
  ref(x).sum().backward();
  torch::manual_seed(7);
  auto out = fsdp::checkpoint([&](const torch::Tensor& t) { return ck(t); }, x);
  ASSERT_TRUE(out.requires_grad()) << "no argument requires grad, yet the parameters do";
  out.sum().backward();
  expect_same_grads(*ref, *ck);
  EXPECT_FALSE(x.grad().defined());
}

TEST(ActivationCheckpoint, NestedCheckpoints) {
  // Three blocks, each used once: a parameter used on both sides of a checkpoint boundary
  // gets its gradient summed in another order (bitwise different), as in PyTorch.
  std::vector<Block> ref, ck;
  for (uint64_t i = 0; i < 3; ++i) {
    ref.push_back(make_block(10 + i));
    ck.push_back(make_block(10 + i));
  }
  auto x0 = torch::randn({4, 8});
  auto xr = x0.clone().requires_grad_(true), xc = x0.clone().requires_grad_(true);
  auto after_r = stream_after([&] { ref[2](ref[1](ref[0](xr))).sum().backward(); });
  auto after_c = stream_after([&] {
    auto out = fsdp::checkpoint(
        [&](const torch::Tensor& t) {
          auto h = ck[0](t);
          h = fsdp::checkpoint([&](const torch::Tensor& u) { return ck[1](u); }, h);
          return ck[2](h);
        },
        xc);
    out.sum().backward();
  });
  EXPECT_TRUE(torch::equal(xr.grad(), xc.grad()));
  for (int i = 0; i < 3; ++i) expect_same_grads(*ref[i], *ck[i]);
  EXPECT_TRUE(torch::equal(after_r, after_c));
}

TEST(ActivationCheckpoint, ModuleFormAndPolicy) {
  struct NetImpl : torch::nn::Module {
    NetImpl() {
      for (int i = 0; i < 3; ++i) blocks.push_back(register_module("b" + std::to_string(i), fsdp::Checkpointable<BlockImpl>(8)));
      head = register_module("head", torch::nn::Linear(8, 2));
    }
    torch::Tensor forward(torch::Tensor x) {
      for (auto& b : blocks) x = b->forward(x);
      return head(x);
    }
    std::vector<fsdp::Checkpointable<BlockImpl>> blocks;
    torch::nn::Linear head{nullptr};
  };
  torch::manual_seed(4);
  auto ref = std::make_shared<NetImpl>();
  torch::manual_seed(4);
  auto ck = std::make_shared<NetImpl>();
  EXPECT_EQ(fsdp::apply_activation_checkpointing(*ck, fsdp::checkpoint_module_type<BlockImpl>()), 3);
  auto x = torch::randn({6, 8});
  torch::manual_seed(9);
  auto out_r = ref->forward(x);
  out_r.sum().backward();
  torch::manual_seed(9);
  auto out_c = ck->forward(x);
  out_c.sum().backward();
  EXPECT_TRUE(torch::equal(out_r, out_c));
  expect_same_grads(*ref, *ck);
  auto block_out = ck->blocks[0]->forward(x);
  EXPECT_NE(block_out.grad_fn()->name().find("CheckpointFunction"), std::string::npos) << block_out.grad_fn()->name();
  // Evaluation: a plain call.
  torch::NoGradGuard no_grad;
  ck->eval();
  ref->eval();
  EXPECT_TRUE(torch::equal(ck->forward(x), ref->forward(x)));
}

TEST(ActivationCheckpoint, PolicyAcceptingANonCandidateFailsClearly) {
  auto net = torch::nn::Sequential(torch::nn::Linear(2, 2));
  try {
    fsdp::apply_activation_checkpointing(*net.ptr(), [](const std::string& path, torch::nn::Module&) {
      return path == "0";
    });
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'0'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("fsdp::Checkpointable<Impl>"), std::string::npos) << msg;
  }
}

TEST(ActivationCheckpoint, ARecomputeThatDiffersFailsClearly) {
  int calls = 0;
  auto x = torch::randn({3}).requires_grad_(true);
  auto out = fsdp::checkpoint(
      [&](const torch::Tensor& t) {
        std::vector<at::Tensor> r{t * 2};
        if (calls++ > 0) r.push_back(t * 3);  // state that changes between calls
        return r;
      },
      x);
  try {
    out[0].sum().backward();
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("returned 2 tensors where the first forward returned 1"), std::string::npos)
        << e.what();
  }
}

TEST(ActivationCheckpoint, PhasesAndEndOfBackwardOnTheOutermostTask) {
  using fsdp::autograd::in_checkpointed_forward;
  using fsdp::autograd::in_recompute;
  std::vector<std::string> events;
  auto w = torch::randn({4}).requires_grad_(true);
  auto x = torch::randn({4}).requires_grad_(true);
  auto before = x * 2;  // outside the checkpoint, its gradient comes after the checkpoint's
  before.register_hook([&](const torch::Tensor& g) {
    events.push_back("outer hook");
    return g;
  });
  auto out = fsdp::checkpoint(
      [&](const torch::Tensor& t) {
        events.push_back(in_checkpointed_forward() ? "checkpointed forward" : in_recompute() ? "recompute" : "?");
        auto h = t * w;
        if (h.requires_grad()) {
          h.register_hook([&](const torch::Tensor& g) {
            events.push_back("inner hook");
            fsdp::autograd::queue_end_of_backward([&] { events.push_back("end of backward"); });
            return g;
          });
        }
        return h.sin();
      },
      before);
  EXPECT_FALSE(in_checkpointed_forward());
  out.sum().backward();
  EXPECT_FALSE(in_recompute());
  std::vector<std::string> expected{"checkpointed forward", "recompute", "inner hook", "outer hook", "end of backward"};
  EXPECT_EQ(events, expected);
}
