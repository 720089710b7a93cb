// Compiled by ctest Layout.CrossIncludeDoesNotCompile against the fsdp layer alone: fsdp and moe
// sit side by side above dist, so neither may include the other and this must fail to compile.
#include "moe/moe_layer.h"
