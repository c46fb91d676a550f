#include "fsdp/trainer/progress.h"

#include <unistd.h>

namespace fsdp::trainer {

void format_duration(double seconds, char* out, size_t size) {
  long s = seconds < 0 ? 0 : long(seconds + 0.5);
  if (s >= 3600) std::snprintf(out, size, "%ldh%02ldm", s / 3600, (s % 3600) / 60);
  else if (s >= 60) std::snprintf(out, size, "%ldm%02lds", s / 60, s % 60);
  else std::snprintf(out, size, "%lds", s);
}

Progress::Progress(int64_t total_steps, bool enabled, int64_t first_step)
    : total_(total_steps), enabled_(enabled), tty_(isatty(STDERR_FILENO) == 1), first_step_(first_step),
      start_(std::chrono::steady_clock::now()) {}

void Progress::report(int64_t step, double loss, double samples_per_s) {
  if (!enabled_) return;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  // ETA from the average step time so far: steadier than the last interval's. The clock
  // started at construction, before step first_step_ + 1.
  const int64_t done = step - first_step_;
  const double eta = done > 0 ? elapsed / double(done) * double(total_ - step) : 0;
  char eta_s[32];
  format_duration(eta, eta_s, sizeof(eta_s));
  if (tty_) {
    constexpr int kWidth = 30;
    const int filled = int(kWidth * step / (total_ > 0 ? total_ : 1));
    char bar[kWidth + 1];
    for (int i = 0; i < kWidth; ++i) bar[i] = i < filled ? '#' : '.';
    bar[kWidth] = '\0';
    std::fprintf(stderr, "\r[%s] step %lld/%lld  loss %.4f  %.0f samples/s  ETA %s   ", bar, (long long)step,
                 (long long)total_, loss, samples_per_s, eta_s);
    bar_open_ = true;
  } else {
    std::fprintf(stderr, "step %lld/%lld  loss %.4f  %.0f samples/s  ETA %s\n", (long long)step, (long long)total_,
                 loss, samples_per_s, eta_s);
  }
  std::fflush(stderr);
}

void Progress::note(const char* line) {
  if (!enabled_) return;
  if (bar_open_) std::fputc('\n', stderr);
  bar_open_ = false;
  std::fprintf(stderr, "%s\n", line);
  std::fflush(stderr);
}

void Progress::finish() {
  if (enabled_ && bar_open_) std::fputc('\n', stderr);
  bar_open_ = false;
}

}  // namespace fsdp::trainer
