// MetalPerformancePrimitives for the execution model: the tensor ops live in msl_tensor.h.
#include "backend/metal_emu/msl_tensor.h"
