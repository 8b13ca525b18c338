// Fused CPU kernels for the sharded norms: what torch's CPU build lacks (its batch_norm_stats and
// batch_norm_backward_elemt run on CUDA only), per-row passes faster than the stock kernels that
// would serve instead (eval-mode batch norm, batch norm's backward reduction), and the arithmetic on
// the few statistics between them (the merge over ranks, the coefficients of the passes), one call
// each where it took some twenty small tensor ops per norm.  Contiguous rows; built on first use by
// physics_dp/ops/fused_cpu.py.  Every pass splits its work over torch's intra-op threads so that
// the result does not depend on the thread count: each statistic, row or channel is computed whole
// by one thread, or (where a sum runs across rows: the channels-last passes, layer norm's weighted
// sums) each block of rows or values is summed on its own and the blocks merge in block order.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBlock = 2048;  // values summed in the rows' dtype before a float64 merge
constexpr int64_t kParallelWork = 1 << 16;  // values a thread's share of a pass reads at least

// How many of the items (statistics, rows, channels) of `values` values each one thread takes at least.
int64_t grain(int64_t values) { return std::max<int64_t>(1, kParallelWork / std::max<int64_t>(values, 1)); }

// How many blocks of `block` items cover `length` (the last one may be short).
int64_t blocks_of(int64_t length, int64_t block) { return (length + block - 1) / block; }

// Running moments of values about a shift: count, mean (relative to the shift) and the sum of
// squared deviations.  Blocks of kBlock values are summed in the input's dtype about the shift (so
// that data far from zero keeps its variance); the blocks merge in float64 with Chan's formula.
struct Moments {
  double count = 0, mean = 0, m2 = 0;
};

// Chan's merge into m of a block of `count` values whose deviations from the shift sum to `sum`,
// their squares to `squares`.
void add_block(Moments& m, double count, double sum, double squares) {
  const double block_mean = sum / count;
  const double block_m2 = std::max(0.0, squares - sum * block_mean);
  const double total = m.count + count, delta = block_mean - m.mean;
  m.mean += delta * count / total;
  m.m2 += block_m2 + delta * delta * m.count * count / total;
  m.count = total;
}

template <typename T>
void add_run(const T* run, int64_t length, T shift, Moments& m) {
  for (int64_t start = 0; start < length; start += kBlock) {
    const int64_t end = std::min(length, start + kBlock);
    T sum = 0, squares = 0;
#pragma omp simd reduction(+ : sum, squares)
    for (int64_t j = start; j < end; ++j) {
      const T d = run[j] - shift;
      sum += d;
      squares += d * d;
    }
    add_block(m, double(end - start), double(sum), double(squares));
  }
}

// The statistics of a contiguous (samples, channels, length) x, packed as [count, means, variances]
// (biased) in float64.  Per sample: (sample, group) over the group's channels (one contiguous run
// each); else per channel over every sample (one run per sample), the shift being each statistic's
// first value.
template <typename T>
void norm_moments_kernel(const T* x, int64_t samples, int64_t channels, int64_t length, int64_t groups,
                         bool per_sample, double* packed) {
  const int64_t per_group = channels / groups, stats = per_sample ? samples * groups : channels;
  double* means = packed + 1;
  double* variances = packed + 1 + stats;
  at::parallel_for(0, stats, grain(per_sample ? per_group * length : samples * length), [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const T* first = x + (per_sample ? s * per_group : s) * length;  // (sample s / groups, group s % groups), or channel s
      Moments m;
      if (per_sample) {
        add_run(first, per_group * length, first[0], m);
      } else {
        for (int64_t n = 0; n < samples; ++n) add_run(first + n * channels * length, length, first[0], m);
      }
      means[s] = m.mean + double(first[0]);
      variances[s] = m.m2 / m.count;
    }
  });
  packed[0] = double(per_sample ? per_group * length : samples * length);
}

// Chan's merge of per-rank packed statistics, the (ranks, 1 + 2 S) rows of `gathered`, into one
// packed row: an empty part weighs nothing, an empty whole gives zeros.
void merge_moments_kernel(const double* gathered, int64_t ranks, int64_t stats, double* packed) {
  const int64_t width = 1 + 2 * stats;
  double total = 0;
  for (int64_t r = 0; r < ranks; ++r) total += gathered[r * width];
  const double scale = 1.0 / std::max(total, 1.0);
  for (int64_t s = 0; s < stats; ++s) {
    double mean = 0, var = 0;
    for (int64_t r = 0; r < ranks; ++r) mean += gathered[r * width] * scale * gathered[r * width + 1 + s];
    for (int64_t r = 0; r < ranks; ++r) {
      const double deviation = gathered[r * width + 1 + s] - mean;
      var += gathered[r * width] * scale * (gathered[r * width + 1 + stats + s] + deviation * deviation);
    }
    packed[1 + s] = mean;
    packed[1 + stats + s] = var;
  }
  packed[0] = total;
}

// out = a * u + b * v + c with (a, b, c) per row of the contiguous (rows, length) u and v; where w
// is not null, a * u * w[j] + b * v + c (layer norm's dx, the gradient passing through its weight).
template <typename T>
void two_term_affine_kernel(
    const T* u, const T* v, const T* w, const T* a, const T* b, const T* c, int64_t rows, int64_t length, T* out) {
  at::parallel_for(0, rows, grain(length), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T ar = a[r], br = b[r], cr = c[r];
      const T* ur = u + r * length;
      const T* vr = v + r * length;
      T* o = out + r * length;
      if (w) {
#pragma omp simd
        for (int64_t j = 0; j < length; ++j) o[j] = ar * ur[j] * w[j] + br * vr[j] + cr;
      } else {
#pragma omp simd
        for (int64_t j = 0; j < length; ++j) o[j] = ar * ur[j] + br * vr[j] + cr;
      }
    }
  });
}

// out = a * x + c with (a, c) per row of the contiguous (rows, length) x; where w is not null,
// (a * x + c) * w[j] + b[j] (layer norm's elementwise affine; b may be null).
template <typename T>
void row_affine_kernel(const T* x, const T* a, const T* c, const T* w, const T* b, int64_t rows, int64_t length, T* out) {
  at::parallel_for(0, rows, grain(length), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T ar = a[r], cr = c[r];
      const T* xr = x + r * length;
      T* o = out + r * length;
      if (!w) {
#pragma omp simd
        for (int64_t j = 0; j < length; ++j) o[j] = ar * xr[j] + cr;
      } else if (b) {
#pragma omp simd
        for (int64_t j = 0; j < length; ++j) o[j] = (ar * xr[j] + cr) * w[j] + b[j];
      } else {
#pragma omp simd
        for (int64_t j = 0; j < length; ++j) o[j] = (ar * xr[j] + cr) * w[j];
      }
    }
  });
}

// Per channel c of the contiguous (samples, channels, length) g and x: the sums over samples and
// length of g and of g * (x - mean[c]), in float64 (blocks of kBlock summed in the inputs' dtype).
template <typename T>
void grad_sums_kernel(const T* g, const T* x, const T* mean, int64_t samples, int64_t channels, int64_t length,
                      double* sum_g, double* sum_g_centered) {
  at::parallel_for(0, channels, grain(samples * length), [&](int64_t begin, int64_t stop) {
    for (int64_t c = begin; c < stop; ++c) {
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
  });
}

// One block [start, end) of values of weighted_grad_sums_kernel: each row's sums over it into
// partial_g[r] and partial_centered[r], and its values' parameter gradients (where grad_w is not null).
template <typename T>
void weighted_block_sums(const T* dy, const T* x, const T* w, const T* mean, const T* rstd, int64_t rows,
                         int64_t length, int64_t start, int64_t end, double* partial_g, double* partial_centered,
                         T* grad_w, T* grad_b) {
  if (grad_w) {
    std::fill(grad_w + start, grad_w + end, T(0));
    std::fill(grad_b + start, grad_b + end, T(0));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const T m = mean[r], s = rstd[r];
    const T* dr = dy + r * length;
    const T* xr = x + r * length;
    T block = 0, block_centered = 0;
    if (grad_w) {
#pragma omp simd reduction(+ : block, block_centered)
      for (int64_t j = start; j < end; ++j) {
        const T centered = xr[j] - m, g = dr[j] * w[j];
        block += g;
        block_centered += g * centered;
        grad_w[j] += dr[j] * centered * s;
        grad_b[j] += dr[j];
      }
    } else {
#pragma omp simd reduction(+ : block, block_centered)
      for (int64_t j = start; j < end; ++j) {
        const T g = dr[j] * w[j];
        block += g;
        block_centered += g * (xr[j] - m);
      }
    }
    partial_g[r] = double(block);
    partial_centered[r] = double(block_centered);
  }
}

// Per row r of the contiguous (rows, length) dy and x, with g = dy * w: the sums of g and of
// g * (x - mean[r]) in float64 (blocks of kBlock summed in the inputs' dtype); where grad_w is not
// null also, per value j, the affine parameters' gradients summed over the rows: grad_w[j] of
// dy * (x - mean[r]) * rstd[r], grad_b[j] of dy.  Blocks run over j outermost, so each block of the
// parameters' gradients stays in cache while every row adds to it: one pass over dy and x.  The
// blocks split over the threads (each owns its values' parameter gradients); a row's sums over the
// blocks add up afterwards in block order.
template <typename T>
void weighted_grad_sums_kernel(const T* dy, const T* x, const T* w, const T* mean, const T* rstd, int64_t rows,
                               int64_t length, double* sum_g, double* sum_g_centered, T* grad_w, T* grad_b) {
  const int64_t blocks = blocks_of(length, kBlock);
  std::vector<double> partial(2 * blocks * rows);  // per (block, row): its sums, merged in block order below
  double* partial_g = partial.data();
  double* partial_centered = partial_g + blocks * rows;
  at::parallel_for(0, blocks, grain(rows * kBlock), [&](int64_t first_block, int64_t last_block) {
    for (int64_t k = first_block; k < last_block; ++k) {
      weighted_block_sums(dy, x, w, mean, rstd, rows, length, k * kBlock, std::min(length, (k + 1) * kBlock),
                          partial_g + k * rows, partial_centered + k * rows, grad_w, grad_b);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    double total = 0, centered = 0;
    for (int64_t k = 0; k < blocks; ++k) {
      total += partial_g[k * rows + r];
      centered += partial_centered[k * rows + r];
    }
    sum_g[r] = total;
    sum_g_centered[r] = centered;
  }
}

// ----- channels last: a contiguous (samples, length, channels) slab, one coefficient per (sample, channel) -----
// A row holds only `channels` values (often 32-128): the passes run over chunks of whole rows of
// at least kChunk values instead, against the per-channel values repeated once per row of a chunk,
// so that the inner loops are as long as the row-major kernels' and the coefficients load from L1.
constexpr int64_t kChunk = 512;

int64_t rows_per_chunk(int64_t channels) { return std::max<int64_t>(1, kChunk / std::max<int64_t>(channels, 1)); }

template <typename T>
std::vector<T> repeated(const T* per_channel, int64_t channels, int64_t rows) {
  std::vector<T> out(rows * channels);
  for (int64_t r = 0; r < rows; ++r) std::copy(per_channel, per_channel + channels, out.begin() + r * channels);
  return out;
}

// Rows per block of the channels-last passes' sums: about kBlock, whole chunks.
int64_t rows_per_block(int64_t chunk_rows) { return std::max(chunk_rows, kBlock / chunk_rows * chunk_rows); }

// Goes over the rows [start, end) of one block: four(first_row) for each run of four whole chunks of
// chunk_rows rows (four chunks added to the accumulators in one pass: a quarter of their loads and
// stores), then chunk(first_row, rows) for each chunk left.
template <typename Four, typename Chunk>
void over_block_rows(int64_t start, int64_t end, int64_t chunk_rows, Four four, Chunk chunk) {
  int64_t l = start;
  for (; l + 4 * chunk_rows <= end; l += 4 * chunk_rows) four(l);
  for (; l < end; l += chunk_rows) chunk(l, std::min(chunk_rows, end - l));
}

// The statistics of a channels-last slab, packed as norm_moments_kernel's are: per (sample, group) over
// the rows and the group's channels, or per channel over every sample.  Each channel is summed in
// blocks of about kBlock rows in x's dtype about its first value (the blocks split over the threads),
// the blocks merged per channel in float64 (Chan) in block order, then a statistic's channels.
template <typename T>
void channels_last_moments_kernel(const T* x, int64_t samples, int64_t length, int64_t channels, int64_t groups,
                                  bool per_sample, double* packed) {
  const int64_t per_group = channels / groups, stats = per_sample ? samples * groups : channels;
  const int64_t chunk_rows = rows_per_chunk(channels), width = chunk_rows * channels;
  const int64_t block_rows = rows_per_block(chunk_rows), blocks = blocks_of(length, block_rows);
  double* means = packed + 1;
  double* variances = packed + 1 + stats;
  std::vector<Moments> moments(channels);
  std::vector<double> block_sums(blocks * channels), block_squares(blocks * channels);  // per (block, channel)
  std::vector<T> shift = repeated(x, channels, chunk_rows);
  for (int64_t n = 0; n < samples; ++n) {
    const T* xs = x + n * length * channels;
    if (per_sample && n > 0) {
      std::fill(moments.begin(), moments.end(), Moments());
      shift = repeated(xs, channels, chunk_rows);
    }
    const T* h = shift.data();
    at::parallel_for(0, blocks, grain(block_rows * channels), [&](int64_t first_block, int64_t last_block) {
      std::vector<T> sum(width), squares(width);
      T* s = sum.data();
      T* q = squares.data();
      auto four = [&](int64_t first) {
        const T* v0 = xs + first * channels;
        const T* v1 = v0 + width;
        const T* v2 = v1 + width;
        const T* v3 = v2 + width;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) {
          const T d0 = v0[j] - h[j], d1 = v1[j] - h[j], d2 = v2[j] - h[j], d3 = v3[j] - h[j];
          s[j] += (d0 + d1) + (d2 + d3);
          q[j] += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
        }
      };
      auto chunk = [&](int64_t first, int64_t rows) {
        const T* values = xs + first * channels;
        const int64_t count = rows * channels;
#pragma omp simd
        for (int64_t j = 0; j < count; ++j) {
          const T d = values[j] - h[j];
          s[j] += d;
          q[j] += d * d;
        }
      };
      for (int64_t k = first_block; k < last_block; ++k) {
        std::fill(sum.begin(), sum.end(), T(0));
        std::fill(squares.begin(), squares.end(), T(0));
        over_block_rows(k * block_rows, std::min(length, (k + 1) * block_rows), chunk_rows, four, chunk);
        for (int64_t c = 0; c < channels; ++c) {  // the block's sums per channel
          T channel_sum = 0, channel_squares = 0;
          for (int64_t r = 0; r < chunk_rows; ++r) {
            channel_sum += s[r * channels + c];
            channel_squares += q[r * channels + c];
          }
          block_sums[k * channels + c] = double(channel_sum);
          block_squares[k * channels + c] = double(channel_squares);
        }
      }
    });
    for (int64_t k = 0; k < blocks; ++k) {  // merged in block order: the same on any number of threads
      const double rows = double(std::min(length, (k + 1) * block_rows) - k * block_rows);
      for (int64_t c = 0; c < channels; ++c) add_block(moments[c], rows, block_sums[k * channels + c], block_squares[k * channels + c]);
    }
    if (!per_sample) continue;
    for (int64_t g = 0; g < groups; ++g) {  // the group's channels, equal counts: their mean, and m2 about it
      double mean = 0, m2 = 0;
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) mean += moments[c].mean + double(shift[c]);
      mean /= double(per_group);
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
        const double deviation = moments[c].mean + double(shift[c]) - mean;
        m2 += moments[c].m2 + moments[c].count * deviation * deviation;
      }
      means[n * groups + g] = mean;
      variances[n * groups + g] = m2 / (double(per_group) * double(length));
    }
  }
  if (!per_sample) {
    for (int64_t c = 0; c < channels; ++c) {
      means[c] = moments[c].mean + double(shift[c]);
      variances[c] = moments[c].m2 / moments[c].count;
    }
  }
  packed[0] = double(per_sample ? per_group * length : samples * length);
}

// out = a * u + b * v + c (b, v may be null: a * u + c) with (a, b, c) per (sample, channel) of the
// channels-last (samples, length, channels) u and v.
template <typename T>
void channels_last_affine_kernel(const T* u, const T* v, const T* a, const T* b, const T* c, int64_t samples,
                                 int64_t length, int64_t channels, T* out) {
  const int64_t chunk_rows = rows_per_chunk(channels), chunks = blocks_of(length, chunk_rows);
  for (int64_t n = 0; n < samples; ++n) {
    const std::vector<T> ar = repeated(a + n * channels, channels, chunk_rows);
    const std::vector<T> cr = repeated(c + n * channels, channels, chunk_rows);
    const std::vector<T> br = v ? repeated(b + n * channels, channels, chunk_rows) : std::vector<T>();
    const T* an = ar.data();
    const T* bn = br.data();
    const T* cn = cr.data();
    at::parallel_for(0, chunks, grain(chunk_rows * channels), [&](int64_t first_chunk, int64_t last_chunk) {
      for (int64_t k = first_chunk; k < last_chunk; ++k) {
        const int64_t l = k * chunk_rows;
        const int64_t offset = (n * length + l) * channels, count = std::min(chunk_rows, length - l) * channels;
        const T* uc = u + offset;
        T* o = out + offset;
        if (v) {
          const T* vc = v + offset;
#pragma omp simd
          for (int64_t j = 0; j < count; ++j) o[j] = an[j] * uc[j] + bn[j] * vc[j] + cn[j];
        } else {
#pragma omp simd
          for (int64_t j = 0; j < count; ++j) o[j] = an[j] * uc[j] + cn[j];
        }
      }
    });
  }
}

// The sums of g and of g * (x - mean) over the rows of the channels-last (samples, length, channels) g
// and x, per (sample, channel) with mean per (sample, channel), or per channel over every sample with
// mean per channel; in float64, blocks of about kBlock rows summed in the inputs' dtype (the blocks
// split over the threads), added up in block order.
template <typename T>
void channels_last_grad_sums_kernel(const T* g, const T* x, const T* mean, int64_t samples, int64_t length,
                                    int64_t channels, bool per_sample, double* sum_g, double* sum_g_centered) {
  const int64_t stats = per_sample ? samples * channels : channels;
  const int64_t chunk_rows = rows_per_chunk(channels), width = chunk_rows * channels;
  const int64_t block_rows = rows_per_block(chunk_rows), blocks = blocks_of(length, block_rows);
  std::fill(sum_g, sum_g + stats, 0.0);
  std::fill(sum_g_centered, sum_g_centered + stats, 0.0);
  std::vector<double> block_g(blocks * channels), block_centered(blocks * channels);  // per (block, channel)
  for (int64_t n = 0; n < samples; ++n) {
    const int64_t first = per_sample ? n * channels : 0;
    const std::vector<T> mr = repeated(mean + first, channels, chunk_rows);
    const T* m = mr.data();
    at::parallel_for(0, blocks, grain(block_rows * channels), [&](int64_t first_block, int64_t last_block) {
      std::vector<T> sums(width), centered_sums(width);
      T* s = sums.data();
      T* sc = centered_sums.data();
      auto four = [&](int64_t row) {
        const T* g0 = g + (n * length + row) * channels;
        const T* x0 = x + (n * length + row) * channels;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) {
          const T a = g0[j], b = g0[j + width], c = g0[j + 2 * width], d = g0[j + 3 * width];
          s[j] += (a + b) + (c + d);
          sc[j] += (a * (x0[j] - m[j]) + b * (x0[j + width] - m[j])) + (c * (x0[j + 2 * width] - m[j]) + d * (x0[j + 3 * width] - m[j]));
        }
      };
      auto chunk = [&](int64_t row, int64_t rows) {
        const T* gc = g + (n * length + row) * channels;
        const T* xc = x + (n * length + row) * channels;
        const int64_t count = rows * channels;
#pragma omp simd
        for (int64_t j = 0; j < count; ++j) {
          s[j] += gc[j];
          sc[j] += gc[j] * (xc[j] - m[j]);
        }
      };
      for (int64_t k = first_block; k < last_block; ++k) {
        std::fill(sums.begin(), sums.end(), T(0));
        std::fill(centered_sums.begin(), centered_sums.end(), T(0));
        over_block_rows(k * block_rows, std::min(length, (k + 1) * block_rows), chunk_rows, four, chunk);
        for (int64_t c = 0; c < channels; ++c) {  // the block's sums per channel, in float64
          double channel_g = 0, channel_centered = 0;
          for (int64_t r = 0; r < chunk_rows; ++r) {
            channel_g += double(s[r * channels + c]);
            channel_centered += double(sc[r * channels + c]);
          }
          block_g[k * channels + c] = channel_g;
          block_centered[k * channels + c] = channel_centered;
        }
      }
    });
    for (int64_t k = 0; k < blocks; ++k) {  // added up in block order: the same on any number of threads
      for (int64_t c = 0; c < channels; ++c) {
        sum_g[first + c] += block_g[k * channels + c];
        sum_g_centered[first + c] += block_centered[k * channels + c];
      }
    }
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

void check_slab(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.is_contiguous() && x.numel() > 0,
              name, " must be a non-empty contiguous CPU (samples, channels, length) tensor, got ", x.sizes());
  check_float_or_double(x, name);
}

void check_groups(int64_t groups, int64_t channels) {
  TORCH_CHECK(groups > 0 && channels % groups == 0, "groups must divide the channels, got ", groups, " and ", channels);
}

// The packed statistics of a (samples, channels, length) slab, or of the (samples, length, channels)
// view of a channels-last one.
at::Tensor moments_with(const at::Tensor& x, int64_t groups, bool per_sample, bool channels_last) {
  check_slab(x, "x");
  const int64_t channels = x.size(channels_last ? 2 : 1);
  check_groups(groups, channels);
  TORCH_CHECK(per_sample || groups == channels, "statistics over the samples take one group per channel, got ", groups);
  const int64_t stats = per_sample ? x.size(0) * groups : groups;
  auto packed = at::empty({1 + 2 * stats}, x.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "norm_moments", [&] {
    if (channels_last) {
      channels_last_moments_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), groups, per_sample,
                                             packed.data_ptr<double>());
    } else {
      norm_moments_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), groups, per_sample,
                                    packed.data_ptr<double>());
    }
  });
  return packed;
}

at::Tensor norm_moments(const at::Tensor& x, int64_t groups, bool per_sample) {
  return moments_with(x, groups, per_sample, false);
}

at::Tensor merge_moments(const at::Tensor& gathered) {
  TORCH_CHECK(gathered.device().is_cpu() && gathered.dim() == 2 && gathered.is_contiguous() &&
                  gathered.scalar_type() == at::kDouble && gathered.size(1) % 2 == 1,
              "gathered must be a contiguous float64 (ranks, 1 + 2 S) CPU tensor, got ", gathered.sizes());
  const int64_t stats = gathered.size(1) / 2;
  auto packed = at::empty({gathered.size(1)}, gathered.options());
  merge_moments_kernel(gathered.data_ptr<double>(), gathered.size(0), stats, packed.data_ptr<double>());
  return packed;
}

// A per-channel parameter as float64 values (nullptr: none).
struct Parameter {
  at::Tensor values;
  const double* data = nullptr;
  Parameter(const c10::optional<at::Tensor>& param, int64_t channels) {
    if (param.has_value() && param->defined()) {
      TORCH_CHECK(param->numel() == channels, "a per-channel parameter must have ", channels, " values, got ", param->numel());
      values = param->to(at::kDouble).contiguous();
      data = values.data_ptr<double>();
    }
  }
  double at(int64_t c, double otherwise) const { return data ? data[c] : otherwise; }
};

// Which statistic normalizes (sample n, channel c).
struct StatIndex {
  int64_t per_group, groups;
  bool per_sample;
  int64_t operator()(int64_t n, int64_t c) const { return (per_sample ? n * groups : 0) + c / per_group; }
};

void check_packed(const at::Tensor& packed, int64_t stats) {
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kDouble && packed.size(0) == 1 + 2 * stats,
              "packed statistics must be a contiguous float64 CPU tensor of 1 + 2 * ", stats, " values, got ", packed.sizes());
}

// The forward pass's coefficients from merged statistics: rows (scale, shift, mean) per (sample,
// channel), in `dtype`, with y = scale * x + shift (scale = weight / std, shift = bias - mean * scale);
// and 1 / std per statistic, float64.
std::tuple<at::Tensor, at::Tensor> norm_coefficients(
    const at::Tensor& packed, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
    double eps, int64_t samples, int64_t channels, int64_t groups, bool per_sample, at::ScalarType dtype) {
  check_groups(groups, channels);
  const int64_t stats = (per_sample ? samples : 1) * groups;
  check_packed(packed, stats);
  const Parameter w(weight, channels), b(bias, channels);
  const StatIndex stat{channels / groups, groups, per_sample};
  const double* mean = packed.data_ptr<double>() + 1;
  const double* var = mean + stats;
  auto rstd = at::empty({stats}, packed.options());
  double* r = rstd.data_ptr<double>();
  for (int64_t s = 0; s < stats; ++s) r[s] = 1.0 / std::sqrt(var[s] + eps);
  auto coefficients = at::empty({3, samples * channels}, packed.options());
  double* out = coefficients.data_ptr<double>();
  const int64_t width = samples * channels;
  for (int64_t n = 0; n < samples; ++n) {
    for (int64_t c = 0; c < channels; ++c) {
      const int64_t s = stat(n, c), i = n * channels + c;
      const double scale = r[s] * w.at(c, 1.0);
      out[i] = scale;
      out[width + i] = b.at(c, 0.0) - mean[s] * scale;
      out[2 * width + i] = mean[s];
    }
  }
  return {coefficients.to(dtype), rstd};
}

// The backward pass's coefficients from the all-reduced per-(sample, channel) sums of dy and
// dy * (x - mean) (rows of `sums`; one row of channels for statistics over the samples): rows
// (beta, gamma) per (sample, channel) in `dtype`, with dx = scale * dy + beta * x + gamma; and the
// weight and bias gradients (sum of dy * xhat, sum of dy) per channel, float64.
std::tuple<at::Tensor, at::Tensor> norm_grad_coefficients(
    const at::Tensor& sums, const at::Tensor& packed, const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
    int64_t samples, int64_t groups, bool per_sample, at::ScalarType dtype) {
  const int64_t rows = per_sample ? samples : 1, stats = rows * groups;
  TORCH_CHECK(sums.device().is_cpu() && sums.dim() == 2 && sums.size(0) == 2 && sums.size(1) % rows == 0 &&
                  sums.is_contiguous() && sums.scalar_type() == at::kDouble,
              "sums must be a contiguous float64 (2, ", rows, " * channels) CPU tensor, got ", sums.sizes());
  check_packed(packed, stats);
  TORCH_CHECK(rstd.numel() == stats && rstd.is_contiguous() && rstd.scalar_type() == at::kDouble,
              "rstd must hold ", stats, " float64 values");
  const int64_t channels = sums.size(1) / rows;
  check_groups(groups, channels);
  const int64_t per_group = channels / groups;
  const Parameter w(weight, channels);
  const double* sum_dy = sums.data_ptr<double>();
  const double* sum_dy_xmu = sum_dy + rows * channels;
  const double* mean = packed.data_ptr<double>() + 1;
  const double* r = rstd.data_ptr<double>();
  const double total = packed.data_ptr<double>()[0];
  std::vector<double> beta(stats), gamma(stats);
  for (int64_t s = 0; s < stats; ++s) {  // g = w * dy: sums of g and g * (x - mean) over the statistic, times -rstd / count
    const int64_t first = (s / groups) * channels + (s % groups) * per_group;
    double g = 0, g_xmu = 0;
    for (int64_t j = 0; j < per_group; ++j) {
      const double wc = w.at((s % groups) * per_group + j, 1.0);
      g += sum_dy[first + j] * wc;
      g_xmu += sum_dy_xmu[first + j] * wc;
    }
    const double k = r[s] / -total;
    beta[s] = g_xmu * k * r[s] * r[s];
    gamma[s] = g * k - beta[s] * mean[s];
  }
  const StatIndex stat{per_group, groups, per_sample};
  auto coefficients = at::empty({2, samples * channels}, sums.options());
  double* out = coefficients.data_ptr<double>();
  for (int64_t n = 0; n < samples; ++n) {
    for (int64_t c = 0; c < channels; ++c) {
      const int64_t s = stat(n, c), i = n * channels + c;
      out[i] = beta[s];
      out[samples * channels + i] = gamma[s];
    }
  }
  auto param_grads = at::zeros({2, channels}, sums.options());
  double* grad_weight = param_grads.data_ptr<double>();
  double* grad_bias = grad_weight + channels;
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t c = 0; c < channels; ++c) {
      grad_weight[c] += sum_dy_xmu[row * channels + c] * r[row * groups + c / per_group];
      grad_bias[c] += sum_dy[row * channels + c];
    }
  }
  return {coefficients.to(dtype), param_grads};
}

void check_elementwise(const at::Tensor& u, const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == u.size(1) && w.is_contiguous() && w.scalar_type() == u.scalar_type(),
              name, " must be a contiguous (length,) tensor of the rows' dtype, got ", w.sizes());
}

// a * u (* w, where given) + b * v + c.
at::Tensor two_term_affine_with(const at::Tensor& u, const at::Tensor& v, const at::Tensor* w, const at::Tensor& a,
                                const at::Tensor& b, const at::Tensor& c) {
  check_rows(u, "u");
  TORCH_CHECK(v.sizes() == u.sizes() && v.is_contiguous() && v.scalar_type() == u.scalar_type(),
              "v must be contiguous and match u");
  check_coefficients(u, {&a, &b, &c});
  if (w) check_elementwise(u, *w, "w");
  auto out = at::empty_like(u);
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "two_term_affine", [&] {
    two_term_affine_kernel<scalar_t>(u.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), w ? w->data_ptr<scalar_t>() : nullptr,
                                     a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), u.size(0),
                                     u.size(1), out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor two_term_affine(const at::Tensor& u, const at::Tensor& v, const at::Tensor& a,
                           const at::Tensor& b, const at::Tensor& c) {
  return two_term_affine_with(u, v, nullptr, a, b, c);
}

// a * x + c, then (where given) * w + b.
at::Tensor row_affine_with(const at::Tensor& x, const at::Tensor& a, const at::Tensor& c, const at::Tensor* w,
                           const at::Tensor* b) {
  check_rows(x, "x");
  check_coefficients(x, {&a, &c});
  if (w) check_elementwise(x, *w, "w");
  if (b) check_elementwise(x, *b, "b");
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "row_affine", [&] {
    row_affine_kernel<scalar_t>(x.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(),
                                w ? w->data_ptr<scalar_t>() : nullptr, b ? b->data_ptr<scalar_t>() : nullptr, x.size(0),
                                x.size(1), out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor row_affine(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b) {
  return row_affine_with(x, a, b, nullptr, nullptr);
}

at::Tensor grad_sums(const at::Tensor& g, const at::Tensor& x, const at::Tensor& mean) {
  check_slab(x, "x");
  TORCH_CHECK(g.sizes() == x.sizes() && g.is_contiguous() && g.scalar_type() == x.scalar_type(),
              "g must be contiguous and match x's shape and dtype, got ", g.sizes(), " and ", x.sizes());
  TORCH_CHECK(mean.dim() == 1 && mean.size(0) == x.size(1) && mean.is_contiguous() && mean.scalar_type() == x.scalar_type(),
              "mean must be a contiguous (channels,) tensor of x's dtype");
  auto sums = at::empty({2, x.size(1)}, x.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "grad_sums", [&] {
    grad_sums_kernel<scalar_t>(g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), mean.data_ptr<scalar_t>(), x.size(0),
                               x.size(1), x.size(2), sums.data_ptr<double>(), sums.data_ptr<double>() + x.size(1));
  });
  return sums;
}

at::Tensor row_affine_elementwise(const at::Tensor& x, const at::Tensor& a, const at::Tensor& c, const at::Tensor& w,
                                  const c10::optional<at::Tensor>& b) {
  const bool has_b = b.has_value() && b->defined();
  return row_affine_with(x, a, c, &w, has_b ? &*b : nullptr);
}

at::Tensor two_term_affine_elementwise(const at::Tensor& u, const at::Tensor& v, const at::Tensor& w, const at::Tensor& a,
                                       const at::Tensor& b, const at::Tensor& c) {
  return two_term_affine_with(u, v, &w, a, b, c);
}

std::tuple<at::Tensor, at::Tensor> weighted_grad_sums(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                      const at::Tensor& mean, const at::Tensor& rstd, bool param_grads) {
  check_rows(x, "x");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous() && dy.scalar_type() == x.scalar_type(),
              "dy must be contiguous and match x's shape and dtype, got ", dy.sizes(), " and ", x.sizes());
  check_coefficients(x, {&mean, &rstd});
  check_elementwise(x, w, "w");
  auto sums = at::empty({2, x.size(0)}, x.options().dtype(at::kDouble));
  auto grads = param_grads ? at::empty({2, x.size(1)}, x.options()) : at::empty({0}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "weighted_grad_sums", [&] {
    scalar_t* grad_w = param_grads ? grads.data_ptr<scalar_t>() : nullptr;
    weighted_grad_sums_kernel<scalar_t>(dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                                        mean.data_ptr<scalar_t>(), rstd.data_ptr<scalar_t>(), x.size(0), x.size(1),
                                        sums.data_ptr<double>(), sums.data_ptr<double>() + x.size(0), grad_w,
                                        grad_w ? grad_w + x.size(1) : nullptr);
  });
  return {sums, grads};
}

void check_channel_coefficients(const at::Tensor& u, std::initializer_list<const at::Tensor*> coefficients) {
  for (const at::Tensor* k : coefficients) {
    TORCH_CHECK(k->dim() == 1 && k->size(0) == u.size(0) * u.size(2) && k->is_contiguous() &&
                    k->scalar_type() == u.scalar_type(),
                "the coefficients must be contiguous (samples * channels,) tensors of u's dtype");
  }
}

at::Tensor channels_last_moments(const at::Tensor& x, int64_t groups, bool per_sample) {
  return moments_with(x, groups, per_sample, true);
}

// a * u + c, or a * u + b * v + c where v is given.
at::Tensor channels_last_affine_with(const at::Tensor& u, const at::Tensor* v, const at::Tensor& a, const at::Tensor* b,
                                     const at::Tensor& c) {
  check_slab(u, "u");
  if (v) {
    TORCH_CHECK(v->sizes() == u.sizes() && v->is_contiguous() && v->scalar_type() == u.scalar_type(),
                "v must be contiguous and match u");
  }
  check_channel_coefficients(u, {&a, &c});
  if (b) check_channel_coefficients(u, {b});
  auto out = at::empty_like(u);
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "channels_last_affine", [&] {
    channels_last_affine_kernel<scalar_t>(u.data_ptr<scalar_t>(), v ? v->data_ptr<scalar_t>() : nullptr,
                                          a.data_ptr<scalar_t>(), b ? b->data_ptr<scalar_t>() : nullptr,
                                          c.data_ptr<scalar_t>(), u.size(0), u.size(1), u.size(2),
                                          out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor channels_last_affine(const at::Tensor& x, const at::Tensor& a, const at::Tensor& c) {
  return channels_last_affine_with(x, nullptr, a, nullptr, c);
}

at::Tensor channels_last_two_term_affine(const at::Tensor& u, const at::Tensor& v, const at::Tensor& a,
                                         const at::Tensor& b, const at::Tensor& c) {
  return channels_last_affine_with(u, &v, a, &b, c);
}

at::Tensor channels_last_grad_sums(const at::Tensor& g, const at::Tensor& x, const at::Tensor& mean, bool per_sample) {
  check_slab(x, "x");
  TORCH_CHECK(g.sizes() == x.sizes() && g.is_contiguous() && g.scalar_type() == x.scalar_type(),
              "g must be contiguous and match x's shape and dtype, got ", g.sizes(), " and ", x.sizes());
  const int64_t stats = per_sample ? x.size(0) * x.size(2) : x.size(2);
  TORCH_CHECK(mean.dim() == 1 && mean.size(0) == stats && mean.is_contiguous() && mean.scalar_type() == x.scalar_type(),
              "mean must be a contiguous tensor of x's dtype with one value per statistic");
  auto sums = at::empty({2, stats}, x.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "channels_last_grad_sums", [&] {
    channels_last_grad_sums_kernel<scalar_t>(g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), mean.data_ptr<scalar_t>(),
                                             x.size(0), x.size(1), x.size(2), per_sample, sums.data_ptr<double>(),
                                             sums.data_ptr<double>() + stats);
  });
  return sums;
}

}  // namespace

// Registered with the dispatcher (torch.ops.physics_dp.*), so that profilers and dispatch modes see them.
TORCH_LIBRARY(physics_dp, m) {
  m.def("norm_moments(Tensor x, int groups, bool per_sample) -> Tensor");
  m.def("merge_moments(Tensor gathered) -> Tensor");
  m.def("norm_coefficients(Tensor packed, Tensor? weight, Tensor? bias, float eps, int samples, int channels, int groups, bool per_sample, ScalarType dtype) -> (Tensor, Tensor)");
  m.def("norm_grad_coefficients(Tensor sums, Tensor packed, Tensor rstd, Tensor? weight, int samples, int groups, bool per_sample, ScalarType dtype) -> (Tensor, Tensor)");
  m.def("two_term_affine(Tensor u, Tensor v, Tensor a, Tensor b, Tensor c) -> Tensor");
  m.def("row_affine(Tensor x, Tensor a, Tensor b) -> Tensor");
  m.def("grad_sums(Tensor g, Tensor x, Tensor mean) -> Tensor");
  m.def("row_affine_elementwise(Tensor x, Tensor a, Tensor c, Tensor w, Tensor? b) -> Tensor");
  m.def("two_term_affine_elementwise(Tensor u, Tensor v, Tensor w, Tensor a, Tensor b, Tensor c) -> Tensor");
  m.def("weighted_grad_sums(Tensor dy, Tensor x, Tensor w, Tensor mean, Tensor rstd, bool param_grads) -> (Tensor, Tensor)");
  m.def("channels_last_moments(Tensor x, int groups, bool per_sample) -> Tensor");
  m.def("channels_last_affine(Tensor x, Tensor a, Tensor c) -> Tensor");
  m.def("channels_last_two_term_affine(Tensor u, Tensor v, Tensor a, Tensor b, Tensor c) -> Tensor");
  m.def("channels_last_grad_sums(Tensor g, Tensor x, Tensor mean, bool per_sample) -> Tensor");
}

TORCH_LIBRARY_IMPL(physics_dp, CPU, m) {
  m.impl("norm_moments", &norm_moments);
  m.impl("merge_moments", &merge_moments);
  m.impl("norm_coefficients", &norm_coefficients);
  m.impl("norm_grad_coefficients", &norm_grad_coefficients);
  m.impl("two_term_affine", &two_term_affine);
  m.impl("row_affine", &row_affine);
  m.impl("grad_sums", &grad_sums);
  m.impl("row_affine_elementwise", &row_affine_elementwise);
  m.impl("two_term_affine_elementwise", &two_term_affine_elementwise);
  m.impl("weighted_grad_sums", &weighted_grad_sums);
  m.impl("channels_last_moments", &channels_last_moments);
  m.impl("channels_last_affine", &channels_last_affine);
  m.impl("channels_last_two_term_affine", &channels_last_two_term_affine);
  m.impl("channels_last_grad_sums", &channels_last_grad_sums);
}
