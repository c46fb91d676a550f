#pragma once
/// How fsdp::trainer::Trainer::fit() finds or starts its ranks.
///
/// [Note: trainer launch]
/// Under a launcher (torchrun / fsdp-run: RANK and WORLD_SIZE; srun: SLURM_PROCID;
/// mpirun: OMPI_COMM_WORLD_RANK) fit() joins that job (fsdp::comm::init_process_group).
/// Without one, fit() with devices > 1 *re-executes the program*: it replaces the
/// process (execv) by `fsdp-run --nproc <devices> -- /proc/self/exe <the same
/// arguments>`, so every rank runs main() from the start and everything before fit()
/// runs again in each rank, and the program's exit status is fsdp-run's (failing
/// fast when a rank fails). Lightning instead lets the launching process become rank
/// 0 and forks the others; that needs a process that is already a rank before the
/// others exist and a way to hand them the user's objects, and its rank 0 then
/// differs from the others in what ran before fit(). Re-execution keeps every rank
/// identical and reuses fsdp-run's supervision (prefixes, fail-fast, signals), at the
/// price that work done before fit() is repeated: build nothing expensive before it
/// that the ranks do not need (the model and datasets are factories for that reason).
/// devices == 1 runs in this process (world size 1, a private file store).
/// num_nodes > 1 without a launcher is an error: one process cannot start the
/// others' nodes.
///
/// Which fsdp-run. The program and fsdp-run agree on how ranks are started (arguments,
/// environment, the agent store), so the program re-executes only under the fsdp-run of
/// the build its library came from: `fsdp-run --version` prints the project version and
/// a build id (made once per build directory), and a different answer is refused,
/// naming both, rather than started. A program compiled against the installed
/// package looks in the installed bin directory first, so that it never depends on a
/// build tree that may since have moved on; one compiled in the build tree looks there.

#include <string>

namespace fsdp::trainer {

/// True if a launcher fsdp::comm understands set this process's placement.
bool under_launcher();

/// What `fsdp-run --version` of this library's own build prints (without the newline):
/// "fsdp-run <version> (build <id>)".
std::string launcher_version();

/// The fsdp-run to use: `explicit_path` if non-empty (must be executable); else the
/// first executable fsdp-run in `installed_bindir` (when non-empty: the program was
/// compiled against the installed package, see detail::installed_bindir in trainer.h)
/// and next to this executable, or next to this executable, in the library's build
/// directory and in its configured install directory; then on PATH. Throws c10::Error
/// saying where it looked when there is none, and naming both versions when the one
/// found is not of this library's build (launcher_version()).
std::string find_launcher(const std::string& explicit_path, const std::string& installed_bindir = "");

/// execv's `launcher --nproc nproc -- /proc/self/exe <this process's arguments>`.
/// Returns only by throwing c10::Error (execv failed).
[[noreturn]] void relaunch_under(const std::string& launcher, int nproc);

}  // namespace fsdp::trainer
