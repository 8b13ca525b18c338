// Fused CPU kernels for the sharded norms: what torch's CPU build lacks (its batch_norm_stats and
// batch_norm_backward_elemt run on CUDA only), and per-row passes faster than the stock kernels
// that would serve instead (eval-mode batch norm, batch norm's backward reduction).  One thread,
// contiguous rows; built on first use by physics_dp/ops/fused_cpu.py.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <tuple>

namespace {

constexpr int64_t kBlock = 2048;  // values summed in the rows' dtype before a float64 merge

// Mean and 1 / std (biased) of each row of a contiguous (rows, length) tensor, read once.
// Each block of kBlock values is summed in the input's dtype about a shift (the row's first value,
// so that data far from zero keeps its variance); the blocks merge in float64 with Chan's formula.
template <typename T>
void row_moments_kernel(const T* data, int64_t rows, int64_t length, double* mean, double* rstd) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = data + r * length;
    const T shift = row[0];
    double count = 0, row_mean = 0, m2 = 0;
    for (int64_t start = 0; start < length; start += kBlock) {
      const int64_t end = std::min(length, start + kBlock);
      T sum = 0, squares = 0;
#pragma omp simd reduction(+ : sum, squares)
      for (int64_t j = start; j < end; ++j) {
        const T d = row[j] - shift;
        sum += d;
        squares += d * d;
      }
      const double n = double(end - start), block_mean = double(sum) / n;
      const double block_m2 = std::max(0.0, double(squares) - double(sum) * block_mean);
      const double total = count + n, delta = block_mean - row_mean;
      row_mean += delta * n / total;
      m2 += block_m2 + delta * delta * count * n / total;
      count = total;
    }
    mean[r] = row_mean + double(shift);
    const double var = m2 / count;
    rstd[r] = var > 0 ? 1.0 / std::sqrt(var) : (var == 0 ? std::numeric_limits<double>::infinity() : var);
  }
}

// out = a * u + b * v + c with (a, b, c) per row of the contiguous (rows, length) u and v.
template <typename T>
void two_term_affine_kernel(
    const T* u, const T* v, const T* a, const T* b, const T* c, int64_t rows, int64_t length, T* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const T ar = a[r], br = b[r], cr = c[r];
    const T* ur = u + r * length;
    const T* vr = v + r * length;
    T* o = out + r * length;
#pragma omp simd
    for (int64_t j = 0; j < length; ++j) o[j] = ar * ur[j] + br * vr[j] + cr;
  }
}

// out = a * x + b with (a, b) per row of the contiguous (rows, length) x.
template <typename T>
void row_affine_kernel(const T* x, const T* a, const T* b, int64_t rows, int64_t length, T* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const T ar = a[r], br = b[r];
    const T* xr = x + r * length;
    T* o = out + r * length;
#pragma omp simd
    for (int64_t j = 0; j < length; ++j) o[j] = ar * xr[j] + br;
  }
}

// Per channel c of the contiguous (samples, channels, length) g and x: the sums over samples and
// length of g and of g * (x - mean[c]), in float64 (blocks of kBlock summed in the inputs' dtype).
template <typename T>
void grad_sums_kernel(const T* g, const T* x, const T* mean, int64_t samples, int64_t channels, int64_t length,
                      double* sum_g, double* sum_g_centered) {
  for (int64_t c = 0; c < channels; ++c) {
    const T m = mean[c];
    double total = 0, centered = 0;
    for (int64_t n = 0; n < samples; ++n) {
      const T* gr = g + (n * channels + c) * length;
      const T* xr = x + (n * channels + c) * length;
      for (int64_t start = 0; start < length; start += kBlock) {
        const int64_t end = std::min(length, start + kBlock);
        T block = 0, block_centered = 0;
#pragma omp simd reduction(+ : block, block_centered)
        for (int64_t j = start; j < end; ++j) {
          block += gr[j];
          block_centered += gr[j] * (xr[j] - m);
        }
        total += double(block);
        centered += double(block_centered);
      }
    }
    sum_g[c] = total;
    sum_g_centered[c] = centered;
  }
}

void check_float_or_double(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
              name, " must be float32 or float64, got ", t.scalar_type());
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous() && t.size(1) > 0,
              name, " must be a contiguous CPU (rows, length) tensor with length > 0, got ", t.sizes());
  check_float_or_double(t, name);
}

void check_coefficients(const at::Tensor& u, std::initializer_list<const at::Tensor*> coefficients) {
  for (const at::Tensor* k : coefficients) {
    TORCH_CHECK(k->dim() == 1 && k->size(0) == u.size(0) && k->is_contiguous() && k->scalar_type() == u.scalar_type(),
                "the coefficients must be contiguous (rows,) tensors of u's dtype");
  }
}

std::tuple<at::Tensor, at::Tensor> row_moments(const at::Tensor& rows) {
  check_rows(rows, "rows");
  const auto options = rows.options().dtype(at::kDouble);
  auto mean = at::empty({rows.size(0)}, options), rstd = at::empty({rows.size(0)}, options);
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "row_moments", [&] {
    row_moments_kernel<scalar_t>(rows.data_ptr<scalar_t>(), rows.size(0), rows.size(1),
                                 mean.data_ptr<double>(), rstd.data_ptr<double>());
  });
  return {mean, rstd};
}

at::Tensor two_term_affine(const at::Tensor& u, const at::Tensor& v, const at::Tensor& a,
                           const at::Tensor& b, const at::Tensor& c) {
  check_rows(u, "u");
  TORCH_CHECK(v.sizes() == u.sizes() && v.is_contiguous() && v.scalar_type() == u.scalar_type(),
              "v must be contiguous and match u");
  check_coefficients(u, {&a, &b, &c});
  auto out = at::empty_like(u);
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "two_term_affine", [&] {
    two_term_affine_kernel<scalar_t>(u.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(),
                                     b.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), u.size(0), u.size(1),
                                     out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor row_affine(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b) {
  check_rows(x, "x");
  check_coefficients(x, {&a, &b});
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "row_affine", [&] {
    row_affine_kernel<scalar_t>(x.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), x.size(0),
                                x.size(1), out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor grad_sums(const at::Tensor& g, const at::Tensor& x, const at::Tensor& mean) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.is_contiguous() && g.sizes() == x.sizes() && g.is_contiguous(),
              "g and x must be contiguous CPU (samples, channels, length) tensors of one shape, got ", g.sizes(), " and ", x.sizes());
  check_float_or_double(x, "x");
  TORCH_CHECK(g.scalar_type() == x.scalar_type(), "g must have x's dtype");
  TORCH_CHECK(mean.dim() == 1 && mean.size(0) == x.size(1) && mean.is_contiguous() && mean.scalar_type() == x.scalar_type(),
              "mean must be a contiguous (channels,) tensor of x's dtype");
  auto sums = at::empty({2, x.size(1)}, x.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "grad_sums", [&] {
    grad_sums_kernel<scalar_t>(g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), mean.data_ptr<scalar_t>(), x.size(0),
                               x.size(1), x.size(2), sums.data_ptr<double>(), sums.data_ptr<double>() + x.size(1));
  });
  return sums;
}

}  // namespace

// Registered with the dispatcher (torch.ops.physics_dp.*), so that profilers and dispatch modes see them.
TORCH_LIBRARY(physics_dp, m) {
  m.def("row_moments(Tensor rows) -> (Tensor mean, Tensor rstd)");
  m.def("two_term_affine(Tensor u, Tensor v, Tensor a, Tensor b, Tensor c) -> Tensor");
  m.def("row_affine(Tensor x, Tensor a, Tensor b) -> Tensor");
  m.def("grad_sums(Tensor g, Tensor x, Tensor mean) -> Tensor");
}

TORCH_LIBRARY_IMPL(physics_dp, CPU, m) {
  m.impl("row_moments", &row_moments);
  m.impl("two_term_affine", &two_term_affine);
  m.impl("row_affine", &row_affine);
  m.impl("grad_sums", &grad_sums);
}
