#pragma once
/// Deprecated path: fsdp::MixedPrecision lives in the precision layer now,
/// "fsdp/precision/mixed_precision.h" (CHANGELOG.md). This header forwards to it.
#include "fsdp/precision/mixed_precision.h"
