// The radixlm CPU kernels as one Python extension module (built by radixlm.kernels.cpu_ext).

#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention over slot ranges", py::arg("q"), py::arg("k_pool"),
        py::arg("v_pool"), py::arg("table"), py::arg("rows"), py::arg("starts"), py::arg("lens"), py::arg("scale"),
        py::arg("init_out") = py::none(), py::arg("init_lse") = py::none(), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("splits") = 1, py::arg("softcap") = 0.0);
  m.def("add_rms_norm", &add_rms_norm, "RMSNorm of x (+ residual); returns (sum, normed)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("quantize_into", &quantize_into, "Quantize [T, Hkv, D] into an 8-bit pool at slots, with fp16 scales",
        py::arg("x"), py::arg("slots"), py::arg("values"), py::arg("scales"), py::arg("qmax"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2I] gate/up output", py::arg("gate_up"));
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu(gate, approximate='tanh') * up of a fused [T, 2I] gate/up output",
        py::arg("gate_up"));
  m.def("rope", &rope, "Rotate-half rotary embedding with fp32 cos/sin [T, D/2]", py::arg("x"), py::arg("cos"),
        py::arg("sin"));
  m.def("q4_linear", &q4_linear, "x @ W.T for float32 x [M, K] and W [n, K] in Q4_1 tiles of 4 rows", py::arg("x"),
        py::arg("tiles"), py::arg("n"));
  m.def("gguf_linear", &gguf_linear, "x @ W.T for float32 x [M, K] and W the row parts of GGUF blocks (uint8 [n_i, row_bytes], one type id each)",
        py::arg("x"), py::arg("parts"), py::arg("types"), py::arg("n"));
  m.def("gguf_experts_token", &gguf_experts_token,
        "One token's routed experts over GGUF blocks: sum_j weights[j] * down_j(act(gate_up_j(x))), j in the order given",
        py::arg("x"), py::arg("gate_up"), py::arg("gate_up_types"), py::arg("down"), py::arg("down_types"), py::arg("weights"),
        py::arg("gelu") = false);
  m.def("gguf_dequantize_rows", &gguf_dequantize_rows, "The rows ids of GGUF blocks of one type, dequantized exactly to float32 [T, k]",
        py::arg("blocks"), py::arg("type"), py::arg("ids"), py::arg("k"));
  m.def("gguf_native_types", &gguf_native_types, "The GGUF type ids gguf_linear and gguf_dequantize_rows take");
  m.def("fp8_linear", &fp8_linear, "x @ (W * scale).T for float32 x [M, K] and W the e4m3 bytes [N, K] (uint8), scales per tensor, row or [block_n, block_k] block",
        py::arg("x"), py::arg("weight"), py::arg("scale"), py::arg("block_n") = 0, py::arg("block_k") = 0);
  m.def("lora_add", &lora_add, "out[s:e, lo:lo+n] += (x[s:e] @ A) @ B for each segment's adapter (A [in, R], R a multiple of 16; B parts [r, n]), in place",
        py::arg("x"), py::arg("out"), py::arg("starts"), py::arg("ends"), py::arg("a"), py::arg("b"), py::arg("cols"),
        py::arg("part_lo"));
  m.def("gated_delta_decode", &gated_delta_decode,
        "One decode step of the gated delta rule: q, k [B, Hk, dk], v [B, H, dv], g and beta [B, H], states [N, H, dk, dv] "
        "(read at rows [B], negative: zeros); returns (o [B, H, dv], out_state: the new states [B, H, dk, dv], or "
        "[N2, H, dk, dv] written at out_rows [B])",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("state"), py::arg("rows") = py::none(),
        py::arg("out_state") = py::none(), py::arg("out_rows") = py::none());
  m.def("gated_delta_prepare", &gated_delta_prepare,
        "The gated delta rule's decode inputs from in_proj's output (float32): the causal conv over the conv states read at "
        "rows (negative: zeros) and this token, SiLU, q/k L2-normalised (q scaled), v, g = -exp(A_log) softplus(a + dt_bias), "
        "beta = sigmoid(b); returns (q, k, v, g, beta, the new conv states [B, C, K - 1])",
        py::arg("mixed"), py::arg("conv_state"), py::arg("rows"), py::arg("weight"), py::arg("a"), py::arg("b"),
        py::arg("a_log"), py::arg("dt_bias"), py::arg("key_heads"), py::arg("head_k_dim"), py::arg("head_v_dim"),
        py::arg("eps") = 1e-6);
  m.def("gated_rms_norm", &gated_rms_norm, "weight * rmsnorm(o) * silu(z) per head of o [B, H, dv] (float32); returns [B, H * dv]",
        py::arg("o"), py::arg("z"), py::arg("weight"), py::arg("eps"));
  bind_decode_stack(m);
}
