#include "reduction_window.h"

#include <utility>

#include <c10/util/Exception.h>

namespace fsdp::engine {

ReductionWindow::ReductionWindow(int max_in_flight, AfterComplete after)
    : max_in_flight_(max_in_flight), after_(std::move(after)) {}

void ReductionWindow::make_room() {
  while (full()) complete_oldest();
}

void ReductionWindow::push(std::unique_ptr<Reduction> r) {
  TORCH_INTERNAL_ASSERT(r && !full(), "a reduction was issued into a full window");
  in_flight_.push_back(std::move(r));
}

void ReductionWindow::complete_oldest() {
  TORCH_INTERNAL_ASSERT(!in_flight_.empty());
  // Out of the window before it completes: a delivery that issues the next collective
  // finds the room it frees.
  std::unique_ptr<Reduction> r = std::move(in_flight_.front());
  in_flight_.pop_front();
  r->complete();
  if (after_) after_(std::move(r));
}

void ReductionWindow::complete_landed() {
  while (oldest_landed()) complete_oldest();
}

void ReductionWindow::complete_all() {
  while (!in_flight_.empty()) complete_oldest();
}

int64_t ReductionWindow::held_bytes() const {
  int64_t n = 0;
  for (const auto& r : in_flight_) n += r->held_bytes();
  return n;
}

}  // namespace fsdp::engine
