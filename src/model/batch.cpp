#include "model/batch.h"

namespace mt {

int64_t Batch::masked_tokens() const {
  const Tensor mask = loss_mask.device() == Device::kCPU ? loss_mask : loss_mask.to(Device::kCPU);
  int64_t n = 0;
  for (int64_t i = 0; i < mask.numel(); ++i) n += mask.data<uint8_t>()[i] != 0;
  return n;
}

Batch Batch::to(Device device) const {
  Batch out = *this;
  for (Tensor* t :
       {&out.tokens, &out.targets, &out.loss_mask, &out.positions, &out.cu_seqlens, &out.padding})
    if (t->defined()) *t = t->to(device);
  return out;  // context.rows stays on the host
}

}  // namespace mt
