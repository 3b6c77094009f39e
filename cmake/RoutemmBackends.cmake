# Resolves ROUTEMM_CUDA / ROUTEMM_METAL (AUTO/ON/OFF) into ROUTEMM_WITH_CUDA / ROUTEMM_WITH_METAL.
include(CheckLanguage)

set(ROUTEMM_WITH_CUDA OFF)
if(NOT ROUTEMM_CUDA STREQUAL "OFF" AND EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/backend/cuda/CMakeLists.txt")
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(ROUTEMM_WITH_CUDA ON)
  elseif(ROUTEMM_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ROUTEMM_CUDA=ON but no CUDA compiler was found")
  endif()
elseif(ROUTEMM_CUDA STREQUAL "ON")
  message(FATAL_ERROR "ROUTEMM_CUDA=ON but this source tree has no CUDA backend")
endif()

# The Metal backend is built and tested on macOS only; until the suite has passed on Apple hardware
# AUTO leaves it off.
set(ROUTEMM_WITH_METAL OFF)
if(ROUTEMM_METAL STREQUAL "ON")
  if(NOT APPLE OR NOT EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/backend/metal/CMakeLists.txt")
    message(FATAL_ERROR "ROUTEMM_METAL=ON needs macOS and the Metal backend sources")
  endif()
  set(ROUTEMM_WITH_METAL ON)
endif()

message(STATUS "routemm backends: cpu=ON cuda=${ROUTEMM_WITH_CUDA} metal=${ROUTEMM_WITH_METAL}")
