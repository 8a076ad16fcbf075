// The Python module of the CPU kernels: one entry per kernel.
#include <torch/extension.h>

#include <tuple>
#include <vector>

torch::Tensor paged_decode_attention(
    torch::Tensor q, torch::Tensor cache, int64_t layer, torch::Tensor block_tables,
    torch::Tensor seq_lens, double scale, int64_t window);
torch::Tensor paged_prefill_attention(
    torch::Tensor q, torch::Tensor cache, int64_t layer, std::vector<torch::Tensor> block_tables,
    torch::Tensor cu_seqlens_q, torch::Tensor cu_seqlens_k, double scale, int64_t window);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(
    torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor rotary_write_kv(
    torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, torch::Tensor cache,
    int64_t layer, torch::Tensor slot_blocks, torch::Tensor slot_offsets);
torch::Tensor silu_mul_(torch::Tensor gate, torch::Tensor up);
torch::Tensor greedy_tokens(torch::Tensor logits);
void fp8_encode_blocks(torch::Tensor pool, torch::Tensor src_ids, torch::Tensor q,
                       torch::Tensor scales, torch::Tensor dst_ids);
void fp8_decode_blocks(torch::Tensor q, torch::Tensor scales, torch::Tensor src_ids,
                       torch::Tensor pool, torch::Tensor dst_ids);
torch::Tensor widened_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias,
                             int64_t out_features);

// The kernels keep the GIL while they compute. Letting go of it (a gil_scoped_release call guard
// on each) made served decode steps slower: every kernel call became one more point where the
// engine thread waits to get the GIL back from the stub's sender and intake threads
// (docs/bench/HISTORY.md, "The CPU kernels and the GIL").
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("paged_prefill_attention", &paged_prefill_attention);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rotary_write_kv", &rotary_write_kv);
  m.def("silu_mul_", &silu_mul_);
  m.def("greedy_tokens", &greedy_tokens);
  m.def("fp8_encode_blocks", &fp8_encode_blocks);
  m.def("fp8_decode_blocks", &fp8_decode_blocks);
  m.def("widened_linear", &widened_linear);
}
