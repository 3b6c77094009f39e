# routemm_metal_emu_shaders(<target> LIBRARY <name> SHADERS <file.metal>...)
#
# Binds Metal shader files to the execution model (csrc/backend/metal_emu): bind_shaders.py reads
# their kernel signatures and writes one translation unit per file plus library_<name>.cpp (the
# function routemm::metal_emu::library_<name>() registering every kernel). <target> becomes an
# OBJECT library of those units, compiled by the host compiler against msl.h with access
# instrumentation (-fsanitize=thread; the execution model supplies the hooks, no sanitizer runtime
# is linked). Link its objects into a binary that also has the model's runtime.
find_package(Python3 REQUIRED COMPONENTS Interpreter)

set(ROUTEMM_METAL_EMU_DIR "${CMAKE_CURRENT_LIST_DIR}/../csrc/backend/metal_emu")
get_filename_component(ROUTEMM_METAL_EMU_DIR "${ROUTEMM_METAL_EMU_DIR}" ABSOLUTE)

function(routemm_metal_emu_shaders target)
  cmake_parse_arguments(ARG "" "LIBRARY" "SHADERS" ${ARGN})
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    message(FATAL_ERROR "the Metal execution model needs GCC or Clang (access instrumentation)")
  endif()
  set(out "${CMAKE_CURRENT_BINARY_DIR}/${target}")
  set(csrc "${ROUTEMM_METAL_EMU_DIR}/../..")
  get_filename_component(csrc "${csrc}" ABSOLUTE)
  get_filename_component(shader_dir "${csrc}/../metal" ABSOLUTE)
  set(includes "${ROUTEMM_METAL_EMU_DIR}/include" "${csrc}" "${csrc}/include" "${shader_dir}")
  set(outputs "${out}/library_${ARG_LIBRARY}.cpp")
  foreach(shader IN LISTS ARG_SHADERS)
    get_filename_component(name "${shader}" NAME)
    list(APPEND outputs "${out}/${name}.cpp")
  endforeach()
  set(include_args)
  foreach(dir IN LISTS includes)
    list(APPEND include_args --include "${dir}")
  endforeach()
  file(GLOB common_headers CONFIGURE_DEPENDS "${csrc}/backend/common/*.h" "${shader_dir}/*.h")
  add_custom_command(OUTPUT ${outputs}
    COMMAND Python3::Interpreter "${ROUTEMM_METAL_EMU_DIR}/bind_shaders.py"
            --cxx "${CMAKE_CXX_COMPILER}" ${include_args} --out "${out}" --library "${ARG_LIBRARY}"
            ${ARG_SHADERS}
    DEPENDS ${ARG_SHADERS} "${ROUTEMM_METAL_EMU_DIR}/bind_shaders.py" ${common_headers}
    COMMENT "bind_shaders.py: ${ARG_LIBRARY}"
    VERBATIM)
  add_library(${target} OBJECT ${outputs})
  target_include_directories(${target} PRIVATE ${includes})
  target_compile_definitions(${target} PRIVATE __METAL_VERSION__=310)
  # Access hooks on every load and store the compiler keeps; full-precision math as the metallib
  # is built (-fno-fast-math); MSL attributes are unknown to the host compiler. A sanitizer build
  # (ROUTEMM_SANITIZE) turns its own sanitizers off here: they cannot be combined with the hooks.
  target_compile_options(${target} PRIVATE -fno-sanitize=all -fsanitize=thread -fno-fast-math
    $<IF:$<CXX_COMPILER_ID:GNU>,--param=tsan-instrument-func-entry-exit=0;-Wno-attributes,-Wno-unknown-attributes>)
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endfunction()
