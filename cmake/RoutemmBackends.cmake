# Resolves ROUTEMM_CUDA / ROUTEMM_METAL (AUTO/ON/OFF) into ROUTEMM_WITH_CUDA / ROUTEMM_WITH_METAL.
include(CheckLanguage)
include(RoutemmCudaDriver)

if(NOT ROUTEMM_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "ROUTEMM_CUDA must be AUTO, ON or OFF (got '${ROUTEMM_CUDA}')")
endif()
set(ROUTEMM_WITH_CUDA OFF)
set(_routemm_cuda_wanted ON)
if(ROUTEMM_CUDA STREQUAL "AUTO")
  # AUTO builds CUDA only where a GPU driver is present (cmake/RoutemmCudaDriver.cmake).
  routemm_gpu_driver_present(_routemm_cuda_wanted _routemm_driver_reason)
  if(NOT _routemm_cuda_wanted)
    message(STATUS "routemm: ${_routemm_driver_reason}: ROUTEMM_CUDA=AUTO leaves the CUDA backend "
                   "off; ROUTEMM_CUDA=ON builds it anyway")
  endif()
endif()
if(NOT ROUTEMM_CUDA STREQUAL "OFF" AND _routemm_cuda_wanted AND EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/backend/cuda/CMakeLists.txt")
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(ROUTEMM_WITH_CUDA ON)
  elseif(ROUTEMM_CUDA STREQUAL "ON")
    message(FATAL_ERROR "ROUTEMM_CUDA=ON but no CUDA compiler was found")
  endif()
elseif(ROUTEMM_CUDA STREQUAL "ON")
  message(FATAL_ERROR "ROUTEMM_CUDA=ON but this source tree has no CUDA backend")
endif()

# The Metal backend is built and tested on macOS only (docs/metal.md). Until the suite has passed on
# Apple hardware, AUTO leaves it off everywhere; ON builds it on Apple (csrc/backend/metal: xcrun
# metal -> .air -> routemm.metallib) and is a configure error anywhere else.
set(ROUTEMM_WITH_METAL OFF)
if(ROUTEMM_METAL STREQUAL "ON")
  if(NOT APPLE)
    message(FATAL_ERROR "ROUTEMM_METAL=ON: the Metal backend builds only on macOS (this host is "
                        "${CMAKE_SYSTEM_NAME}); use ROUTEMM_METAL=AUTO or OFF here")
  endif()
  if(NOT EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/backend/metal/CMakeLists.txt")
    message(FATAL_ERROR "ROUTEMM_METAL=ON but this source tree has no csrc/backend/metal")
  endif()
  find_program(_routemm_xcrun xcrun)
  if(NOT _routemm_xcrun)
    message(FATAL_ERROR "ROUTEMM_METAL=ON needs xcrun (install the Xcode command line tools)")
  endif()
  execute_process(COMMAND "${_routemm_xcrun}" -sdk macosx -f metal
                  RESULT_VARIABLE _routemm_metal_rc OUTPUT_QUIET ERROR_QUIET)
  if(NOT _routemm_metal_rc EQUAL 0)
    message(FATAL_ERROR "ROUTEMM_METAL=ON but `xcrun -sdk macosx -f metal` finds no Metal compiler "
                        "(install Xcode, or run `xcodebuild -downloadComponent MetalToolchain`)")
  endif()
  set(ROUTEMM_WITH_METAL ON)
elseif(ROUTEMM_METAL STREQUAL "AUTO" AND APPLE)
  message(STATUS "routemm: ROUTEMM_METAL=AUTO leaves the Metal backend off until it has passed on "
                 "Apple hardware; configure with -DROUTEMM_METAL=ON to build it")
elseif(NOT ROUTEMM_METAL MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "ROUTEMM_METAL must be AUTO, ON or OFF (got '${ROUTEMM_METAL}')")
endif()

message(STATUS "routemm backends: cpu=ON cuda=${ROUTEMM_WITH_CUDA} metal=${ROUTEMM_WITH_METAL} metal_emu=${ROUTEMM_METAL_EMU}")
