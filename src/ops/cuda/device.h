#pragma once
#include <string>

namespace mt::cuda {

// Number of visible CUDA devices; 0 when there is no driver or no GPU (never throws).
int device_count();
std::string device_name(int index);
void synchronize();  // waits for all work on the current device

}  // namespace mt::cuda
