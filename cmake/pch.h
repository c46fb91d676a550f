// The one precompiled header of the project (see CMakeLists.txt; the tests build it once
// more at their own optimization level, tests/CMakeLists.txt). Only heavy, stable
// third-party headers belong here; never the project's own.
#pragma once
#include <torch/torch.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
