# Compile-only check of one .metal file with the host C++ compiler against msl_shim.h.
#   cmake -DCXX=<compiler> -DSOURCE=<file.metal> -DOUT=<copy.cpp> -DINCLUDES=<dir;dir> -DFLAGS=<flags> -P check_msl.cmake
# MSL's [[threadgroup(i)]] attribute shares its name with the address-space keyword that the shim
# defines away, so the copy renames the attribute; a #line directive keeps diagnostics pointing at
# the original file and line.
file(READ "${SOURCE}" text)
string(REPLACE "[[threadgroup(" "[[threadgroup_binding(" text "${text}")
file(WRITE "${OUT}" "#line 1 \"${SOURCE}\"\n${text}")
set(args -std=c++20 -fsyntax-only -x c++ -D__METAL_VERSION__=310)
foreach(dir IN LISTS INCLUDES)
  list(APPEND args "-I${dir}")
endforeach()
separate_arguments(flags UNIX_COMMAND "${FLAGS}")
execute_process(COMMAND "${CXX}" ${args} ${flags} "${OUT}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "MSL compile-only check failed for ${SOURCE}")
endif()
