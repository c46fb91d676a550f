// See [Note: replica chain] in replica_chain.h.
#include "replica_chain.h"

#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

namespace fsdp::core::detail {

struct ReplicaChain::Link {
  // Set by push, then owned by the thread until `ready`.
  comm::CommHandle scatter;
  at::Tensor output;
  std::string label;
  Tracer::Mark mark;
  // Set by the thread before `ready`, read by scattered() after it (under State::mu).
  bool ready = false;
  comm::CommHandle replica;
  Tracer::Mark replica_mark;
  comm::CommPath scatter_path = comm::CommPath::kLocal;
  std::exception_ptr error;
};

struct ReplicaChain::State {
  comm::ProcessGroup replica_pg;
  std::mutex mu;
  std::condition_variable cv;            // queue non-empty / stop, and link ready
  std::deque<std::shared_ptr<Link>> queue;  // pushed, not yet taken by the thread
  bool stop = false;
  Tracer* tracer = nullptr;              // null once the chain is destroyed (under mu)
  std::exception_ptr failed;             // the first error: later links fail with it
  std::function<std::shared_ptr<void>()> on_stream;
};

ReplicaChain::ReplicaChain(comm::ProcessGroup replica_group, Tracer* tracer,
                           std::function<std::shared_ptr<void>()> on_stream)
    : state_(std::make_shared<State>()) {
  TORCH_INTERNAL_ASSERT(replica_group.defined() && replica_group.size() > 1);
  state_->replica_pg = std::move(replica_group);
  state_->tracer = tracer;
  state_->on_stream = std::move(on_stream);
  std::thread(run, state_).detach();  // shares only state_ (see "Shutdown" in the note)
}

ReplicaChain::~ReplicaChain() {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->stop = true;
  state_->tracer = nullptr;
  state_->cv.notify_all();
  // An idle thread exits at once; one blocked in a wait exits when the wait returns,
  // issuing nothing more (the queue is dropped with the state).
}

std::shared_ptr<ReplicaChain::Link> ReplicaChain::push(comm::CommHandle scatter, at::Tensor output,
                                                       const std::string& label, Tracer::Mark mark) {
  auto link = std::make_shared<Link>();
  link->scatter = std::move(scatter);
  link->output = std::move(output);
  link->label = label;
  link->mark = mark;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.push_back(link);
  }
  state_->cv.notify_all();
  return link;
}

comm::CommHandle ReplicaChain::scattered(Link& link, Tracer::Mark* mark, comm::CommPath* scatter_path) {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return link.ready; });
  if (link.error) std::rethrow_exception(link.error);
  *mark = link.replica_mark;
  *scatter_path = link.scatter_path;
  link.output = at::Tensor();  // the reducer's Reduction holds it
  return std::move(link.replica);
}

bool ReplicaChain::is_scattered(const Link& link) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return link.ready;
}

void ReplicaChain::run(std::shared_ptr<State> s) {
  // On a GPU the reduce-scatter stream, and with it its device, becomes this thread's current
  // one (a new thread starts on device 0, which on a host with several GPUs is another rank's).
  const std::shared_ptr<void> on_stream = s->on_stream ? s->on_stream() : nullptr;
  for (;;) {
    std::shared_ptr<Link> link;
    std::exception_ptr failed;
    {
      std::unique_lock<std::mutex> lock(s->mu);
      s->cv.wait(lock, [&] { return s->stop || !s->queue.empty(); });
      if (s->stop) return;  // what is queued belongs to a reducer that is gone
      link = std::move(s->queue.front());
      s->queue.pop_front();
      failed = s->failed;
    }
    comm::CommHandle replica;
    Tracer::Mark replica_mark;
    comm::CommPath path = link->scatter.path();
    std::exception_ptr error = failed;
    if (!error) {
      try {
        link->scatter.wait();
        link->scatter = comm::CommHandle();
        {
          std::lock_guard<std::mutex> lock(s->mu);
          if (s->stop) return;  // the reducer is gone: issue nothing more
          if (s->tracer) {
            s->tracer->end("reduce " + link->label, Tracer::kReduce, link->mark, comm::to_string(path));
            replica_mark = s->tracer->begin();
          }
        }
        // [Note: hybrid groups] in comm_context.h: the shard group summed these shards over
        // the shard group; summing them over the replica group completes the sum over
        // the world.
        replica = comm::all_reduce(s->replica_pg, link->output, comm::ReduceOp::kSum,
                                   {comm::Phase::kBackward, "replicas of " + link->label});
        replica.order_current_stream();
      } catch (...) {
        error = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(s->mu);
      if (error && !s->failed) s->failed = error;
      link->error = error;
      link->replica = std::move(replica);
      link->replica_mark = replica_mark;
      link->scatter_path = path;
      link->ready = true;
    }
    s->cv.notify_all();
  }
}

}  // namespace fsdp::core::detail
