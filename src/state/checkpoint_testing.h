#pragma once
// Internal to the library, for tests and benchmarks of the checkpoint layer
// (checkpoint.h; they have src/ on their include path): fault injection for
// crash-safety tests, the CRC-32 implementation and ZIP64 fields; not for training
// code. The library reads no environment variable for them: a test or benchmark binary
// sets them itself.
//
//     fsdp::state::detail::set_checkpoint_record_hook([](int64_t n) { if (n == 3) ::_exit(86); });

#include <cstdint>
#include <functional>

namespace fsdp::state::detail {

/// Called by save_checkpoint on this rank right after it writes a record, with
/// the number of records this rank has written in this save so far (1, 2, ...).
using CheckpointRecordHook = std::function<void(int64_t records_written)>;

/// Installs `hook` for every later save in this process (an empty function
/// removes it). Not thread-safe: set it before save_checkpoint runs.
void set_checkpoint_record_hook(CheckpointRecordHook hook);

/// Checksums with zlib's CRC-32 even when libdeflate's faster one is available
/// (same values; for comparing the two, e.g. bench_checkpoint under
/// FSDP_CKPT_ZLIB_CRC=1). Process-wide; set it before saving or loading.
void set_checkpoint_crc_zlib(bool on);

/// consolidate_checkpoint writes ZIP64 size, offset and end-of-directory fields
/// for every record even below 4 GiB, so tests can check that torch's readers
/// accept them without writing 4 GiB. Process-wide.
void set_consolidate_zip64_always(bool on);

/// The bytes a checkpoint writer stages from a device tensor at a time ([Note: staging
/// device tensors] in checkpoint_format.h; default 64 MiB), so that a test sees a record
/// cross several chunks without a large model. 0 restores the default. Process-wide; set
/// it before saving.
void set_checkpoint_staging_chunk_bytes(int64_t bytes);

/// Stages host tensors too, as device tensors are: the staging path's chunks and checksums
/// checked on a machine without a GPU (the files must come out byte for byte the same).
/// Process-wide; set it before saving.
void set_checkpoint_stage_host_tensors(bool on);

/// Off: checkpoint rank files are written through the page cache only, as where the file
/// system refuses O_DIRECT ([Note: direct writes] in direct_file.h); the files must come out
/// byte for byte the same. Process-wide; set it before saving.
void set_checkpoint_direct_io(bool on);

}  // namespace fsdp::state::detail
