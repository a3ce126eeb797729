# SPDX-License-Identifier: Apache-2.0
# Finds the one dependency of the dcpattn target: libcu++ (cuda::std::mdspan, span, bit), part of
# the CCCL that ships with the CUDA toolkit. A host-only consumer needs the toolkit's headers, not
# the CUDA language. Installed beside dcpattnConfig.cmake and included from it.
include_guard(GLOBAL)

if(NOT TARGET libcudacxx::libcudacxx)
  find_package(libcudacxx CONFIG QUIET)
  if(NOT libcudacxx_FOUND)
    # Not on CMAKE_PREFIX_PATH: look inside the CUDA toolkit (nvcc on PATH, CUDAToolkit_ROOT,
    # CUDA_PATH or /usr/local/cuda).
    find_package(CUDAToolkit QUIET)
    set(_dcpattn_hints "")
    foreach(_root IN ITEMS "${CUDAToolkit_LIBRARY_ROOT}" "${CUDAToolkit_TARGET_DIR}"
                           "$ENV{CUDA_PATH}" "/usr/local/cuda")
      if(_root)
        list(APPEND _dcpattn_hints "${_root}/lib/cmake/libcudacxx" "${_root}/lib64/cmake/libcudacxx")
      endif()
    endforeach()
    find_package(libcudacxx CONFIG QUIET HINTS ${_dcpattn_hints})
    unset(_dcpattn_hints)
  endif()
  if(NOT TARGET libcudacxx::libcudacxx)
    message(FATAL_ERROR
      "dcpattn: libcu++ (CCCL) was not found. Install the CUDA toolkit >= 12.8, or point "
      "CMAKE_PREFIX_PATH or CUDAToolkit_ROOT at it.")
  endif()
endif()
