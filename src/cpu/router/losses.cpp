// The load-balancing and z-loss kernels: row loops split over the OpenMP threads, per-row
// reductions in vector code, the per-row results summed in double. And the two small ops beside
// them: the counts of a routing map and the loss-free bias update.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/convert.h"
#include "cpu/router/problems.h"

namespace moekit::detail {
namespace {

constexpr int64_t kMinElementsForThreads = 1 << 15;

// tokens_per_expert [B, E] (or [E]) as f32 rows, times `scale`.
std::vector<float> counts_as_float(const ConstTensorView& tpe, float scale) {
  const int64_t B = tpe.rank == 2 ? tpe.shape[0] : 1, E = tpe.shape[tpe.rank - 1];
  std::vector<float> out(B * E);
  for (int64_t b = 0; b < B; ++b) {
    const auto* row = reinterpret_cast<const int32_t*>(row_ptr(tpe, b));
    for (int64_t e = 0; e < E; ++e) out[b * E + e] = static_cast<float>(row[e]) * scale;
  }
  return out;
}

// Row t of a [T, E] f32 | bf16 tensor as f32: the row itself when f32, else converted into buf.
const float* row_f32(const ConstTensorView& v, int64_t t, std::vector<float>& buf) {
  if (v.dtype == DType::kF32) return reinterpret_cast<const float*>(row_ptr(v, t));
  buf.resize(v.shape[1]);
  load_row_as_float(row_ptr(v, t), v.dtype, v.shape[1], buf.data());
  return buf.data();
}

// logsumexp of a row; exps (f32 [E]) receives exp(x - max), *shift the max and *sum their sum.
float logsumexp(const float* x, int64_t E, float* exps, float* shift, float* sum) {
  if (row_has_nan(x, E)) {  // NaN, as the formula gives (the fast max and exp lose it)
    constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
    std::fill(exps, exps + E, kNaN);
    *shift = *sum = kNaN;
    return kNaN;
  }
  *shift = row_max(x, E);
  *sum = row_exp_shifted(x, *shift, exps, E);
  return *shift + std::log(*sum);
}

// sum_b sum_{t in b} <scores[t], tokens_per_expert[b]>
double balance_loss_sum(const ConstTensorView& scores, const ConstTensorView& tpe) {
  const int64_t T = scores.shape[0], E = scores.shape[1];
  const int64_t B = tpe.rank == 2 ? tpe.shape[0] : 1;
  if (T == 0) return 0.0;
  const std::vector<float> counts = counts_as_float(tpe, 1.0f);
  const int64_t rows_per_seq = T / B;
  double total = 0.0;
#pragma omp parallel reduction(+ : total) if (T * E >= kMinElementsForThreads)
  {
    std::vector<float> buf;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      total += row_dot(row_f32(scores, t, buf), counts.data() + (t / rows_per_seq) * E, E);
    }
  }
  return total;
}

}  // namespace

Status balance_loss_cpu(const BalanceLossProblem& p) {
  *p.loss = static_cast<float>(p.scale * balance_loss_sum(p.scores, p.tokens_per_expert));
  return {};
}

// d_scores[t] = scale * tokens_per_expert[b(t)]
Status balance_loss_backward_cpu(const BalanceBackwardProblem& p) {
  const ConstTensorView& tpe = p.tokens_per_expert;
  const TensorView& d_scores = p.d_scores;
  const float scale = p.scale;
  const int64_t T = d_scores.shape[0], E = d_scores.shape[1];
  const int64_t B = tpe.rank == 2 ? tpe.shape[0] : 1;
  if (T == 0) return {};
  const std::vector<float> rows = counts_as_float(tpe, scale);
  const int64_t rows_per_seq = T / B;
#pragma omp parallel for schedule(static) if (T * E >= kMinElementsForThreads)
  for (int64_t t = 0; t < T; ++t) {
    store_row_from_float(rows.data() + (t / rows_per_seq) * E, E, row_ptr(d_scores, t),
                         d_scores.dtype);
  }
  return {};
}

Status z_loss_cpu(const ZLossProblem& p) {
  const ConstTensorView& logits = p.logits;
  const int64_t T = logits.shape[0], E = logits.shape[1];
  if (T == 0 || E == 0) {
    *p.loss = 0.0f;
    return {};
  }
  double total = 0.0;
#pragma omp parallel reduction(+ : total) if (T * E >= kMinElementsForThreads)
  {
    std::vector<float> buf, exps(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float shift, sum;
      const double lse = logsumexp(row_f32(logits, t, buf), E, exps.data(), &shift, &sum);
      total += lse * lse;
    }
  }
  *p.loss = static_cast<float>(p.scale * total);
  return {};
}

// d_logits[t] = scale * logsumexp(logits[t]) * softmax(logits[t])
Status z_loss_backward_cpu(const ZLossBackwardProblem& p) {
  const ConstTensorView& logits = p.logits;
  const TensorView& d_logits = p.d_logits;
  const float scale = p.scale;
  const int64_t T = logits.shape[0], E = logits.shape[1];
#pragma omp parallel if (T * E >= kMinElementsForThreads)
  {
    std::vector<float> buf, exps(E);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float shift, sum;
      const float lse = logsumexp(row_f32(logits, t, buf), E, exps.data(), &shift, &sum);
      // scale * lse * softmax = (scale * lse / sum) * exp(x - max)
      const float a = scale * lse / sum;
      for (int64_t e = 0; e < E; ++e) exps[e] *= a;
      store_row_from_float(exps.data(), E, row_ptr(d_logits, t), d_logits.dtype);
    }
  }
  return {};
}

Status count_tokens_cpu(const CountProblem& p) {
  const ConstTensorView& map = p.routing_map;
  const TensorView& counts = p.counts;
  const int64_t T = map.shape[0], E = map.shape[1];
  const int64_t B = counts.rank == 2 ? counts.shape[0] : 1;
  const int64_t rows_per_seq = T / B;
  for (int64_t b = 0; b < B; ++b) {
    int32_t* out =
        static_cast<int32_t*>(counts.data) + (counts.rank == 2 ? b * counts.stride[0] : 0);
    for (int64_t e = 0; e < E; ++e) out[e] = 0;
    for (int64_t t = b * rows_per_seq; t < (b + 1) * rows_per_seq; ++t) {
      const auto* row = reinterpret_cast<const uint8_t*>(row_ptr(map, t));
      for (int64_t e = 0; e < E; ++e) out[e] += row[e] != 0;
    }
  }
  return {};
}

Status update_expert_bias_cpu(const BiasUpdateProblem& p) {
  const int64_t E = p.expert_bias.shape[0];
  const auto* counts = static_cast<const int32_t*>(p.tokens_per_expert.data);
  const int64_t cs = p.tokens_per_expert.stride[0];
  double mean = 0.0;
  for (int64_t e = 0; e < E; ++e) mean += counts[e * cs];
  mean /= static_cast<double>(E);
  auto* bias = static_cast<float*>(p.expert_bias.data);
  for (int64_t e = 0; e < E; ++e) {
    const double diff = mean - counts[e * cs];
    bias[e * p.expert_bias.stride[0]] += p.rate * static_cast<float>((diff > 0) - (diff < 0));
  }
  return {};
}

}  // namespace moekit::detail
