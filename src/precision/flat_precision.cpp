#include "flat_precision.h"

namespace fsdp::precision {

FlatPrecision unit_precision(const MixedPrecision& mp, at::ScalarType param_dtype, bool full_precision_unit) {
  FlatPrecision precision;
  if (full_precision_unit) return precision;
  precision.param_dtype = mp.param_dtype();
  precision.reduce_dtype = mp.effective_reduce_dtype(param_dtype);
  precision.keep_low_precision_grads = mp.keep_low_precision_grads();
  return precision;
}

}  // namespace fsdp::precision
