// Prefetch and the schedule trace. The trace (fsdp/trace.h) records every
// all-gather, reduction, forward and backward span with per-rank sequence
// numbers; these tests check from it *when* gathers are issued under each
// prefetch setting (each setting's expected order fails under the others), that
// the trace file is valid Chrome trace JSON, where FSDP's own work between the compute
// spans lies on the phases track, and that prefetch changes no number:
// the trained parameters are bit-identical to training without prefetch and
// match single-process training on the global batch (relative L2 < 1e-5).
#include <cstdlib>
#include <fstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/comm/collectives.h"
#include "harness/models.h"
#include "harness/multirank.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

// The first span of that name, or the last (a unit's backward gather comes after
// its forward gather).
const TraceSpan& find_span(const std::vector<TraceSpan>& spans, const std::string& name, bool last = false) {
  const TraceSpan* found = nullptr;
  for (const auto& s : spans)
    if (s.name == name && (last || found == nullptr)) found = &s;
  if (found) return *found;
  static TraceSpan missing;
  ADD_FAILURE() << "no span '" << name << "' in the trace";
  return missing;
}

Options mlp_options(BackwardPrefetch bp, bool fp) {
  return Options().sharding_strategy(ShardingStrategy::kFullShard).auto_wrap_policy(always_wrap_policy())
      .backward_prefetch(bp).forward_prefetch(fp).trace_dir(worker_scratch_dir() + "/trace");
}

// Two training iterations of the MLP (units "0", "2", "4"); returns the spans
// of the second (the forward prefetch needs the first iteration's order).
// step_in_backward: the options ask for the optimizer inside backward, which gets SGD.
std::vector<TraceSpan> traced_iteration(comm::ProcessGroup& pg, Options options, bool step_in_backward = false) {
  auto model = FullyShardedDataParallel(make_mlp(), pg, options);
  torch::optim::SGD opt(model->parameters(), 0.05);
  if (step_in_backward) model->register_optimizer_in_backward(opt);
  for (int s = 0; s < 2; ++s) {
    if (s == 1) model->clear_trace();
    auto [x, y] = global_batch(s, 8);
    opt.zero_grad(/*set_to_none=*/step_in_backward);
    torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size()))
        .backward();
    opt.step();
  }
  return model->trace_spans();
}

template <typename ModelFactory>
std::map<std::string, torch::Tensor> train(comm::ProcessGroup& pg, ModelFactory make, Options options,
                                           int steps = 4) {
  auto model = FullyShardedDataParallel(make(), pg, options);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(s, 8);
    opt.zero_grad(/*set_to_none=*/false);
    torch::mse_loss(model->forward(rank_slice(x, pg.rank(), pg.size())), rank_slice(y, pg.rank(), pg.size()))
        .backward();
    opt.step();
  }
  return full_params(model);
}

void prefetch_cases(comm::ProcessGroup& pg) {
  // Backward order of the MLP's units is 4, 2, 0 (reverse forward).
  run_case("backward-none", [&] {
    auto t = traced_iteration(pg, mlp_options(BackwardPrefetch::kNone, false));
    for (auto [cur, next] : {std::pair{"4", "2"}, std::pair{"2", "0"}}) {
      const auto& g = find_span(t, std::string("all_gather ") + next, /*last=*/true);
      EXPECT_GT(g.begin_seq, find_span(t, std::string("backward ") + cur).end_seq) << cur;
      // issued only when its own backward is reached: after `cur`'s reduction
      EXPECT_GT(g.begin_seq, find_span(t, std::string("reduce ") + cur).begin_seq) << cur;
    }
  });
  run_case("backward-pre", [&] {
    auto t = traced_iteration(pg, mlp_options(BackwardPrefetch::kBackwardPre, false));
    for (auto [cur, next] : {std::pair{"4", "2"}, std::pair{"2", "0"}}) {
      // the next unit's gather is issued before this unit's gradients are computed
      EXPECT_LT(find_span(t, std::string("all_gather ") + next, /*last=*/true).begin_seq,
                find_span(t, std::string("backward ") + cur).begin_seq) << cur;
    }
  });
  run_case("backward-post", [&] {
    auto t = traced_iteration(pg, mlp_options(BackwardPrefetch::kBackwardPost, false));
    for (auto [cur, next] : {std::pair{"4", "2"}, std::pair{"2", "0"}}) {
      const auto& g = find_span(t, std::string("all_gather ") + next, /*last=*/true);
      EXPECT_GT(g.begin_seq, find_span(t, std::string("backward ") + cur).end_seq) << cur;
      EXPECT_LT(g.begin_seq, find_span(t, std::string("reduce ") + cur).begin_seq) << cur;
    }
  });
  run_case("forward-prefetch", [&] {
    for (bool fp : {false, true}) {
      auto t = traced_iteration(pg, mlp_options(BackwardPrefetch::kNone, fp));
      for (auto [cur, next] : {std::pair{"0", "2"}, std::pair{"2", "4"}}) {
        const int64_t g = find_span(t, std::string("all_gather ") + next).begin_seq;
        const int64_t f = find_span(t, std::string("forward ") + cur).begin_seq;
        if (fp) EXPECT_LT(g, f) << cur;
        else EXPECT_GT(g, f) << cur;
      }
    }
  });
  run_case("trace-file-is-chrome-json", [&] {
    const std::string dir = worker_scratch_dir() + "/trace_env";  // run_ranks removes it
    ASSERT_EQ(::setenv("FSDP_TRACE", dir.c_str(), 1), 0);  // the environment route
    auto model = FullyShardedDataParallel(make_mlp(), pg, Options().auto_wrap_policy(always_wrap_policy()));
    ::unsetenv("FSDP_TRACE");
    auto [x, y] = global_batch(0, 8);
    torch::mse_loss(model->forward(rank_slice(x, pg.rank(), 2)), rank_slice(y, pg.rank(), 2)).backward();
    const std::string path = model->flush_trace();
    ASSERT_EQ(path, dir + "/trace_rank" + std::to_string(pg.rank()) + ".json");
    // 3 units x (forward, backward, reduce, 2 gathers) = 15 schedule events (tids 0-2);
    // on the phases track (tid 3) an issue and a wait per gather and per reduction, and a
    // flatten per reduced unit: 2 x 6 + 3 x 3 = 21.
    const std::string cmd =
        "\"${FSDP_PYTHON:-python3}\" -c \"import json,sys; d=json.load(open(sys.argv[1])); "
        "x=[e for e in d['traceEvents'] if e['ph']=='X']; "
        "s=[e for e in x if e['tid']<3]; p=[e for e in x if e['tid']==3]; "
        "n={e['name'].split()[0] for e in s}; m={e['name'].split()[0] for e in p}; "
        "sys.exit(0 if len(s)==15 and n=={'all_gather','reduce','forward','backward'} and len(p)==21 "
        "and m=={'issue_gather','wait_gather','flatten','issue_reduce','wait_reduce'} "
        "and all(e['dur']>=0 and e['pid']==" + std::to_string(pg.rank()) + " for e in x) else 3)\" " + path;
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  });
  run_case("phases", [&] {
    // The phases track (tid 3) with the optimizer inside backward: per unit, one flatten
    // after its backward, then the reduction's issue and wait, then its step; every
    // gather's issue and wait inside that gather's span.
    const auto t = traced_iteration(
        pg, mlp_options(BackwardPrefetch::kBackwardPre, false).optimizer_in_backward(true), /*step_in_backward=*/true);
    auto count = [&](const std::string& name) {
      int n = 0;
      for (const auto& s : t) n += s.name == name;
      return n;
    };
    for (std::string u : {"0", "2", "4"}) {
      for (const char* kind : {"flatten ", "issue_reduce ", "wait_reduce ", "step "}) {
        EXPECT_EQ(count(kind + u), 1) << kind << u;
        EXPECT_EQ(find_span(t, kind + u).tid, Tracer::kPhase) << kind << u;
      }
      const auto& flatten = find_span(t, "flatten " + u);
      const auto& issue = find_span(t, "issue_reduce " + u);
      const auto& wait = find_span(t, "wait_reduce " + u);
      EXPECT_GT(flatten.begin_seq, find_span(t, "backward " + u).end_seq) << u;
      EXPECT_GT(issue.begin_seq, flatten.end_seq) << u;
      EXPECT_GT(wait.begin_seq, issue.end_seq) << u;
      EXPECT_GT(find_span(t, "step " + u).begin_seq, wait.end_seq) << u;
      EXPECT_EQ(count("issue_gather " + u), count("all_gather " + u)) << u;
      EXPECT_EQ(count("wait_gather " + u), count("all_gather " + u)) << u;
    }
    int gathers = 0;
    const std::string gather = "all_gather ";
    for (size_t i = 0; i < t.size(); ++i) {
      if (t[i].name.rfind(gather, 0) != 0) continue;
      ++gathers;
      const std::string u = t[i].name.substr(gather.size());
      int inside = 0;  // this gather's issue and wait: the phases of u within its span
      for (const auto& s : t)
        if ((s.name == "issue_gather " + u || s.name == "wait_gather " + u) && s.begin_seq > t[i].begin_seq &&
            s.end_seq < t[i].end_seq)
          ++inside;
      EXPECT_EQ(inside, 2) << t[i].name;
    }
    EXPECT_GT(gathers, 0);
  });
  run_case("numbers-unchanged", [&] {
    auto mlp = [] { return make_mlp(); };
    auto tf = [] { return make_transformer(); };
    auto base = Options().sharding_strategy(ShardingStrategy::kFullShard);
    auto mlp_none = train(pg, mlp, Options(base).auto_wrap_policy(always_wrap_policy()));
    auto tf_none = train(pg, tf, Options(base).auto_wrap_policy(size_based_policy(100)));
    for (auto bp : {BackwardPrefetch::kBackwardPre, BackwardPrefetch::kBackwardPost}) {
      for (bool limit : {true, false}) {
        SCOPED_TRACE(std::string(to_string(bp)) + (limit ? " limited" : " unlimited"));
        auto m = train(pg, mlp, Options(base).auto_wrap_policy(always_wrap_policy()).backward_prefetch(bp)
                                    .forward_prefetch(true).limit_all_gathers(limit));
        auto t = train(pg, tf, Options(base).auto_wrap_policy(size_based_policy(100)).backward_prefetch(bp)
                                   .forward_prefetch(true).limit_all_gathers(limit));
        for (auto& [k, v] : mlp_none) EXPECT_TRUE(torch::equal(m.at(k), v)) << k;
        for (auto& [k, v] : tf_none) EXPECT_TRUE(torch::equal(t.at(k), v)) << k;
      }
    }
    // And against single-process training on the global batch.
    auto ref = make_transformer();
    torch::optim::AdamW opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int s = 0; s < 4; ++s) {
      auto [x, y] = global_batch(s, 8);
      opt.zero_grad(/*set_to_none=*/false);
      torch::mse_loss(ref->forward(x), y).backward();
      opt.step();
    }
    for (const auto& p : ref->named_parameters()) EXPECT_LT(rel_diff(tf_none.at(p.key()), p.value()), 1e-5);
  });
}

}  // namespace

TEST(FsdpPrefetch, TwoRanks) { run_ranks(2, prefetch_cases); }
