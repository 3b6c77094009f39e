# Whether this machine has an NVIDIA GPU driver, which is what ROUTEMM_CUDA=AUTO requires before it
# builds the CUDA backend: a CUDA build takes several times as long as the CPU-only one, and on a
# machine with nvcc but no GPU (a CI runner, a container) nothing it builds can run.
#
# A driver is present when `nvidia-smi -L` lists a GPU or /proc/driver/nvidia exists.
# ROUTEMM_NVIDIA_SMI and ROUTEMM_NVIDIA_PROC_DIR replace the probes' defaults (the tests use them);
# ROUTEMM_CUDA=ON builds CUDA without asking (build machines that make wheels for other hosts).
function(routemm_gpu_driver_present out_var reason_var)
  if(DEFINED ROUTEMM_NVIDIA_PROC_DIR)
    set(proc_dir "${ROUTEMM_NVIDIA_PROC_DIR}")
  else()
    set(proc_dir "/proc/driver/nvidia")
  endif()
  if(EXISTS "${proc_dir}")
    set(${out_var} ON PARENT_SCOPE)
    set(${reason_var} "${proc_dir} exists" PARENT_SCOPE)
    return()
  endif()
  if(DEFINED ROUTEMM_NVIDIA_SMI)
    set(smi "${ROUTEMM_NVIDIA_SMI}")
  else()
    find_program(smi nvidia-smi NO_CACHE)
  endif()
  if(smi AND EXISTS "${smi}")
    execute_process(COMMAND "${smi}" -L RESULT_VARIABLE rc OUTPUT_VARIABLE listing ERROR_QUIET
                    TIMEOUT 20)
    if(rc EQUAL 0 AND listing MATCHES "(^|\n)GPU [0-9]+")
      set(${out_var} ON PARENT_SCOPE)
      set(${reason_var} "nvidia-smi -L lists a GPU" PARENT_SCOPE)
      return()
    endif()
  endif()
  set(${out_var} OFF PARENT_SCOPE)
  set(${reason_var} "no NVIDIA GPU driver (nvidia-smi -L lists no GPU and ${proc_dir} is absent)"
      PARENT_SCOPE)
endfunction()
