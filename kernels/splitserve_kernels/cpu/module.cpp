// The Python module of the CPU kernels: one entry per kernel file.
#include <torch/extension.h>

torch::Tensor paged_decode_attention(
    torch::Tensor q, torch::Tensor cache, int64_t layer, torch::Tensor block_tables,
    torch::Tensor seq_lens, double scale, int64_t window);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
}
