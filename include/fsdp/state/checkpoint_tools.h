#pragma once
/// Offline tools on checkpoint directories (no process group needed); the
/// `fsdp-ckpt` executable is a thin command line over these.

#include <string>

namespace fsdp {

/// Human-readable summary of a checkpoint directory: world size, strategy,
/// optimizer, extras, every item (name, kind, shape, dtype, bytes) and every
/// file (size, and with `verify` its whole-file CRC-32 status). Sets `*ok` to
/// false when a file is missing, truncated or fails its checksum.
std::string inspect_checkpoint(const std::string& dir, bool verify, bool* ok = nullptr);

/// Writes the full model state dict (parameters and buffers, full shapes, by
/// their names in the unwrapped model) held in checkpoint `dir` to `out` as a
/// plain dict of tensors that Python's torch.load reads (torch.save's zip
/// layout, stored, 64-byte aligned). Streams: every item goes from its records
/// to the archive through one buffer of 1 MiB (or the largest item, if
/// smaller), so peak memory is that buffer plus a constant. Every record's CRC
/// is checked; the file is written as `out`.tmp, fsync'd and renamed to `out`,
/// so a failed consolidate leaves no partial `out`.
void consolidate_checkpoint(const std::string& dir, const std::string& out);

}  // namespace fsdp
