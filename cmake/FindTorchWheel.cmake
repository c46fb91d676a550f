# libtorch from the torch wheel of a Python (scripts/bootstrap.sh installs a pinned one into
# the checkout's .venv). A plain `cmake -S . -B build` finds it; on machines with PyTorch
# preinstalled, -DFSDP_PYTHON=python3 picks that one instead.
#
# Sets FSDP_PYTHON_EXECUTABLE (the interpreter, absolute), FSDP_TORCH_VERSION (e.g. 2.11.0+cu130), FSDP_TORCH_LIB_DIR (the wheel's torch/lib) and
# FSDP_TORCH_CUDA (ON when the wheel's libtorch was built with CUDA), FSDP_TORCH_CUDA_LIB_DIRS
# (the wheel's nvidia-* library directories), FSDP_NCCL_INCLUDE_DIR (nccl.h), and puts the wheel's
# CMake package on CMAKE_PREFIX_PATH.
if(EXISTS "${CMAKE_SOURCE_DIR}/.venv/bin/python")
  set(_fsdp_default_python "${CMAKE_SOURCE_DIR}/.venv/bin/python")
else()
  set(_fsdp_default_python "python3")
endif()
set(FSDP_PYTHON "${_fsdp_default_python}" CACHE STRING
    "Python whose torch wheel provides libtorch (default: the checkout's .venv)")

execute_process(
  COMMAND "${FSDP_PYTHON}" -c
    "import torch, torch.utils, os; print(torch.utils.cmake_prefix_path); print(torch.__version__); print(os.path.join(os.path.dirname(torch.__file__), 'lib')); print(int(torch.version.cuda is not None)); import sys; print(sys.executable)"
  OUTPUT_VARIABLE _fsdp_torch_info
  ERROR_VARIABLE _fsdp_torch_err
  RESULT_VARIABLE _fsdp_torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _fsdp_torch_rc EQUAL 0)
  message(FATAL_ERROR
    "fsdp: cannot import torch with FSDP_PYTHON='${FSDP_PYTHON}': ${_fsdp_torch_err}\n"
    "Run scripts/bootstrap.sh (it installs the pinned torch wheel into .venv), or pass "
    "-DFSDP_PYTHON=/path/to/python whose torch is 2.x.")
endif()
string(REPLACE "\n" ";" _fsdp_torch_info "${_fsdp_torch_info}")
list(GET _fsdp_torch_info 0 _fsdp_torch_prefix)
list(GET _fsdp_torch_info 1 FSDP_TORCH_VERSION)
list(GET _fsdp_torch_info 2 FSDP_TORCH_LIB_DIR)
list(GET _fsdp_torch_info 3 _fsdp_torch_cuda)
# The interpreter as an absolute path: tests and benchmarks run it by that path.
list(GET _fsdp_torch_info 4 FSDP_PYTHON_EXECUTABLE)
if(FSDP_TORCH_VERSION VERSION_LESS "2.11")
  message(FATAL_ERROR "fsdp: torch ${FSDP_TORCH_VERSION} from ${FSDP_PYTHON} is older than 2.11, "
                      "the oldest libtorch fsdp-cpp supports; run scripts/bootstrap.sh")
endif()
if(_fsdp_torch_cuda)
  set(FSDP_TORCH_CUDA ON)
else()
  set(FSDP_TORCH_CUDA OFF)
endif()
list(PREPEND CMAKE_PREFIX_PATH "${_fsdp_torch_prefix}")
# The CUDA libraries the wheel's libtorch_cuda loads (nvidia-* packages beside torch). The
# linker resolves libtorch_cuda's own dependencies against these, not against a CUDA toolkit
# installed on the machine, whose NCCL may be older than the one the wheel was built with.
get_filename_component(_fsdp_site_packages "${FSDP_TORCH_LIB_DIR}/../.." ABSOLUTE)
file(GLOB FSDP_TORCH_CUDA_LIB_DIRS LIST_DIRECTORIES true "${_fsdp_site_packages}/nvidia/*/lib")
# NCCL's header, from the wheel's nvidia-nccl package (c10d's ProcessGroupNCCL.hpp includes it);
# the same NCCL the wheel's libtorch_cuda was built with.
find_path(FSDP_NCCL_INCLUDE_DIR nccl.h HINTS "${_fsdp_site_packages}/nvidia/nccl/include"
  DOC "directory holding nccl.h (the torch wheel's nvidia/nccl/include)")
message(STATUS "fsdp: libtorch ${FSDP_TORCH_VERSION} from ${FSDP_PYTHON} (CUDA: ${FSDP_TORCH_CUDA})")
