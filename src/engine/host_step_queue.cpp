#include "host_step_queue.h"

#include <utility>

#include <ATen/Parallel.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace fsdp::engine {

std::shared_ptr<c10::Event> event_after_queued_work(const c10::Device& device) {
  if (device.is_cpu()) return nullptr;
  auto event = std::make_shared<c10::Event>(device.type());
  event->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  return event;
}

void make_device_current(const c10::Device& device) {
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl(device.type()).setDevice(device);
}

HostStepQueue::HostStepQueue(const c10::Device& device)
    : thread_([this, n = at::get_num_threads(), device] { run(n, device); }) {}

HostStepQueue::~HostStepQueue() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    idle_.wait(lock, [this] { return tasks_.empty() && !busy_; });
    stop_ = true;
  }
  work_.notify_one();
  thread_.join();
}

void HostStepQueue::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  work_.notify_one();
}

void HostStepQueue::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [this] { return tasks_.empty() && !busy_; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void HostStepQueue::run(int intra_op_threads, c10::Device device) {
  at::set_num_threads(intra_op_threads);
  make_device_current(device);
  torch::autograd::GradMode::set_enabled(false);  // a new thread starts with gradients on
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_
      task = std::move(tasks_.front());
      tasks_.pop_front();
      if (error_) {  // a step failed: the later ones are not taken
        if (tasks_.empty()) idle_.notify_all();
        continue;
      }
      busy_ = true;
    }
    std::exception_ptr failed;
    try {
      task();
    } catch (...) {
      failed = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
      if (failed && !error_) error_ = failed;
    }
    idle_.notify_all();
  }
}

}  // namespace fsdp::engine
