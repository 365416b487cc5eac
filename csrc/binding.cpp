// verispec.cpu_kernels: the quantized products (qgemm.h) as torch functions, the activations'
// quantization, the choice of instruction set from the CPU's flags at run time, and the
// row-by-row paged attention (attention.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <string>
#include <vector>

#include "attention.h"
#include "qgemm.h"

namespace verispec {
namespace {

using Kernel = void (*)(const QGemmArgs&, int64_t, int64_t);

struct Isa {
  const char* name;
  Kernel kernel;
  bool (*supported)();
};

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool has_avxvnni() { return has_avx2() && __builtin_cpu_supports("avxvnni"); }
bool has_avx512vnni() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
bool always() { return true; }

// Best first.
const Isa kIsas[] = {
    {"avx512vnni", qgemm_avx512vnni, has_avx512vnni},
    {"avxvnni", qgemm_avxvnni, has_avxvnni},
    {"avx2", qgemm_avx2, has_avx2},
    {"generic", qgemm_generic, always},
};

Kernel kernel_for(const std::string& name) {
  for (const Isa& isa : kIsas) {
    if (name == isa.name) {
      TORCH_CHECK(isa.supported(), "isa='", name, "' is not supported by this CPU");
      return isa.kernel;
    }
  }
  TORCH_CHECK(false, "isa='", name, "' is unknown: expected avx512vnni, avxvnni, avx2 or generic");
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const Isa& isa : kIsas) {
    if (isa.supported()) names.emplace_back(isa.name);
  }
  return names;
}

constexpr int64_t kBlock = 32;

// x [M, K] float32 -> xq [M, K] int8, xd [M, K/32] float32, and (where not null) xs [M, K/32]
// int32 and, what the kernels read, xm [M, K/32] = xd * xs: per block, xd = amax / 127,
// xq = round-half-even(x * (127 / amax)), xs = sum(xq).
void quantize_into(const float* x, int64_t rows, int64_t k, int8_t* xq, float* xd, int32_t* xs,
                   float* xm) {
  const int64_t groups = k / kBlock;
  at::parallel_for(0, rows * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * kBlock;
      float amax = 0.0f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(src[j]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(src[j] * inv));
        xq[i * kBlock + j] = static_cast<int8_t>(q);
        sum += q;
      }
      xd[i] = amax / 127.0f;
      if (xs != nullptr) xs[i] = sum;
      if (xm != nullptr) xm[i] = xd[i] * static_cast<float>(sum);
    }
  });
}

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
  TORCH_CHECK(bits == 4 || bits == 8, "bits=", bits, " is invalid: expected 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be 2-D float32");
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kBlock;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(k % kBlock == 0, "x has ", k, " columns: expected a multiple of 32");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() &&
                  w.numel() == panels * groups * kPanel * kBlock * bits / 8,
              "w must be contiguous uint8 [ceil(N / 16), K / 32, 64 * bits]");
  const bool fp32 = d.scalar_type() == torch::kFloat32;
  TORCH_CHECK((fp32 || d.scalar_type() == torch::kFloat16) && d.is_contiguous() &&
                  d.numel() == panels * groups * kPanel,
              "d must be contiguous float16 or float32 [ceil(N / 16), K / 32, 16]");
  if (m) {
    TORCH_CHECK(m->scalar_type() == d.scalar_type() && m->is_contiguous() &&
                    m->numel() == d.numel(),
                "m must be like d");
  }
  const Kernel kernel = kernel_for(isa);
  const torch::Tensor xc = x.contiguous();
  auto y = torch::empty({rows, n}, xc.options());
  if (rows == 0 || n == 0) return y;
  std::vector<int8_t> xq(rows * k);
  std::vector<float> xd(rows * groups);
  std::vector<float> xm(rows * groups);
  std::vector<int32_t> xs(rows * groups);
  quantize_into(xc.data_ptr<float>(), rows, k, xq.data(), xd.data(), xs.data(), xm.data());
  QGemmArgs args{rows, n, k, xq.data(), xd.data(), xm.data(), xs.data(), w.data_ptr<uint8_t>(),
                 d.data_ptr(), m ? m->data_ptr() : nullptr, static_cast<int>(bits), fp32,
                 static_cast<int>(zero_point), y.data_ptr<float>(), n};
  // Enough panels per task that a task's weights (>= 16 KB) outweigh its start-up. One row reads
  // the weights at the memory's pace on one core, and a second thread only adds its start-up
  // (measured: 5.8 ms against 5.3 for a decode step's products); from two rows on the integer
  // work outweighs it (five rows: 6.6 ms against 8.0).
  const int64_t grain = rows == 1 ? panels : std::max<int64_t>(1, (16 << 10) / (kPanel * k * bits / 8));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
  return y;
}

}  // namespace
}  // namespace verispec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "verispec's compiled CPU kernels (block-quantized weight products)";
  module.def("supported_isas", &verispec::supported_isas,
             "instruction sets this CPU runs the kernels with, best first");
  module.def("quantize_activations", &verispec::quantize_activations, py::arg("x"));
  module.def("paged_attention_rows", &verispec::paged_attention_rows, py::arg("q"),
             py::arg("kv_cache"), py::arg("block_tables"), py::arg("row_seq"),
             py::arg("row_first"), py::arg("row_visible"), py::arg("row_tree_start"),
             py::arg("tree_mask"), py::arg("scale"), py::arg("softcap"));
  module.def("qlinear", &verispec::qlinear, py::arg("x"), py::arg("w"), py::arg("d"),
             py::arg("m"), py::arg("bits"), py::arg("zero_point"), py::arg("n"), py::arg("isa"));
}
