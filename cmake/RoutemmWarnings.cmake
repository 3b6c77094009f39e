# Project-wide warning flags, applied per target with routemm_warnings(<target>).
function(routemm_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wno-unused-parameter>)
    # CUDA sources: the same checks on their host compilation (nvcc's generated host code is not
    # pedantic-clean, so -Wpedantic stays off there).
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wshadow,-Wno-unused-parameter>)
  endif()
endfunction()
