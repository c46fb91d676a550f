#include "agreed_failure.h"

#include <c10/util/Exception.h>

#include "comm/object_collectives.h"

namespace fsdp::state {

void throw_if_any_failed(const comm::ProcessGroup& pg, const std::string& error, const std::string& who,
                         const std::string& consequence) {
  const std::vector<std::string> errors = comm::all_gather_object(pg, error);
  for (size_t r = 0; r < errors.size(); ++r)
    TORCH_CHECK(errors[r].empty(), who, " (rank ", pg.rank(), "): rank ", r, " failed: ", errors[r], ". ",
                consequence);
}

}  // namespace fsdp::state
