// MT_HOST_DEVICE marks the small functions that the CPU reference and the CUDA kernels share
// (one definition of a formula, compiled for both).
#pragma once

#if defined(__CUDACC__)
#define MT_HOST_DEVICE __host__ __device__
#else
#define MT_HOST_DEVICE
#endif
