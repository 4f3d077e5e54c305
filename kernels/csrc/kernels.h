// The torch-level entry points of the C++ CPU kernels, for the bindings and for the kernels that
// call each other (the decode stack). Each is defined in the .cpp named after it.
#pragma once

#include <torch/extension.h>

#include <vector>

std::vector<torch::Tensor> paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                        torch::Tensor table, torch::Tensor rows, torch::Tensor starts,
                                        torch::Tensor lens, double scale, c10::optional<torch::Tensor> init_out,
                                        c10::optional<torch::Tensor> init_lse, c10::optional<torch::Tensor> k_scale,
                                        c10::optional<torch::Tensor> v_scale, int64_t splits, double softcap);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                                        double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up);
void quantize_into(torch::Tensor x, torch::Tensor slots, torch::Tensor values, torch::Tensor scales, double qmax);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor tiles, int64_t n);
torch::Tensor gguf_linear(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types, int64_t n);
torch::Tensor gguf_experts_token(torch::Tensor x, std::vector<std::vector<torch::Tensor>> gate_up,
                                 std::vector<std::vector<int64_t>> gate_up_types, std::vector<std::vector<torch::Tensor>> down,
                                 std::vector<std::vector<int64_t>> down_types, torch::Tensor weights, bool gelu);
torch::Tensor gguf_dequantize_rows(torch::Tensor blocks, int64_t type, torch::Tensor ids, int64_t k);
std::vector<int64_t> gguf_native_types();
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale, int64_t block_n, int64_t block_k);
void lora_add(torch::Tensor x, torch::Tensor out, std::vector<int64_t> starts, std::vector<int64_t> ends,
              std::vector<torch::Tensor> a, std::vector<torch::Tensor> b, std::vector<int64_t> cols,
              std::vector<int64_t> part_lo);
std::vector<torch::Tensor> gated_delta_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                                              torch::Tensor beta, torch::Tensor state, c10::optional<torch::Tensor> rows,
                                              c10::optional<torch::Tensor> out_state,
                                              c10::optional<torch::Tensor> out_rows);
std::vector<torch::Tensor> gated_delta_prepare(torch::Tensor mixed, torch::Tensor conv_state, torch::Tensor rows,
                                               torch::Tensor weight, torch::Tensor a, torch::Tensor b,
                                               torch::Tensor a_log, torch::Tensor dt_bias, int64_t key_heads,
                                               int64_t head_k_dim, int64_t head_v_dim, double eps);
torch::Tensor gated_rms_norm(torch::Tensor o, torch::Tensor z, torch::Tensor weight, double eps);
void bind_decode_stack(pybind11::module& m);
