#pragma once
/// fsdp::trainer::Trainer: bring your own model and data; the Trainer runs the
/// sharded training loop (Lightning's Trainer with its FSDP strategy, in C++).
///
///     using namespace fsdp::trainer;
///     Trainer<NetImpl> trainer(TrainerOptions()
///         .strategy(Strategy(StrategyKind::kFullShard).fsdp(
///             fsdp::Options().auto_wrap_policy(fsdp::module_type_policy<BlockImpl>())))
///         .max_epochs(3).global_batch_size(64).devices(2)
///         .checkpoint_dir("ckpt").resume("auto").metrics_file("metrics.jsonl"));
///     trainer.model([] { return Net(256, 8); })          // built inside ShardedInitContext
///         .optimizer([](std::vector<torch::Tensor> p) {   // over the sharded parameters
///           return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-3));
///         })
///         .train_data(MyDataset("train.csv"))             // any torch::data dataset
///         .val_data(MyDataset("val.csv"))
///         .training_step([](auto& model, torch::data::Example<>& b) {
///           return torch::cross_entropy_loss(model.forward(b.data), b.target);  // mean
///         })
///         .validation_step([](Trainer<NetImpl>::Model& model, torch::data::Example<>& b) {
///           torch::Tensor logits = model.forward(b.data);
///           return std::map<std::string, double>{
///               {"loss", torch::cross_entropy_loss(logits, b.target).item<double>()},
///               {"accuracy", logits.argmax(1).eq(b.target).to(torch::kDouble).mean().item<double>()}};
///         });
///     trainer.fit();   // no launcher: re-executes the program as 2 ranks (see launch.h)
///
/// Types. The Trainer is a template over the model's Impl (so that the steps call
/// its typed forward) and the batch type (default torch::data::Example<>). The steps
/// receive the model as `Trainer<Impl>::Model&` (TrainerModel<Impl> below). A generic
/// lambda (`auto& model`) works too, but there what forward returns has a dependent
/// type: a member template of it needs `.template` (`loss.template item<double>()`),
/// or name the type first (`torch::Tensor logits = model.forward(x)`). Datasets
/// are type-erased into "the batch of these sample indices": a torch::data dataset
/// with any example type is fetched through its get_batch() and turned into a Batch
/// by a collate function (default: stack data and targets of Example<>; a dataset
/// mapped through Stack<> is taken as is). Only this glue is instantiated in the
/// user's translation unit; the loop (training_loop.h) is compiled once in the
/// library. Templating the whole loop on the dataset would recompile it, with
/// <torch/torch.h>, in every program that uses it.
///
/// What each step sees. The training step gets this rank's part of one micro-batch
/// (see [Note: global batches] in global_sampler.h) and returns the *mean* loss over
/// its samples; the Trainer weights it by the part's share of the global batch
/// (1/k with k equal micro-batches) and calls backward. Because FSDP's forward and
/// backward are collective, a rank whose part of a short last batch is empty still
/// runs the step, on the batch's first sample, with weight 0. The validation step
/// returns means per key over its part (run under NoGradGuard); the Trainer reduces
/// them over ranks weighted by counts. Every rank must return the same keys.
///
/// Determinism and resume. Each rank seeds torch's CPU generator with `seed` before
/// the model factory (identical initial weights). A checkpoint holds the model,
/// optimizer state (and learning rates), the step (the data position: batches are a
/// pure function of seed, epoch and step), every rank's torch CPU generator state,
/// and what callbacks add in on_save_checkpoint. An LR scheduler is restored by
/// replaying its step() once per step done before the optimizer's state (and so its
/// learning rates) is loaded: libtorch 1.13's LRScheduler keeps only a step counter.
/// Resuming at the same world size and strategy continues bit for bit; at another
/// world size or strategy the same samples meet in each step and the sums differ
/// only in rounding, except that random draws inside the model (dropout) then start
/// from rank 0's generator state on every rank and differ from the uninterrupted run.
/// There is no loss scaler on CPU (bf16 needs none), so there is no scaler state.
/// Under TrainerOptions::device "cuda" the checkpoint is the same (host bytes: it resumes
/// on CPU ranks, and a CPU run's on GPU ranks); the CUDA generators' states are not in it,
/// so random draws on the GPU after a resume differ from the uninterrupted run.
///
/// Metrics (metrics_file, JSON lines, rank 0, flushed per line):
///   {"step","epoch","loss","samples","lr","samples_per_s","memory":{"param_bytes",
///    "grad_bytes","optim_bytes","unsharded_peak_bytes","rss_bytes"}}
///   {"step","validation":{<key>: <value>, ...},"samples"}
/// Progress, validation results and the memory summary go to stderr (rank 0), so
/// stdout stays the program's. The memory summary (end of fit) prints each rank's parameter, gradient
/// and optimizer-state bytes next to what unsharded Adam training holds (16 B per
/// parameter) and the ZeRO estimate for the strategy (bf16-aware under zero1/zero2).
/// The file format, the progress lines, the table and the checkpoint directory are
/// public pieces a hand-written loop can reuse (metrics_log.h, progress.h,
/// memory_summary.h, checkpoint_dir.h). fsdp-train runs this loop itself
/// (run_training_loop in training_loop.h) with its own model, optimizer, batch sampler,
/// validation loop and resume check: the hooks batch_sampler, validation_loop and
/// resume_check below.

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#include <ATen/Parallel.h>
#include <c10/util/ArrayRef.h>
#include <torch/data/example.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/utils.h>

#include "fsdp/comm/process_group.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/sharded_init.h"
#include "fsdp/optim/zero_redundancy_optimizer.h"
#include "fsdp/trainer/callback.h"
#include "fsdp/trainer/fit_result.h"
#include "fsdp/trainer/launch.h"
#include "fsdp/trainer/trainer_options.h"
#include "fsdp/trainer/training_loop.h"

namespace fsdp::trainer {

template <typename ModelImpl, typename Batch>
class Trainer;

/// The model as the user's steps see it: forward() goes through the FSDP wrapper
/// (the collective gathers) or straight to the module under zero1/zero2.
template <typename Impl>
class TrainerModel {
 public:
  template <typename... Args>
  auto forward(Args&&... args) {
    if (wrapper_) return wrapper_->forward(std::forward<Args>(args)...);
    return module_->forward(std::forward<Args>(args)...);
  }
  /// The user's module. Under FSDP its parameters are this rank's pieces outside
  /// forward; use fsdp::apply_with_full_params(*fsdp(), fn) to see full values.
  const std::shared_ptr<Impl>& module() const { return module_; }
  /// The FSDP wrapper, or nullptr under zero1/zero2.
  FullyShardedDataParallelImpl<Impl>* fsdp() const { return wrapper_.get(); }
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  /// Whether this is the forward of a training step (false in the validation step).
  bool training() const { return module_->is_training(); }

 private:
  template <typename, typename>
  friend class Trainer;
  std::shared_ptr<Impl> module_;
  std::shared_ptr<FullyShardedDataParallelImpl<Impl>> wrapper_;
  torch::optim::Optimizer* optimizer_ = nullptr;
};

namespace detail {

template <typename Impl>
std::shared_ptr<Impl> as_module_ptr(std::shared_ptr<Impl> p) {
  return p;
}
template <typename Impl>
std::shared_ptr<Impl> as_module_ptr(torch::nn::ModuleHolder<Impl> h) {
  return h.ptr();
}

/// Default collate: a vector of Example<> stacked into one Example<>; an already
/// stacked batch (a dataset mapped through torch::data::transforms::Stack<>) as is.
inline torch::data::Example<> default_collate(std::vector<torch::data::Example<>> examples) {
  std::vector<at::Tensor> data, target;
  data.reserve(examples.size());
  target.reserve(examples.size());
  for (auto& e : examples) {
    data.push_back(std::move(e.data));
    target.push_back(std::move(e.target));
  }
  return {at::stack(data), at::stack(target)};
}
inline torch::data::Example<> default_collate(torch::data::Example<> batch) { return batch; }

/// The installed package's bin directory when this program was compiled against it
/// (its exported targets define FSDP_INSTALLED_BINDIR), "" when compiled against a
/// build tree: where fit() looks for fsdp-run first ([Note: trainer launch]). Read in
/// the program's own translation unit, since the library cannot tell how it was found.
inline std::string installed_bindir() {
#ifdef FSDP_INSTALLED_BINDIR
  return FSDP_INSTALLED_BINDIR;
#else
  return "";
#endif
}

/// "3, 17, 4" (at most 8, then "...").
inline std::string index_list(const std::vector<int64_t>& indices) {
  std::string out;
  for (size_t i = 0; i < indices.size() && i < 8; ++i) out += (i ? ", " : "") + std::to_string(indices[i]);
  return indices.size() > 8 ? out + ", ..." : out;
}

/// For a batch that did not collate: which sample (by dataset index) differs in shape
/// from the batch's first, e.g. "dataset index 7 has data of shape [5] where dataset
/// index 4 (the batch's first) has [4]"; "" if none does or the examples are not Example<>.
inline std::string shape_mismatch(const std::vector<torch::data::Example<>>& examples,
                                  const std::vector<int64_t>& indices) {
  auto shape = [](const at::Tensor& t) { return t.defined() ? c10::str(t.sizes()) : std::string("(undefined)"); };
  for (size_t j = 1; j < examples.size() && j < indices.size(); ++j) {
    for (const char* part : {"data", "target"}) {
      const bool data = part[0] == 'd';
      const std::string first = shape(data ? examples[0].data : examples[0].target);
      const std::string here = shape(data ? examples[j].data : examples[j].target);
      if (here != first)
        return "dataset index " + std::to_string(indices[j]) + " has " + part + " of shape " + here +
               " where dataset index " + std::to_string(indices[0]) + " (the batch's first) has " + first;
    }
  }
  return "";
}
template <typename Examples>
std::string shape_mismatch(const Examples&, const std::vector<int64_t>&) {
  return "";
}

template <typename Dataset>
int64_t dataset_size(const Dataset& d) {
  auto n = d.size();
  TORCH_CHECK(n.has_value(), "fsdp::Trainer: the dataset has no size(); the global sampler needs a map-style "
              "dataset of known size");
  return static_cast<int64_t>(*n);
}

}  // namespace detail

template <typename ModelImpl, typename Batch = torch::data::Example<>>
class Trainer {
 public:
  using Model = TrainerModel<ModelImpl>;
  /// Builds the optimizer over the parameters the Trainer trains (FSDP: this rank's
  /// pieces; zero1/zero2: this rank's pieces of its partition). torch::optim
  /// optimizers (not LBFGS) and fsdp::optim::CPUAdam.
  using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;
  using SchedulerFactory = std::function<std::unique_ptr<torch::optim::LRScheduler>(torch::optim::Optimizer&)>;
  using TrainingStep = std::function<at::Tensor(Model&, Batch&)>;
  using ValidationStep = std::function<std::map<std::string, double>(Model&, Batch&)>;
  /// The batch of samples `indices` (the type-erased form of a dataset).
  using BatchFn = std::function<Batch(const std::vector<int64_t>& indices)>;
  /// Global step (0-based, from the run's start) -> the sample indices of its global batch.
  using BatchSampler = std::function<std::vector<int64_t>(int64_t step)>;
  /// A whole validation of one's own (collective): the global metrics after step `step`.
  using ValidationLoop = std::function<ValidationMetrics(Model&, const comm::ProcessGroup&, int64_t step)>;
  /// Moves a batch to the training device (see batch_to_device).
  using BatchToDevice = std::function<void(Batch&, const torch::Device&)>;
  /// "" if a checkpoint's extra values continue this run, else why not (see resume_check).
  using ResumeCheck = std::function<std::string(const std::string& dir, const std::map<std::string, std::string>&)>;

  explicit Trainer(TrainerOptions options = {}) : options_(std::move(options)) {}

  TrainerOptions& options() { return options_; }

  /// `factory()` returns the model (a ModuleHolder or a shared_ptr<ModelImpl>). It
  /// runs on every rank after torch::manual_seed(seed), inside an
  /// fsdp::ShardedInitContext when the strategy shards parameters
  /// (Strategy::sharded_construction).
  template <typename F>
  Trainer& model(F factory) {
    model_factory_ = [factory]() { return detail::as_module_ptr(factory()); };
    return *this;
  }
  Trainer& optimizer(OptimizerFactory factory) {
    optimizer_factory_ = std::move(factory);
    return *this;
  }
  /// Stepped once after every optimizer step.
  Trainer& lr_scheduler(SchedulerFactory factory) {
    scheduler_factory_ = std::move(factory);
    return *this;
  }
  /// A torch::data map-style dataset; `collate` turns its get_batch() result
  /// (std::vector<ExampleType>, or the mapped batch type) into a Batch.
  template <typename Dataset, typename Collate>
  Trainer& train_data(Dataset dataset, Collate collate) {
    std::tie(train_size_, train_batch_) = erase(std::move(dataset), std::move(collate), "training set");
    return *this;
  }
  template <typename Dataset>
  Trainer& train_data(Dataset dataset) {
    return train_data(std::move(dataset), [](auto b) { return detail::default_collate(std::move(b)); });
  }
  Trainer& train_data(int64_t size, BatchFn batch) {
    train_size_ = size;
    train_batch_ = std::move(batch);
    return *this;
  }
  template <typename Dataset, typename Collate>
  Trainer& val_data(Dataset dataset, Collate collate) {
    std::tie(val_size_, val_batch_) = erase(std::move(dataset), std::move(collate), "validation set");
    return *this;
  }
  template <typename Dataset>
  Trainer& val_data(Dataset dataset) {
    return val_data(std::move(dataset), [](auto b) { return detail::default_collate(std::move(b)); });
  }
  Trainer& val_data(int64_t size, BatchFn batch) {
    val_size_ = size;
    val_batch_ = std::move(batch);
    return *this;
  }
  /// Returns the mean loss over the batch it is given (see the header comment).
  Trainer& training_step(TrainingStep step) {
    training_step_ = std::move(step);
    return *this;
  }
  Trainer& validation_step(ValidationStep step) {
    validation_step_ = std::move(step);
    return *this;
  }
  /// Which samples meet in each step, instead of the GlobalSampler's shuffled epochs
  /// (torch's batch_sampler): `sampler(step)` returns the indices of step `step`'s
  /// global batch, the same on every rank and a pure function of the step (a resumed
  /// run asks for the steps after its checkpoint only). The Trainer still cuts each
  /// batch into micro-batches and contiguous rank parts ([Note: global batches], steps
  /// 3-4). `steps_per_epoch` counts epochs for max_epochs and the metrics. A sampler of
  /// its own is not recorded in checkpoints: record what fixes it in
  /// Callback::on_save_checkpoint and refuse a mismatch with resume_check.
  Trainer& batch_sampler(int64_t steps_per_epoch, BatchSampler sampler) {
    sampler_steps_per_epoch_ = steps_per_epoch;
    batch_sampler_ = std::move(sampler);
    return *this;
  }
  /// Validation of one's own instead of val_data + validation_step: `loop(model, pg,
  /// step)` runs on every rank when a validation is due (val_check_interval, and after
  /// the last step), with the module in eval() and under NoGradGuard, and returns the
  /// global metrics (it reduces over `pg` itself): for metrics that are not means of
  /// per-batch means, or a slicing of the validation set of its own.
  Trainer& validation_loop(ValidationLoop loop) {
    validation_loop_ = std::move(loop);
    return *this;
  }
  /// Checks a checkpoint's extra values (on_save_checkpoint's included) before resuming
  /// from it, before the Trainer's own data-order check: a refused checkpoint is
  /// skipped under resume("auto") with the message, and fails an explicit resume.
  Trainer& resume_check(ResumeCheck check) {
    resume_check_ = std::move(check);
    return *this;
  }
  /// How a batch moves to the training device under TrainerOptions::device "cuda": `fn(batch,
  /// device)` moves its tensors in place, before the training or validation step sees it.
  /// Needed for a Batch type other than torch::data::Example<> (whose data and target the
  /// Trainer moves itself); not called under "cpu".
  Trainer& batch_to_device(BatchToDevice fn) {
    batch_to_device_ = std::move(fn);
    return *this;
  }
  Trainer& callback(std::shared_ptr<Callback> cb) {
    callbacks_.push_back(std::move(cb));
    return *this;
  }

  /// Starts or joins the ranks ([Note: trainer launch] in launch.h), then trains.
  /// Without a launcher and with devices > 1 this call does not return: the process
  /// becomes fsdp-run, which runs the program again as the ranks.
  FitResult fit() {
    // Not under a launcher the world size is ours to choose: check it once, here, before
    // any rank starts; under one, fit(pg) checks it on every rank.
    const std::string err =
        trainer_options_error(options_, parts(), under_launcher() ? 0 : std::max(options_.devices(), 1));
    TORCH_CHECK(err.empty(), "fsdp::Trainer: ", err);
    // A machine without the device fails here, before any rank starts.
    const std::string device_err = device_error(options_);
    TORCH_CHECK(device_err.empty(), "fsdp::Trainer: ", device_err);
    comm::InitOptions init = comm::InitOptions().timeout(options_.timeout());
    scratch_.clear();
    if (!under_launcher()) {
      TORCH_CHECK(options_.num_nodes() == 1, "fsdp::Trainer: num_nodes ", options_.num_nodes(),
                  " but no launcher started this process; one process cannot start other nodes: run "
                  "`fsdp-run --nnodes ",
                  options_.num_nodes(), " --node-rank R --master-addr A --nproc-per-node ",
                  std::max(options_.devices(), 1), " -- PROGRAM` on every node (or torchrun / srun)");
      // A wrong resume path is found here, before any rank starts.
      const std::string resume_err = resume_path_error(options_);
      TORCH_CHECK(resume_err.empty(), "fsdp::Trainer: ", resume_err);
      if (options_.devices() > 1)
        relaunch_under(find_launcher(options_.launcher(), detail::installed_bindir()), options_.devices());
      // One process: a private file store, so no port is taken.
      scratch_ = std::filesystem::temp_directory_path() /
                 ("fsdp_trainer_" + std::to_string(::getpid()) + "_store");
      std::filesystem::remove(scratch_);
      init.file_store_path(scratch_.string());
    }
    // The private store's file goes when fit ends, also by an exception.
    struct RemoveStore {
      std::filesystem::path path;
      ~RemoveStore() {
        std::error_code ec;
        if (!path.empty()) std::filesystem::remove(path, ec);
      }
    } remove_store{scratch_};
    comm::ProcessGroup pg = comm::init_process_group(init);
    if (options_.devices() > 0 && under_launcher())
      TORCH_CHECK(pg.local_world_size() == options_.devices() && pg.size() == options_.devices() * options_.num_nodes(),
                  "fsdp::Trainer (rank ", pg.rank(), "): devices ", options_.devices(), " x num_nodes ",
                  options_.num_nodes(), " but the launcher started ", pg.local_world_size(),
                  " ranks per node and ", pg.size(), " in all; make them agree, or leave devices at 0 (auto)");
    return fit(pg);
  }

  /// Trains on an existing process group (tests, programs that make their own).
  FitResult fit(comm::ProcessGroup pg) {
    const std::string err = trainer_options_error(options_, parts(), pg.size());
    TORCH_CHECK(err.empty(), "fsdp::Trainer (rank ", pg.rank(), "): ", err);
    const std::string device_err = device_error(options_);
    TORCH_CHECK(device_err.empty(), "fsdp::Trainer (rank ", pg.rank(), "): ", device_err);
    device_ = training_device(options_, pg);
    if (options_.threads() > 0) at::set_num_threads(options_.threads());
    const LoopModel lm = build(pg);
    LoopData data;
    data.train_size = train_size_;
    data.val_size = val_batch_ ? val_size_ : 0;
    data.train_step = [this](const std::vector<int64_t>& indices) {
      Batch b = train_batch_(indices);
      to_device(b);
      return training_step_(*model_, b);
    };
    if (validation_step_)
      data.validation_step = [this](const std::vector<int64_t>& indices) {
        Batch b = val_batch_(indices);
        to_device(b);
        return validation_step_(*model_, b);
      };
    if (validation_loop_)
      data.validation_loop = [this, &pg](int64_t step) { return validation_loop_(*model_, pg, step); };
    data.batch_indices = batch_sampler_;
    data.steps_per_epoch = sampler_steps_per_epoch_;
    data.resume_check = resume_check_;
    return run_training_loop(options_, pg, lm, data, callbacks_);
  }

  /// The model of the last fit() (sharded as trained); nullptr before.
  Model* trained_model() { return model_.get(); }

 private:
  TrainerParts parts() const {
    TrainerParts p;
    p.model = bool(model_factory_);
    p.optimizer = bool(optimizer_factory_);
    p.training_step = bool(training_step_);
    p.train_data = bool(train_batch_);
    p.val_data = bool(val_batch_);
    p.validation_step = bool(validation_step_);
    p.validation_loop = bool(validation_loop_);
    p.batch_sampler = bool(batch_sampler_);
    p.sampler_steps_per_epoch = sampler_steps_per_epoch_;
    p.train_size = train_size_;
    p.val_size = val_size_;
    p.batch_to_device = std::is_same_v<Batch, torch::data::Example<>> || bool(batch_to_device_);
    return p;
  }

  /// The batch on the training device (device_): as is on the CPU.
  void to_device(Batch& b) const {
    if (device_.is_cpu()) return;
    if (batch_to_device_) {
      batch_to_device_(b, device_);
      return;
    }
    if constexpr (std::is_same_v<Batch, torch::data::Example<>>) {
      b.data = b.data.to(device_);
      if (b.target.defined()) b.target = b.target.to(device_);
    } else {
      TORCH_INTERNAL_ASSERT(false, "trainer_options_error lets no other batch type reach a device without "
                            "batch_to_device");
    }
  }

  /// `which` names the dataset in errors ("training set").
  template <typename Dataset, typename Collate>
  static std::pair<int64_t, BatchFn> erase(Dataset dataset, Collate collate, const char* which) {
    // A stream dataset (BatchRequestType size_t: "the next n examples") has no sample
    // indices, so the global batch of a step could not be the same at every world size
    // and a resume could not find its place.
    static_assert(std::is_same_v<typename Dataset::BatchRequestType, c10::ArrayRef<size_t>>,
                  "fsdp::Trainer needs a map-style torch::data dataset (get(index), size()); for a "
                  "stream dataset, pass train_data(size, batch_of_indices_fn) instead");
    auto d = std::make_shared<Dataset>(std::move(dataset));
    const int64_t n = detail::dataset_size(*d);
    BatchFn fn = [d, collate, which](const std::vector<int64_t>& indices) -> Batch {
      std::vector<size_t> idx(indices.begin(), indices.end());
      try {
        return collate(d->get_batch(c10::ArrayRef<size_t>(idx)));
      } catch (c10::Error& e) {
        // torch names the sample by its place in the batch ("at entry 7"); the user knows
        // it by its dataset index. Fetched again to see the shapes: only on this path.
        const std::string odd = detail::shape_mismatch(d->get_batch(c10::ArrayRef<size_t>(idx)), indices);
        TORCH_CHECK(odd.empty(), "fsdp::Trainer: the ", which, "'s samples do not stack into a batch: ", odd,
                    "; make every sample the same shape, or give the dataset a collate function that pads "
                    "(train_data / val_data(dataset, collate)) (torch: ", e.msg(), ")");
        TORCH_RETHROW(e, "fsdp::Trainer: collating the ", which, "'s samples at dataset indices ",
                      detail::index_list(indices));
      }
    };
    return {n, std::move(fn)};
  }

  LoopModel build(const comm::ProcessGroup& pg) {
    // Same seed on every rank right before the model is built: identical initial
    // weights without a broadcast.
    torch::manual_seed(options_.seed());
    const Strategy& st = options_.strategy();
    scheduler_.reset();
    optimizer_.reset();
    model_ = std::make_unique<Model>();
    LoopModel lm;
    auto count = [](const torch::nn::Module& m) {
      int64_t n = 0;
      for (const auto& p : m.parameters()) n += p.numel();
      return n;
    };
    // The contract of FSDP and ZeRO on a device: the model is there before it is wrapped or
    // handed to the ZeRO optimizer (whose flat buffers and partitions follow it).
    auto place = [this] {
      if (!device_.is_cpu()) model_->module_->to(device_);
    };
    if (st.is_zero()) {
      model_->module_ = model_factory_();
      place();
      lm.num_params = count(*model_->module_);
      lm.module = model_->module_.get();
      optim::ZeroOptions zo = st.zero();
      zo.process_group(pg)
          .stage(st.zero_stage())
          .module(model_->module_)
          .clip_grad_norm(options_.gradient_clip_val());
      OptimizerFactory user = optimizer_factory_;
      auto inner = [user](std::vector<torch::optim::OptimizerParamGroup> groups) {
        TORCH_INTERNAL_ASSERT(groups.size() == 1, "one parameter group given, ", groups.size(), " back");
        return user(groups[0].params());
      };
      auto zero = std::make_unique<optim::ZeroRedundancyOptimizer>(model_->module_->parameters(), inner, zo);
      lm.zero = zero.get();
      optimizer_ = std::move(zero);
    } else {
      const fsdp::Options fo = st.resolved_fsdp();
      // Without a wrap policy the model is one unit, complete only when the factory
      // returns: nothing to shard during construction (ShardedInitContext refuses it).
      // Sharded construction shards on the CPU: a model bound for a GPU is built whole,
      // moved, then wrapped (TrainerOptions::device).
      if (device_.is_cpu() && st.sharded_construction() && fo.sharding_strategy() != ShardingStrategy::kNoShard &&
          fo.auto_wrap_policy()) {
        ShardedInitContext sharded_init(pg, fo);
        model_->module_ = model_factory_();
      } else {
        model_->module_ = model_factory_();
        place();
      }
      lm.num_params = count(*model_->module_);
      model_->wrapper_ = std::make_shared<FullyShardedDataParallelImpl<ModelImpl>>(model_->module_, pg, fo);
      lm.fsdp = model_->wrapper_.get();
      // The user's module itself: the one handle train()/eval() and the parameter
      // counts use under both families (ZeRO has no wrapper).
      lm.module = model_->module_.get();
      optimizer_ = optimizer_factory_(model_->wrapper_->parameters());
    }
    if (options_.activation_checkpointing())
      apply_activation_checkpointing(*model_->module_, options_.activation_checkpointing());
    TORCH_CHECK(optimizer_, "fsdp::Trainer: the optimizer factory returned nullptr");
    model_->optimizer_ = optimizer_.get();
    lm.optimizer = optimizer_.get();
    if (scheduler_factory_) {
      scheduler_ = scheduler_factory_(*optimizer_);
      lm.scheduler = scheduler_.get();
    }
    return lm;
  }

  TrainerOptions options_;
  std::function<std::shared_ptr<ModelImpl>()> model_factory_;
  OptimizerFactory optimizer_factory_;
  SchedulerFactory scheduler_factory_;
  int64_t train_size_ = 0, val_size_ = 0;
  BatchFn train_batch_, val_batch_;
  TrainingStep training_step_;
  ValidationStep validation_step_;
  BatchSampler batch_sampler_;
  int64_t sampler_steps_per_epoch_ = 0;
  ValidationLoop validation_loop_;
  ResumeCheck resume_check_;
  BatchToDevice batch_to_device_;
  std::vector<std::shared_ptr<Callback>> callbacks_;
  std::filesystem::path scratch_;
  /// Where the last fit() trains (TrainerOptions::device on this rank).
  torch::Device device_ = torch::kCPU;

  // What the last fit() built; the scheduler refers to the optimizer, which refers
  // to the model's parameters: destroyed in reverse order.
  std::unique_ptr<Model> model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<torch::optim::LRScheduler> scheduler_;
};

}  // namespace fsdp::trainer
