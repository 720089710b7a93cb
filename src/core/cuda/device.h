#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace mt::cuda {

// Number of visible CUDA devices; 0 when there is no driver or no GPU (never throws).
int device_count();
std::string device_name(int index);
// Total memory of the current device in bytes; 0 when there is none.
int64_t device_memory_bytes();
void synchronize();       // waits for all work on the current device
void clear_last_error();  // forgets the runtime's last (non-sticky) error
// Page-locks host memory (cudaHostRegister) so that copies to and from the GPU run at the link's
// rate; false (and nothing changed) when the runtime refuses. unpin before the memory is freed.
bool pin_host_memory(void* p, size_t bytes);
void unpin_host_memory(void* p);
// profile::Span times device work with CUDA events on the thread's stream.
void use_device_clock();

}  // namespace mt::cuda
