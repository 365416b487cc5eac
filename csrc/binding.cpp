// verispec.cpu_kernels: the quantized products (qgemm.h) as torch functions, the activations'
// quantization, the choice of instruction set from the CPU's flags at run time, the
// row-by-row paged attention (attention.h), a quantized model's decoder layers (decoder.h) and
// the samplers' draws (sampling.h).
#include <torch/extension.h>

#include <string>
#include <vector>

#include "attention.h"
#include "decoder.h"
#include "eagle_chain.h"
#include "f32linear.h"
#include "qlinear.h"
#include "sampling.h"

namespace verispec {
namespace {

std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32,
              "x must be a 2-D float32 tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) % kBlock == 0, "x has ", x.size(1), " columns: expected a multiple of 32");
  const torch::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1);
  auto xq = torch::empty({rows, k}, xc.options().dtype(torch::kInt8));
  auto xd = torch::empty({rows, k / kBlock}, xc.options());
  auto xs = torch::empty({rows, k / kBlock}, xc.options().dtype(torch::kInt32));
  quantize_into(xc.data_ptr<float>(), rows, k, xq.data_ptr<int8_t>(), xd.data_ptr<float>(),
                xs.data_ptr<int32_t>(), nullptr);
  return {xq, xd, xs};
}

// y [M, N] = x [M, K] times the block-quantized weight (qgemm.h, panels of 16 columns)
// transposed.
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& d,
                      const c10::optional<torch::Tensor>& m, int64_t bits, int64_t zero_point,
                      int64_t n, const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be 2-D float32");
  const Panels weight{w, d, m ? *m : torch::Tensor(), bits, zero_point, n};
  weight.check(x.size(1));
  const Kernel kernel = kernel_for(isa);
  const torch::Tensor xc = x.contiguous();
  auto y = torch::empty({xc.size(0), n}, xc.options());
  QuantizedRows rows;
  rows.quantize(xc.data_ptr<float>(), xc.size(0), xc.size(1));
  qlinear_into(rows, weight, kernel, y.data_ptr<float>(), n);
  return y;
}

// [R, K] float32: rows `index` of a block-quantized weight in panels.
torch::Tensor dequantized_rows(const torch::Tensor& w, const torch::Tensor& d,
                              const c10::optional<torch::Tensor>& m, int64_t bits,
                              int64_t zero_point, int64_t n, int64_t k,
                              const torch::Tensor& index) {
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == torch::kInt64,
              "index must be a 1-D int64 tensor");
  const Panels weight{w, d, m ? *m : torch::Tensor(), bits, zero_point, n};
  weight.check(k);
  const torch::Tensor ids = index.contiguous();
  auto out = torch::empty({ids.numel(), k}, d.options().dtype(torch::kFloat32));
  dequantize_rows(weight, k, ids.data_ptr<int64_t>(), ids.numel(), out.data_ptr<float>());
  return out;
}

// [M, N] float32 = x [M, K] times w [N, K] transposed (f32linear.h).
torch::Tensor f32_linear_tensor(const torch::Tensor& x, const torch::Tensor& w,
                                const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be 2-D float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous(),
              "w must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(x.size(1) == w.size(1), "x has ", x.size(1), " columns: w takes ", w.size(1));
  const torch::Tensor xc = x.contiguous();
  auto y = torch::empty({xc.size(0), w.size(0)}, xc.options());
  py::gil_scoped_release released;
  f32_linear(xc.data_ptr<float>(), xc.size(0), xc.size(1), w.data_ptr<float>(), w.size(0),
             y.data_ptr<float>(), isa);
  return y;
}

}  // namespace
}  // namespace verispec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "verispec's compiled CPU kernels (block-quantized weight products)";
  module.def("supported_isas", &verispec::supported_isas,
             "instruction sets this CPU runs the kernels with, best first");
  module.def("quantize_activations", &verispec::quantize_activations, py::arg("x"));
  module.def("inverse_cdf", &verispec::inverse_cdf, py::arg("weights"), py::arg("u"));
  module.def("top_values", &verispec::top_values, py::arg("x"), py::arg("width"));
  module.def("request_keys", &verispec::request_keys, py::arg("seeds"), py::arg("steps"));
  module.def("uniform", &verispec::uniform, py::arg("keys"), py::arg("positions"), py::arg("purpose"));
  module.def("fill_below", &verispec::fill_below, py::arg("x"), py::arg("threshold"));
  module.def("paged_attention_rows", &verispec::paged_attention_rows, py::arg("q"),
             py::arg("kv_cache"), py::arg("block_tables"), py::arg("row_seq"),
             py::arg("row_first"), py::arg("row_visible"), py::arg("row_tree_start"),
             py::arg("tree_mask"), py::arg("scale"), py::arg("softcap"));
  module.def("qlinear", &verispec::qlinear, py::arg("x"), py::arg("w"), py::arg("d"),
             py::arg("m"), py::arg("bits"), py::arg("zero_point"), py::arg("n"), py::arg("isa"));
  module.def("f32_isas", &verispec::f32_isas,
             "instruction sets this CPU runs f32_linear with, best first");
  module.def("f32_linear", &verispec::f32_linear_tensor, py::arg("x"), py::arg("w"),
             py::arg("isa"));
  module.def("dequantize_rows", &verispec::dequantized_rows, py::arg("w"), py::arg("d"),
             py::arg("m"), py::arg("bits"), py::arg("zero_point"), py::arg("n"), py::arg("k"),
             py::arg("index"));
  py::class_<verispec::DecoderStack>(module, "DecoderStack")
      .def(py::init<const std::vector<py::dict>&, int64_t, int64_t, int64_t, int64_t, double, bool,
                    double, double, const std::string&, const py::object&>(),
           py::arg("layers"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("intermediate"), py::arg("eps"), py::arg("gelu"), py::arg("scale"),
           py::arg("softcap"), py::arg("isa"), py::arg("head") = py::none())
      .def("forward", &verispec::DecoderStack::forward, py::arg("hidden"), py::arg("begin"),
           py::arg("end"), py::arg("cos"), py::arg("sin"), py::arg("kv_caches"),
           py::arg("slot_mapping"), py::arg("plans"), py::arg("products"),
           py::arg("capture_after") = std::vector<int64_t>(),
           py::arg("captured") = std::vector<torch::Tensor>())
      .def("logits", &verispec::DecoderStack::logits, py::arg("hidden"), py::arg("indices"),
           py::arg("product"))
      .def_property_readonly("num_layers", &verispec::DecoderStack::num_layers)
      .def_property_readonly("has_head", &verispec::DecoderStack::has_head);
  py::class_<verispec::EagleChain>(module, "EagleChain")
      .def(py::init<const py::dict&, int64_t, torch::Tensor, torch::Tensor, double>(),
           py::arg("linears"), py::arg("fused_layers"),
           py::arg("vocab_embeddings"), py::arg("vocab"), py::arg("eps"))
      .def("draft", &verispec::EagleChain::draft, py::arg("stack"), py::arg("inputs"), py::arg("embeddings"),
           py::arg("cos"), py::arg("sin"), py::arg("kv_caches"), py::arg("slots"),
           py::arg("first_plan"), py::arg("logits_rows"), py::arg("block_tables"),
           py::arg("chain_start"), py::arg("depths"), py::arg("first_products"),
           py::arg("chain_products"), py::arg("head_product"), py::arg("temperature"),
           py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("uniforms"));
}
