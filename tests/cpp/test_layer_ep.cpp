// The MoE layer over P ranks (moe_layer_ep_forward / _backward) against the one-rank layer, on
// the thread engine (P = 1..4, in moekit_tests) and the MPI engine (mpiexec -n 1..4): see
// ep_ranks.h.
//
// Dropless, SPEC.md section 4's equivalence: the ranks' outputs and input gradients are the
// one-rank layer's on the concatenated tokens, each rank's expert gradients are the one-rank
// layer's for its experts, the router's and the shared expert's are the one-rank layer's (summed
// over the ranks), and the losses are equal. With a capacity, each rank drops its own tokens:
// the reference is then the one-rank layer run on each rank's tokens alone.
//
// Each rank builds the whole problem from one seed and computes the reference itself, so the
// test needs no exchange of its own.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ep_ranks.h"
#include "host_tensor.h"
#include "moekit/layer.h"
#include "moekit/ragged_dot.h"

namespace moekit {
namespace {

using test::on_ranks;
using test::rank_counts;
using Bytes = std::vector<std::byte, Aligned64Allocator<std::byte>>;

struct EpCase {
  std::string name;
  int64_t El = 3;  // experts per rank: E = P * El
  int64_t k = 2, H = 16, F = 8, Fs = 0;
  RouterScore score = RouterScore::kSoftmax;
  bool pre_softmax = false;
  bool skew = false;  // an expert bias that sends every token to rank 0's experts
  Activation act = Activation::kSwiGLU;
  double capacity_factor = 0;
  DropPolicy policy = DropPolicy::kProbs;
  float aux = 0, z = 0;
  int32_t sequences = 0;
  std::vector<int64_t> tokens = {5, 0, 9, 3};  // rank p's: tokens[p % size]
  bool invariant = false;   // MoeLayerConfig::batch_invariant: then out and d_x are bit-equal
  bool biases = false;      // the expert FFNs' biases b_in and b_out
  bool transposed = false;  // MoeLayerConfig::expert_weights_transposed: w_in, w_out [E, out, in]
};

// The whole problem for P ranks, the same on every rank.
struct Problem {
  EpCase c;
  int P;
  int64_t E, T;
  std::vector<int64_t> first;  // [P + 1]: rank p's tokens are first[p] .. first[p + 1]
  DType dt;
  MoeLayerConfig cfg;
  // The one-rank layer's on all the tokens: the same but that the sequence-level loss then
  // counts every rank's sequences (P * B; equal only with equal token counts).
  MoeLayerConfig all_cfg;
  std::vector<float> bias;
  HostTensor x, router, w_in, w_out, shared_in, shared_out, b_in, b_out, d_out;

  Problem(const EpCase& ec, int ranks, DType t)
      : c(ec),
        P(ranks),
        E(ranks * ec.El),
        T(total_tokens(ec, ranks)),
        dt(t),
        x(t, {T, ec.H}),
        router(t, {ec.H, E}),
        w_in(t, {E, ec.H, is_gated(ec.act) ? 2 * ec.F : ec.F}),
        w_out(t, {E, ec.F, ec.H}),
        shared_in(t, {ec.H, is_gated(ec.act) ? 2 * ec.Fs : ec.Fs}),
        shared_out(t, {ec.Fs, ec.H}),
        b_in(t, {E, is_gated(ec.act) ? 2 * ec.F : ec.F}),
        b_out(t, {E, ec.H}),
        d_out(t, {T, ec.H}) {
    first.push_back(0);
    for (int p = 0; p < P; ++p) first.push_back(first.back() + tokens_of(ec, p));
    std::mt19937 rng(1234u + static_cast<unsigned>(P));
    for (HostTensor* h : {&x, &router, &w_in, &w_out, &shared_in, &shared_out, &d_out}) {
      h->fill_random(rng);
    }
    b_in.fill_random(rng);
    b_out.fill_random(rng);
    if (ec.skew) {
      bias.assign(static_cast<size_t>(E), -4.0f);
      for (int64_t e = 0; e < ec.k; ++e) bias[static_cast<size_t>(e)] = 4.0f;
    }
    cfg.hidden = ec.H, cfg.ffn = ec.F, cfg.num_experts = E, cfg.shared_ffn = ec.Fs;
    cfg.route.k = static_cast<int32_t>(ec.k);
    cfg.route.score = ec.score;
    cfg.route.pre_softmax = ec.pre_softmax;
    cfg.route.expert_bias = bias;
    cfg.activation = ec.act;
    cfg.capacity_factor = ec.capacity_factor;
    cfg.drop_policy = ec.policy;
    cfg.aux_loss_coeff = ec.aux;
    cfg.z_loss_coeff = ec.z;
    cfg.aux_loss_sequences = ec.sequences;
    cfg.batch_invariant = ec.invariant;
    if (ec.transposed) {
      w_in = transposed_matrices(w_in);
      w_out = transposed_matrices(w_out);
      cfg.expert_weights_transposed = true;
    }
    all_cfg = cfg;
    all_cfg.aux_loss_sequences = ec.sequences * P;
  }
  static int64_t tokens_of(const EpCase& c, int p) {
    return c.tokens[static_cast<size_t>(p) % c.tokens.size()];
  }
  static int64_t total_tokens(const EpCase& c, int P) {
    int64_t t = 0;
    for (int p = 0; p < P; ++p) t += tokens_of(c, p);
    return t;
  }
};

// Rows [lo, hi) of a tensor's first dimension, as a view.
template <class View>
View rows(HostTensor& t, int64_t lo, int64_t hi) {
  View v = t.view<View>();
  v.data = t.bytes.data() + lo * v.stride[0] * static_cast<int64_t>(dtype_size(t.dtype));
  v.shape[0] = hi - lo;
  return v;
}

// One layer's outputs and gradients.
struct Result {
  HostTensor out, d_x, router, w_in, w_out, shared_in, shared_out, b_in, b_out;
  float aux = 0, z = 0;
  Result(const Problem& pb, int64_t T, int64_t experts)
      : out(pb.dt, {T, pb.c.H}),
        d_x(pb.dt, {T, pb.c.H}),
        router(pb.dt, pb.router.shape),
        w_in(pb.dt, {experts, pb.w_in.shape[1], pb.w_in.shape[2]}),
        w_out(pb.dt, {experts, pb.w_out.shape[1], pb.w_out.shape[2]}),
        shared_in(pb.dt, pb.shared_in.shape),
        shared_out(pb.dt, pb.shared_out.shape),
        b_in(pb.dt, {experts, pb.b_in.shape[1]}),
        b_out(pb.dt, {experts, pb.b_out.shape[1]}) {}
  MoeLayerWeightGrads grads(const EpCase& c) {
    MoeLayerWeightGrads g{.router = router.mut(), .w_in = w_in.mut(), .w_out = w_out.mut()};
    if (c.Fs > 0) g.shared_in = shared_in.mut(), g.shared_out = shared_out.mut();
    if (c.biases) g.b_in = b_in.mut(), g.b_out = b_out.mut();
    return g;
  }
};

MoeLayerWeights weights_of(Problem& pb, int64_t e0, int64_t e1) {
  MoeLayerWeights w{pb.router.in(),
                    rows<ConstTensorView>(pb.w_in, e0, e1),
                    rows<ConstTensorView>(pb.w_out, e0, e1),
                    {},
                    {}};
  if (pb.c.Fs > 0) w.shared_in = pb.shared_in.in(), w.shared_out = pb.shared_out.in();
  if (pb.c.biases) {
    w.b_in = rows<ConstTensorView>(pb.b_in, e0, e1);
    w.b_out = rows<ConstTensorView>(pb.b_out, e0, e1);
  }
  return w;
}

// The one-rank layer on tokens [t0, t1) with every expert.
Result one_rank(Problem& pb, int64_t t0, int64_t t1, float d_aux, float d_z) {
  const int64_t T = t1 - t0;
  Result r(pb, T, pb.E);
  const MoeLayerConfig& cfg = T == pb.T ? pb.all_cfg : pb.cfg;
  const MoeLayerWorkspace ws = moe_layer_workspace(cfg, T, pb.dt);
  Bytes saved(std::max<size_t>(ws.saved_bytes, 64)), fwd(std::max<size_t>(ws.forward_bytes, 64)),
      bwd(std::max<size_t>(ws.backward_bytes, 64));
  const MoeLayerWeights w = weights_of(pb, 0, pb.E);
  const ConstTensorView x = rows<ConstTensorView>(pb.x, t0, t1);
  Status s = moe_layer_forward(x, w, cfg, saved, fwd, {r.out.mut(), &r.aux, &r.z, {}});
  EXPECT_TRUE(s.ok()) << s.message();
  s = moe_layer_backward(x, w, cfg, saved, rows<ConstTensorView>(pb.d_out, t0, t1), d_aux, d_z, bwd,
                         r.d_x.mut(), r.grads(pb.c));
  EXPECT_TRUE(s.ok()) << s.message();
  return r;
}

// Elements that differ by more than the tolerance (reported, with the first), and elements that
// differ at all (returned).
int64_t compare(const char* what, const HostTensor& got, const HostTensor& want, int64_t want_row0,
                double tol) {
  int64_t n = 1;  // from the shape: an empty tensor still holds one element of storage
  for (int64_t d : got.shape) n *= d;
  const int64_t offset = want_row0 * (n / std::max<int64_t>(got.shape[0], 1));
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = got.get_flat(i), w = want.get_flat(offset + i);
    if (g != w) ++differ;
    if (std::fabs(g - w) > tol * (1 + std::fabs(w))) {
      ADD_FAILURE() << what << "[" << i << "] = " << g << ", want " << w;
      return differ;
    }
  }
  return differ;
}

// Elements not bit-equal to the reference, by kind.
struct Report {
  int64_t out = 0, d_x = 0, experts = 0, replicated = 0;
};

void check_rank(Communicator& comm, Problem& pb, const std::vector<Result>& refs, bool per_rank,
                float d_aux, float d_z, Report& report) {
  const int p = comm.rank();
  const int64_t t0 = pb.first[p], t1 = pb.first[p + 1], El = pb.c.El;
  const double tol = pb.dt == DType::kF32 ? 2e-5 : 1.0 / 64;
  Result r(pb, t1 - t0, El);
  MoeLayerEpState state;
  HostTensor tpe(DType::kI32, {pb.E});
  const MoeLayerWeights w = weights_of(pb, p * El, (p + 1) * El);
  const ConstTensorView x = rows<ConstTensorView>(pb.x, t0, t1);
  MoeLayerProfile prof;
  Status s = moe_layer_ep_forward(x, w, pb.cfg, comm, &state,
                                  {r.out.mut(), &r.aux, &r.z, tpe.mut()}, &prof);
  ASSERT_TRUE(s.ok()) << s.message();  // every rank alike: the ranks agreed
  s = moe_layer_ep_backward(x, w, pb.cfg, comm, &state, rows<ConstTensorView>(pb.d_out, t0, t1),
                            d_aux, d_z, r.d_x.mut(), r.grads(pb.c));
  ASSERT_TRUE(s.ok()) << s.message();
  if (pb.P > 1 && t1 > t0) {
    EXPECT_GT(prof.ms[static_cast<int>(MoeStep::kDispatch)], 0.0);
    EXPECT_GT(prof.ms[static_cast<int>(MoeStep::kCombine)], 0.0);
  }

  // The reference of this rank's tokens: the one-rank layer on all tokens, or on its own.
  const Result& ref = per_rank ? refs[p] : refs[0];
  const int64_t row0 = per_rank ? 0 : t0;
  report.out += compare("out", r.out, ref.out, row0, tol);
  report.d_x += compare("d_x", r.d_x, ref.d_x, row0, tol);
  // The rank's experts' gradients: the reference's for experts p*El ..; with per-rank
  // references, the sum of every rank's.
  if (per_rank) {
    HostTensor w_in_sum(DType::kF32, r.w_in.shape), w_out_sum(DType::kF32, r.w_out.shape);
    w_in_sum.fill(0.0f);
    w_out_sum.fill(0.0f);
    const int64_t n_in = w_in_sum.shape[1] * w_in_sum.shape[2],
                  n_out = w_out_sum.shape[1] * w_out_sum.shape[2];
    for (const Result& q : refs) {
      for (int64_t i = 0; i < El * n_in; ++i) {
        w_in_sum.set_flat(i, w_in_sum.get_flat(i) + q.w_in.get_flat(p * El * n_in + i));
      }
      for (int64_t i = 0; i < El * n_out; ++i) {
        w_out_sum.set_flat(i, w_out_sum.get_flat(i) + q.w_out.get_flat(p * El * n_out + i));
      }
    }
    compare("d_w_in", r.w_in, w_in_sum, 0, 10 * tol);
    compare("d_w_out", r.w_out, w_out_sum, 0, 10 * tol);
    if (pb.c.biases) {  // likewise the sum of every rank's
      for (auto [name, got, want] : {std::tuple{"d_b_in", &r.b_in, &Result::b_in},
                                     std::tuple{"d_b_out", &r.b_out, &Result::b_out}}) {
        HostTensor sum(DType::kF32, got->shape);
        sum.fill(0.0f);
        const int64_t n = got->shape[1];
        for (const Result& q : refs) {
          for (int64_t i = 0; i < El * n; ++i) {
            sum.set_flat(i, sum.get_flat(i) + (q.*want).get_flat(p * El * n + i));
          }
        }
        compare(name, *got, sum, 0, 10 * tol);
      }
    }
  } else {
    // Each expert sees the one-rank layer's rows, in its order (SPEC.md section 4): the same
    // grouped matmul problems, so its gradients are bit-equal.
    report.experts += compare("d_w_in", r.w_in, ref.w_in, p * El, tol);
    report.experts += compare("d_w_out", r.w_out, ref.w_out, p * El, tol);
    if (pb.c.biases) {  // each expert's rows' sums, in the same order
      report.experts += compare("d_b_in", r.b_in, ref.b_in, p * El, tol);
      report.experts += compare("d_b_out", r.b_out, ref.b_out, p * El, tol);
    }
    EXPECT_EQ(report.experts, 0) << "an expert's gradient is not bit-equal to the one-rank layer's";
    report.replicated += compare("d_router", r.router, ref.router, 0, 10 * tol);
    if (pb.c.Fs > 0) {
      report.replicated += compare("d_shared_in", r.shared_in, ref.shared_in, 0, 10 * tol);
      report.replicated += compare("d_shared_out", r.shared_out, ref.shared_out, 0, 10 * tol);
    }
    EXPECT_NEAR(r.aux, ref.aux, 1e-5 * (1 + std::fabs(ref.aux)));
    EXPECT_NEAR(r.z, ref.z, 1e-5 * (1 + std::fabs(ref.z)));
  }
  // The group's rows per expert: the one-rank layer's (dropless) counts.
  int64_t rows_total = 0;
  for (int64_t e = 0; e < pb.E; ++e) rows_total += static_cast<int64_t>(tpe.get({e}));
  if (pb.c.capacity_factor == 0) EXPECT_EQ(rows_total, pb.T * pb.c.k);
  EXPECT_EQ(state.plan().num_experts, pb.E);
}

void run_case(const EpCase& c, DType dt) {
  for (int P : rank_counts()) {
    Problem pb(c, P, dt);
    SCOPED_TRACE(testing::Message()
                 << c.name << " " << dtype_name(dt) << " P=" << P << " T=" << pb.T);
    const float d_aux = 0.7f, d_z = 1.3f;
    const bool per_rank = c.capacity_factor > 0;
    std::vector<Result> refs;
    if (per_rank) {
      for (int p = 0; p < P; ++p) refs.push_back(one_rank(pb, pb.first[p], pb.first[p + 1], 0, 0));
    } else {
      refs.push_back(one_rank(pb, 0, pb.T, d_aux, d_z));
    }
    std::vector<Report> reports(static_cast<size_t>(P));
    on_ranks(P, [&](Communicator& comm) {
      check_rank(comm, pb, refs, per_rank, per_rank ? 0 : d_aux, per_rank ? 0 : d_z,
                 reports[static_cast<size_t>(comm.rank())]);
    });
    Report sum;
    for (const Report& r : reports) {
      sum.out += r.out, sum.d_x += r.d_x, sum.experts += r.experts;
      sum.replicated += r.replicated;
    }
    // Not asserted but where it holds by construction (above): the rest is reported. The
    // replicated weights' gradients are sums over the ranks (another order than one rank's), and
    // d_x and out go through the router's GEMM on T_p rows instead of T, whose rows oneDNN may
    // compute in another order for another row count.
    const std::string line = fmt::format(
        "{} {} P={}: elements not bit-equal to the one-rank layer's: out {}, d_x {}, expert "
        "gradients {}, router and shared gradients {}",
        c.name, dtype_name(dt), P, sum.out, sum.d_x, sum.experts, sum.replicated);
    testing::Test::RecordProperty(fmt::format("{}_{}_P{}", c.name, dtype_name(dt), P), line);
    std::printf("%s\n", line.c_str());
    // EP-invariance: in the batch-invariant mode a token's output and d_x are the same bits on
    // P ranks as on one (dropless; the one-rank layer itself is batch-invariant in the mode).
    if (c.invariant) {
      EXPECT_EQ(sum.out, 0) << line;
      EXPECT_EQ(sum.d_x, 0) << line;
    }
  }
}

const EpCase kCases[] = {
    {.name = "mixtral_like"},
    {.name = "losses_and_shared",
     .k = 3,
     .Fs = 6,
     .score = RouterScore::kSigmoid,
     .act = Activation::kGeGLU,
     .aux = 0.01f,
     .z = 0.001f},
    {.name = "pre_softmax_seq_loss",
     .El = 4,
     .k = 4,
     .pre_softmax = true,
     .aux = 0.02f,
     .sequences = 2,
     .tokens = {6}},  // equal counts: the one-rank layer's sequences are then the ranks'

    {.name = "all_to_rank0", .score = RouterScore::kSigmoid, .skew = true, .aux = 0.01f},
    {.name = "one_expert_per_rank", .El = 1, .k = 1, .act = Activation::kRelu},
    {.name = "capacity", .capacity_factor = 1.0, .policy = DropPolicy::kPosition},
    {.name = "capacity_probs", .k = 3, .capacity_factor = 0.75},
    // The batch-invariant mode, at sizes where the default mode's rows differ from one rank's.
    {.name = "invariant", .k = 2, .H = 160, .F = 48, .tokens = {40, 0, 77, 3}, .invariant = true},
    {.name = "invariant_shared_losses",
     .k = 3,
     .H = 160,
     .F = 48,
     .Fs = 40,
     .score = RouterScore::kSigmoid,
     .aux = 0.01f,
     .z = 0.001f,
     .tokens = {40, 1, 77, 3},
     .invariant = true},
    // The expert FFNs' biases live with their experts: each rank adds its own and returns their
    // gradients; dropless, with a shared expert and the losses, and with a capacity.
    {.name = "biases",
     .k = 3,
     .Fs = 6,
     .aux = 0.01f,
     .z = 0.001f,
     .tokens = {5, 0, 9, 3},
     .biases = true},
    {.name = "biases_capacity", .capacity_factor = 0.75, .biases = true},
    // The experts' weights stored [E_loc, out, in], each rank's read as they lie.
    {.name = "transposed_weights",
     .k = 3,
     .Fs = 6,
     .aux = 0.01f,
     .tokens = {5, 0, 9, 3},
     .biases = true,
     .transposed = true},
};

void PrintTo(const EpCase& c, std::ostream* os) { *os << c.name; }

class LayerEp : public testing::TestWithParam<EpCase> {};

TEST_P(LayerEp, EqualsTheOneRankLayerF32) { run_case(GetParam(), DType::kF32); }
TEST_P(LayerEp, EqualsTheOneRankLayerBf16) { run_case(GetParam(), DType::kBF16); }

INSTANTIATE_TEST_SUITE_P(Cases, LayerEp, testing::ValuesIn(kCases),
                         [](const testing::TestParamInfo<EpCase>& i) { return i.param.name; });

// Experts [e0, e1) of [E, K, n] weights, packed (pack_ragged_rhs).
HostTensor packed_experts(HostTensor& w, int64_t e0, int64_t e1) {
  const PackedRhsShape s = packed_rhs_shape(e1 - e0, w.shape[1], w.shape[2], w.dtype);
  HostTensor p(w.dtype, {s.dims[0], s.dims[1], s.dims[2]});
  const Status st = pack_ragged_rhs(rows<ConstTensorView>(w, e0, e1), p.mut());
  EXPECT_TRUE(st.ok()) << st.message();
  return p;
}

// config.expert_weights_packed over P ranks: each rank packs its own experts, and the forward
// equals the one-rank forward on every expert packed, on the concatenated tokens (dropless): to
// the rounding of the router's GEMM on T_p rows instead of T, and bit for bit in the
// batch-invariant mode (the packed kernel's sums, like every step's there, do not depend on the
// other rows). Cases: a shared expert and the losses; every token sent to rank 0's experts (the
// other ranks' groups all empty); one expert a rank, ReLU (w_in [E_loc, H, F], not gated); the
// batch-invariant mode. The backward refuses packed weights on every rank, and the group still
// works.
TEST(LayerEpPacked, TheForwardEqualsTheOneRankForwardOnPackedWeights) {
  for (const std::string name : {"mixtral_like", "losses_and_shared", "all_to_rank0",
                                 "one_expert_per_rank", "invariant_shared_losses"}) {
    const EpCase& c = *std::find_if(std::begin(kCases), std::end(kCases),
                                    [&](const EpCase& e) { return e.name == name; });
    for (DType dt : {DType::kF32, DType::kBF16}) {
      for (int P : rank_counts()) {
        Problem pb(c, P, dt);
        SCOPED_TRACE(testing::Message() << name << " " << dtype_name(dt) << " P=" << P);
        pb.cfg.expert_weights_packed = pb.all_cfg.expert_weights_packed = true;
        Result ref(pb, pb.T, pb.E);
        HostTensor all_in = packed_experts(pb.w_in, 0, pb.E),
                   all_out = packed_experts(pb.w_out, 0, pb.E);
        MoeLayerWeights all = weights_of(pb, 0, pb.E);
        all.w_in = all_in.in(), all.w_out = all_out.in();
        const MoeLayerWorkspace ws = moe_layer_workspace(pb.all_cfg, pb.T, dt);
        Bytes saved(std::max<size_t>(ws.saved_bytes, 64)),
            fwd(std::max<size_t>(ws.forward_bytes, 64));
        const Status s = moe_layer_forward(pb.x.in(), all, pb.all_cfg, saved, fwd,
                                           {ref.out.mut(), &ref.aux, &ref.z, {}});
        ASSERT_TRUE(s.ok()) << s.message();
        on_ranks(P, [&](Communicator& comm) {
          const int p = comm.rank();
          const int64_t t0 = pb.first[p], t1 = pb.first[p + 1], El = pb.c.El;
          HostTensor w_in = packed_experts(pb.w_in, p * El, (p + 1) * El),
                     w_out = packed_experts(pb.w_out, p * El, (p + 1) * El);
          MoeLayerWeights w = weights_of(pb, p * El, (p + 1) * El);
          w.w_in = w_in.in(), w.w_out = w_out.in();
          const ConstTensorView x = rows<ConstTensorView>(pb.x, t0, t1);
          Result r(pb, t1 - t0, El);
          MoeLayerEpState state;
          Status st =
              moe_layer_ep_forward(x, w, pb.cfg, comm, &state, {r.out.mut(), &r.aux, &r.z, {}});
          ASSERT_TRUE(st.ok()) << st.message();
          const int64_t differ =
              compare("out", r.out, ref.out, t0, dt == DType::kF32 ? 2e-5 : 1.0 / 64);
          if (c.invariant) EXPECT_EQ(differ, 0);
          EXPECT_NEAR(r.aux, ref.aux, 1e-5 * (1 + std::fabs(ref.aux)));
          EXPECT_NEAR(r.z, ref.z, 1e-5 * (1 + std::fabs(ref.z)));
          st = moe_layer_ep_backward(x, w, pb.cfg, comm, &state,
                                     rows<ConstTensorView>(pb.d_out, t0, t1), 0, 0, r.d_x.mut(),
                                     r.grads(pb.c));
          EXPECT_FALSE(st.ok());
          EXPECT_NE(st.message().find("config.expert_weights_packed"), std::string::npos)
              << st.message();
          st =
              moe_layer_ep_forward(x, w, pb.cfg, comm, &state, {r.out.mut(), nullptr, nullptr, {}});
          EXPECT_TRUE(st.ok()) << st.message();
        });
      }
    }
  }
}

// A bad argument on one rank is an error on every rank, naming it, and the group still works.
TEST(LayerEpErrors, ABadArgumentOnAnyRankIsAnErrorOnEveryRank) {
  for (int P : rank_counts()) {
    Problem pb(kCases[0], P, DType::kF32);
    Problem pb_bf16(kCases[0], P, DType::kBF16);
    on_ranks(P, [&](Communicator& comm) {
      const int p = comm.rank(), last = P - 1;
      const int64_t t0 = pb.first[p], t1 = pb.first[p + 1], El = pb.c.El;
      auto expect_everywhere = [&](const Status& s, const std::string& what, int culprit) {
        test::expect_error_everywhere(comm, s, what, culprit);
      };
      Result r(pb, t1 - t0, El);
      MoeLayerEpState state;
      const ConstTensorView x = rows<ConstTensorView>(pb.x, t0, t1);
      const ConstTensorView d_out = rows<ConstTensorView>(pb.d_out, t0, t1);
      const MoeLayerWeights w = weights_of(pb, p * El, (p + 1) * El);
      const MoeLayerOutputs out{r.out.mut(), nullptr, nullptr, {}};
      // Another number of local experts on the last rank.
      const MoeLayerWeights two = weights_of(pb, p * El, p * El + 2);
      expect_everywhere(moe_layer_ep_forward(x, p == last ? two : w, pb.cfg, comm, &state, out),
                        "weights.w_in.shape", last);
      // A backward whose state holds no forward, on the last rank.
      ASSERT_TRUE(moe_layer_ep_forward(x, w, pb.cfg, comm, &state, out).ok());
      MoeLayerEpState fresh;
      expect_everywhere(moe_layer_ep_backward(x, w, pb.cfg, comm, p == last ? &fresh : &state,
                                              d_out, 0, 0, r.d_x.mut(), r.grads(pb.c)),
                        "state", last);
      if (P > 1) {
        // Experts not divisible by the ranks.
        MoeLayerConfig odd = pb.cfg;
        odd.num_experts = pb.E + 1;
        expect_everywhere(moe_layer_ep_forward(x, w, odd, comm, &state, out), "divisible by the",
                          0);
        // Configs that differ, and dtypes that differ.
        MoeLayerConfig other = pb.cfg;
        other.z_loss_coeff = 0.5f;
        Status s = moe_layer_ep_forward(x, w, p == 0 ? other : pb.cfg, comm, &state, out);
        EXPECT_NE(s.message().find("config (every field)"), std::string::npos) << s.message();
        Result rb(pb_bf16, t1 - t0, El);
        s = p == 0 ? moe_layer_ep_forward(rows<ConstTensorView>(pb_bf16.x, t0, t1),
                                          weights_of(pb_bf16, 0, El), pb.cfg, comm, &state,
                                          {rb.out.mut(), nullptr, nullptr, {}})
                   : moe_layer_ep_forward(x, w, pb.cfg, comm, &state, out);
        EXPECT_NE(s.message().find("x.dtype = bf16 on rank 0, f32 on rank 1"), std::string::npos)
            << s.message();
        // Cotangents of the losses that differ between ranks.
        ASSERT_TRUE(moe_layer_ep_forward(x, w, pb.cfg, comm, &state, out).ok());
        s = moe_layer_ep_backward(x, w, pb.cfg, comm, &state, d_out, p == 0 ? 2.0f : 1.0f, 0,
                                  r.d_x.mut(), r.grads(pb.c));
        EXPECT_NE(s.message().find("d_aux_loss"), std::string::npos) << s.message();
      }
      // After all that, the group works.
      ASSERT_TRUE(moe_layer_ep_forward(x, w, pb.cfg, comm, &state, out).ok());
      ASSERT_TRUE(
          moe_layer_ep_backward(x, w, pb.cfg, comm, &state, d_out, 0, 0, r.d_x.mut(), r.grads(pb.c))
              .ok());
    });
  }
}

}  // namespace
}  // namespace moekit
