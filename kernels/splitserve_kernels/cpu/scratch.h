// Per-thread scratch buffers of the CPU kernels.
#pragma once

#include <vector>

#include "vec.h"

namespace splitserve {

// kBuffers buffers of floats, each 64-byte aligned (a vector of vf): loads and stores of whole
// vectors never straddle cache lines. A buffer keeps its memory between calls of one thread.
template <size_t kBuffers>
class Scratch {
 public:
  float* floats(size_t i, int64_t n) {
    auto& buf = bufs_[i];
    buf.resize((n + W - 1) / W);
    return reinterpret_cast<float*>(buf.data());
  }

 private:
  std::vector<vf> bufs_[kBuffers];
};

}  // namespace splitserve
