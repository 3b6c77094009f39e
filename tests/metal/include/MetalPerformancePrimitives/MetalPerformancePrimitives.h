// Stand-in for the Metal SDK header <MetalPerformancePrimitives/MetalPerformancePrimitives.h> in the Linux syntax check: the declarations live in
// tests/metal/msl_shim.h.
#include "../../msl_shim.h"
