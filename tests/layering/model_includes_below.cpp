// Compiled by ctest Layout.DownwardIncludesCompile against the model layer: a layer includes its
// own headers and every layer below it. The control for the two probes that must fail.
#include "core/tensor.h"
#include "dist/communicator.h"
#include "fsdp/fsdp.h"
#include "model/config.h"
#include "moe/moe_layer.h"
#include "ops/gemm.h"
