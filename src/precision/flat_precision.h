#pragma once
// The dtypes of one FSDP unit under a MixedPrecision policy: what its unsharded buffer computes
// and gathers in, what its flat gradient is reduced in, and whether its gradient pieces stay
// in low precision ([Note: mixed precision] in src/core/flat_param.h).
#include <optional>

#include <c10/core/ScalarType.h>

#include "fsdp/precision/mixed_precision.h"

namespace fsdp::precision {

/// Dtypes of one unit (unset: the parameters' own dtype).
struct FlatPrecision {
  std::optional<at::ScalarType> param_dtype;   // unsharded buffer: compute and all-gather
  std::optional<at::ScalarType> reduce_dtype;  // flat gradient: reduction
  bool keep_low_precision_grads = false;       // gradient pieces in param_dtype
};

/// A unit's dtypes: none for a full-precision unit (a BatchNorm kept in the model's dtype),
/// else the policy's, the reduce dtype resolved against the parameters' `param_dtype`.
FlatPrecision unit_precision(const MixedPrecision& mp, at::ScalarType param_dtype, bool full_precision_unit);

}  // namespace fsdp::precision
