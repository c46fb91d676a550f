// See row_sum.h.
#include "row_sum.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "comm/kernels/row_sum_kernel.h"

namespace fsdp::comm::detail {

void sum_rows_into(at::Tensor acc, const std::vector<at::Tensor>& rows) {
  const auto dtype = acc.scalar_type();
  if (dtype == at::kFloat || dtype == at::kDouble) {
    const int threads = at::get_num_threads();
    AT_DISPATCH_FLOATING_TYPES(dtype, "sum_rows_into", [&] {
      std::vector<const scalar_t*> ptrs;
      ptrs.reserve(rows.size());
      for (const auto& r : rows) ptrs.push_back(r.data_ptr<scalar_t>());
      kernels::sum_rows(acc.data_ptr<scalar_t>(), ptrs.data(), static_cast<int>(ptrs.size()),
                        acc.numel(), threads);
    });
    return;
  }
  at::add_out(acc, rows[0], rows[1]);
  for (size_t p = 2; p < rows.size(); ++p) acc.add_(rows[p]);
}

}  // namespace fsdp::comm::detail
