#pragma once
/// Fault injection for crash-safety tests of save_checkpoint (checkpoint.h);
/// not for training code. The library reads no environment variable for it:
/// a test binary (or a tool's main) installs the hook itself.
///
///     fsdp::detail::set_checkpoint_record_hook([](int64_t n) { if (n == 3) ::_exit(86); });

#include <cstdint>
#include <functional>

namespace fsdp::detail {

/// Called by save_checkpoint on this rank right after it writes a record, with
/// the number of records this rank has written in this save so far (1, 2, ...).
using CheckpointRecordHook = std::function<void(int64_t records_written)>;

/// Installs `hook` for every later save in this process (an empty function
/// removes it). Not thread-safe: set it before save_checkpoint runs.
void set_checkpoint_record_hook(CheckpointRecordHook hook);

}  // namespace fsdp::detail
