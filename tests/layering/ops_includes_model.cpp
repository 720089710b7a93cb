// Compiled by ctest Layout.UpwardIncludeDoesNotCompile against the ops layer alone: an op may not
// include the model layer's headers (the stack runs core -> ops -> dist -> {moe, fsdp} -> model
// -> train -> cli), so this must fail to compile, naming the header.
#include "model/config.h"
