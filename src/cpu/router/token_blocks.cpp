// The route forward with the tokens in the vector lanes. A block of rows is transposed so that
// one vector holds one expert's logits for N tokens; then every step is a loop over the experts,
// a whole vector at a time, with nothing reduced across lanes and no branch on the data:
//   scores   softmax (pre), sigmoid or sqrt(softplus), as scores-inl.h computes them for rows;
//   groups   each group's sum of its top k / group_topk keys, and each group's rank among them;
//   top k    an insertion network of k + 1 slots, one max and one min per slot per expert;
//   weights  gathered for the k chosen, normalised, scaled, and sorted by a compare-exchange
//            network into the output order (descending weight, ties to the lower expert).
//
// The network compares packed int32 keys: the key's bits made to order as signed integers, with
// the low b bits (b = bits of E - 1) replaced by E - 1 - e, so that one signed max / min orders by
// key and then by lower expert. Replacing those bits is exact when they are 0 in every key of the
// row (bf16 logits under post-softmax, for instance). When they are not, the top k of the packed
// keys is still the true top k unless the k-th and (k+1)-th packed keys agree above the low bits;
// such rows are reported undecided, as are rows with a non-finite key or a NaN logit (NaN has no
// order; router.h's NaN rule is the reference's), and the caller routes them with the row
// kernels. Sums over the k chosen are taken in the packed order, the choice order up to
// near-ties, so weights match the row kernels' to f32 rounding.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/router/token_blocks.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cpu/convert.h"
#include "cpu/lanes-inl.h"
#include "cpu/router/problems.h"
#include "cpu/router/scores-inl.h"

HWY_BEFORE_NAMESPACE();
namespace moekit::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;
using DI = hn::RebindToSigned<D>;
using VI = hn::Vec<DI>;

// ---------------------------------------------------------------------------------------------
// Transposition: xt[e * N + l] = logit e of row l, as f32.

// Experts [e0, e1) one element at a time (narrow targets, and the experts past the last whole
// vector).
void TransposeScalar(const char* const* rows, DType t, size_t N, int64_t e0, int64_t e1,
                     float* xt) {
  for (int64_t e = e0; e < e1; ++e) {
    for (size_t l = 0; l < N; ++l)
      xt[e * static_cast<int64_t>(N) + l] = load_as_float(rows[l], t, e);
  }
}

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// The activation a transposition can apply on its way out (Activation::kNone: the logits).
enum class Activation { kNone, kSigmoid, kSqrtSoftplus };

template <Activation kAct>
HWY_INLINE V Activate(D d, V x) {
  if constexpr (kAct == Activation::kSigmoid) return rmath::Sigmoid(d, x);
  if constexpr (kAct == Activation::kSqrtSoftplus) return rmath::SqrtSoftplus(d, x);
  return x;
}

// Transposes the 16x16 floats of r[0, 16) (r[i] lane j is element (i, j)) in four rounds of
// in-register shuffles (pairs of floats, pairs of pairs, then 128-bit blocks twice) and hands
// column j, as a vector, to put(j, column). r is clobbered.
template <class Put>
HWY_INLINE void Transpose16x16(__m512* r, Put put) {
  __m512 t[16];
  // t[2i], t[2i + 1]: r[2i] and r[2i + 1] interleaved, per 128-bit block.
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // r[4q + c], block b: elements (4q .. 4q + 3, 4b + c).
  for (int q = 0; q < 16; q += 4) {
    r[q] = _mm512_shuffle_ps(t[q], t[q + 2], 0x44);
    r[q + 1] = _mm512_shuffle_ps(t[q], t[q + 2], 0xEE);
    r[q + 2] = _mm512_shuffle_ps(t[q + 1], t[q + 3], 0x44);
    r[q + 3] = _mm512_shuffle_ps(t[q + 1], t[q + 3], 0xEE);
  }
  // Column 4b + c takes block b of r[c], r[4 + c], r[8 + c], r[12 + c], in that order.
  for (int c = 0; c < 4; ++c) {
    const __m512 even_lo = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);  // blocks 0, 2
    const __m512 odd_lo = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);   // blocks 1, 3
    const __m512 even_hi = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    const __m512 odd_hi = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
    put(c, _mm512_shuffle_f32x4(even_lo, even_hi, 0x88));
    put(4 + c, _mm512_shuffle_f32x4(odd_lo, odd_hi, 0x88));
    put(8 + c, _mm512_shuffle_f32x4(even_lo, even_hi, 0xDD));
    put(12 + c, _mm512_shuffle_f32x4(odd_lo, odd_hi, 0xDD));
  }
}

// Experts [e0, e0 + 16) of 16 rows, the row vectors transposed into expert vectors. Also asks
// for the same experts of the next 16 rows, `next`, ahead of their use, and stores each
// expert's vector through kAct (the score computed while the vector is in a register).
template <bool kBf16, Activation kAct>
void Transpose16(const char* const* rows, const char* const* next, int64_t e0, float* xt) {
  const D d;
  static_assert(HWY_LANES(float) == 16, "AVX-512 holds 16 floats");
  constexpr int64_t kElem = kBf16 ? 2 : 4;
  __m512 r[16];
  for (int l = 0; l < 16; ++l) {
    r[l] = LoadLanes<kBf16>(d, rows[l], static_cast<size_t>(e0)).raw;
    hwy::Prefetch(next[l] + e0 * kElem);
  }
  float* out = xt + e0 * 16;
  Transpose16x16(r, [d, out](int expert, __m512 v) {
    hn::Store(Activate<kAct>(d, V{v}), d, out + expert * 16);
  });
}
#endif

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// The whole 16-expert tiles of the 16 rows through Transpose16; returns the first expert left.
template <Activation kAct>
int64_t TransposeTiles(bool bf16, const char* const* rows, const char* const* next, int64_t E,
                       float* xt) {
  int64_t e = 0;
  for (; e + 16 <= E; e += 16) {
    bf16 ? Transpose16<true, kAct>(rows, next, e, xt) : Transpose16<false, kAct>(rows, next, e, xt);
  }
  return e;
}
#endif

// All E experts of N rows into xt (aligned); `next`: the N rows after them, to prefetch. Where
// the options' score is an activation, the whole tiles of experts go out as scores; returns the
// first expert whose vector is still a logit (Scores takes it from there).
int64_t Transpose(const RouteOptions& o, const char* const* rows, const char* const* next, DType t,
                  int64_t E, float* xt) {
  int64_t tiled = 0, scored = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  const bool bf16 = t == DType::kBF16;
  if (o.score == RouterScore::kSigmoid) {
    tiled = scored = TransposeTiles<Activation::kSigmoid>(bf16, rows, next, E, xt);
  } else if (o.score == RouterScore::kSqrtSoftplus) {
    tiled = scored = TransposeTiles<Activation::kSqrtSoftplus>(bf16, rows, next, E, xt);
  } else {
    tiled = TransposeTiles<Activation::kNone>(bf16, rows, next, E, xt);  // softmax: unscored
  }
#else
  (void)o;
  (void)next;
#endif
  TransposeScalar(rows, t, hn::Lanes(D()), tiled, E, xt);
  return scored;
}

// ---------------------------------------------------------------------------------------------
// Scores, in place: xt becomes the scores weights are taken from (the logits themselves under
// post-softmax); experts below `from` are scores already.
void Scores(const RouteOptions& o, int64_t E, int64_t from, float* xt) {
  const D d;
  const size_t N = hn::Lanes(d);
  if (o.score == RouterScore::kSoftmax && !o.pre_softmax) return;
  if (o.score == RouterScore::kSoftmax) {
    V m = hn::Set(d, -HUGE_VALF);
    for (int64_t e = 0; e < E; ++e) m = hn::Max(m, hn::Load(d, xt + e * N));
    V sum = hn::Zero(d);
    for (int64_t e = 0; e < E; ++e) {
      const V s = rmath::ExpShifted(d, hn::Load(d, xt + e * N), m);
      hn::Store(s, d, xt + e * N);
      sum = hn::Add(sum, s);
    }
    const V inv = hn::Div(hn::Set(d, 1.0f), sum);
    for (int64_t e = 0; e < E; ++e) hn::Store(hn::Mul(hn::Load(d, xt + e * N), inv), d, xt + e * N);
    return;
  }
  const bool sigmoid = o.score == RouterScore::kSigmoid;
  for (int64_t e = from; e < E; ++e) {
    const V x = hn::Load(d, xt + e * N);
    hn::Store(sigmoid ? rmath::Sigmoid(d, x) : rmath::SqrtSoftplus(d, x), d, xt + e * N);
  }
}

// The key expert e is chosen by: its score plus its bias (bias: [E], zeros when the options have
// none; adding 0 also makes -0 into +0, so that the packed keys of equal scores are equal).
HWY_INLINE V Key(const float* xt, const float* bias, int64_t e, size_t N) {
  const D d;
  return hn::Add(hn::Load(d, xt + e * static_cast<int64_t>(N)), hn::Set(d, bias[e]));
}

// ---------------------------------------------------------------------------------------------
// Group-limited choice: kept[g * N + l] = all ones when group g is among row l's best group_topk,
// else 0 (as float bits).
void KeepGroups(const RouteOptions& o, int64_t E, const float* xt, const float* bias, float* score,
                float* kept) {
  const D d;
  const DI di;
  const size_t N = hn::Lanes(d);
  const int64_t G = o.num_groups, per_group = E / G;
  const int32_t count = o.k / o.group_topk;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t e0 = g * per_group, e1 = e0 + per_group;
    V sum;
    if (count <= 2) {
      // The largest and second largest in registers.
      V hi = hn::Set(d, -HUGE_VALF), lo = hi;
      for (int64_t e = e0; e < e1; ++e) {
        const V c = Key(xt, bias, e, N);
        lo = hn::Max(lo, hn::Min(hi, c));
        hi = hn::Max(hi, c);
      }
      sum = count == 1 ? hi : hn::Add(hi, lo);
    } else {
      // The group's `count` largest keys, best first, by max / min insertion.
      V top[kLaneMaxK];
      for (V& slot : top) slot = hn::Set(d, -HUGE_VALF);
      for (int64_t e = e0; e < e1; ++e) {
        V c = Key(xt, bias, e, N);
        for (int32_t j = 0; j < count; ++j) {
          const V hi = hn::Max(top[j], c);
          c = hn::Min(top[j], c);
          top[j] = hi;
        }
      }
      sum = top[0];
      for (int32_t j = 1; j < count; ++j) sum = hn::Add(sum, top[j]);
    }
    // Added largest first, as the row kernels do.
    hn::Store(sum, d, score + g * N);
  }
  // Rank = groups ahead (a higher score, or an equal one at a lower index).
  for (int64_t g = 0; g < G; ++g) {
    const V sg = hn::Load(d, score + g * N);
    VI rank = hn::Zero(di);
    for (int64_t h = 0; h < G; ++h) {
      const V sh = hn::Load(d, score + h * N);
      const auto ahead = h < g ? hn::Ge(sh, sg) : hn::Gt(sh, sg);
      rank = hn::Sub(rank, hn::VecFromMask(di, hn::RebindMask(di, ahead)));
    }
    const auto keep = hn::Lt(rank, hn::Set(di, o.group_topk));
    hn::Store(hn::BitCast(d, hn::VecFromMask(di, keep)), d, kept + g * N);
  }
}

// ---------------------------------------------------------------------------------------------
// Streams the lines a StreamQueue holds, a few per step of other work. Its cursor is its own, so
// that a copy of it in a hot loop lives in registers; Finish() streams the rest and empties the
// queue.
class Dripper {
 public:
  explicit Dripper(StreamQueue& q) : q_(&q) { NextRun(); }
  HWY_INLINE void Step(size_t lines) {
    const D d;
    constexpr size_t kStep = HWY_LANES(float) * sizeof(float);  // bytes per vector; divides 64
    while (lines > 0 && left_ > 0) {
      const size_t n = lines < left_ ? lines : left_;
      for (size_t b = 0; b < n * StreamQueue::kLine; b += kStep) {
        hn::Stream(hn::LoadU(d, reinterpret_cast<const float*>(src_ + b)), d,
                   reinterpret_cast<float*>(dst_ + b));
      }
      src_ += n * StreamQueue::kLine;
      dst_ += n * StreamQueue::kLine;
      left_ -= n;
      lines -= n;
      if (left_ == 0) NextRun();
    }
  }
  void Finish() {
    while (left_ > 0) Step(64);
    q_->count = q_->next = 0;
  }

 private:
  void NextRun() {
    left_ = 0;
    if (q_->next == q_->count) return;
    const StreamQueue::Run& run = q_->runs[q_->next++];
    src_ = run.src;
    dst_ = run.dst;
    left_ = run.lines;
  }

  StreamQueue* q_;
  const char* src_ = nullptr;
  char* dst_ = nullptr;
  size_t left_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The top k by packed keys, the weights, and the output order, for one vector of rows. C >= k + 1
// slots. Returns the lanes left undecided as a mask.
// bias: as Key's. Streams queued output lines as it goes.
template <int C, bool kGroups>
hn::Mask<D> ChooseAndWeigh(const RouteOptions& o, int64_t E, const float* xt, const float* bias,
                           const float* kept, int32_t* chosen_t, float* weights_t,
                           Dripper& dripper) {
  const D d;
  const DI di;
  const size_t N = hn::Lanes(d);
  const int32_t k = o.k;
  int32_t bits = 0;
  while ((int64_t{1} << bits) < E) ++bits;
  const VI low_mask = hn::Set(di, (1 << bits) - 1), high_mask = hn::Not(low_mask);

  VI top[C];
#pragma GCC unroll 32
  for (int j = 0; j < C; ++j) top[j] = hn::Set(di, INT_MIN);
  // Over every key: the smallest orderable value (a negative NaN orders below -inf), and the OR
  // of the keys' own low bits: 0 when every key's are (bf16 logits under post-softmax), and then
  // equal high bits mean equal keys, so the packing lost nothing. The largest is top[0]'s.
  VI ord_min = hn::Set(di, INT_MAX), lost = hn::Zero(di);
  const int64_t G = kGroups ? o.num_groups : 1, per_group = E / G;
  VI low = low_mask;       // (2^b - 1) - e: the low bits of expert e's packed key
  Dripper drip = dripper;  // its cursor in registers through the loop
  for (int64_t g = 0; g < G; ++g) {
    auto keep = hn::FirstN(di, N);
    if constexpr (kGroups) keep = hn::RebindMask(di, hn::MaskFromVec(hn::Load(d, kept + g * N)));
    // Expert e's packed key (INT_MIN outside the kept groups), the running checks updated.
    const auto packed = [&](int64_t e) {
      const VI key = hn::BitCast(di, Key(xt, bias, e, N));
      // Negative floats order backwards as integers: flip all but their sign bit.
      const VI ord = hn::Xor(key, hn::And(hn::ShiftRight<31>(key), hn::Set(di, INT_MAX)));
      ord_min = hn::Min(ord_min, ord);
      lost = hn::Or(lost, key);  // not ord's: ord flips a negative key's low bits
      VI c = hn::Or(hn::And(ord, high_mask), low);
      if constexpr (kGroups) c = hn::IfThenElse(keep, c, hn::Set(di, INT_MIN));
      low = hn::Sub(low, hn::Set(di, 1));
      return c;
    };
    int64_t e = g * per_group;
    const int64_t end = (g + 1) * per_group;
    if constexpr (C == 9) {
      // Eight experts at a time: sorted by a 19-comparator network, merged with the top eight
      // (the larger of each pair of top[i] and new[7 - i] is a bitonic run holding the top eight
      // of the sixteen, sorted by 12 more; the smaller ones hold the ninth), about 11 min / max
      // per expert instead of the insertion's 18.
      for (; e + 8 <= end; e += 8) {
        VI c[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) c[i] = packed(e + i);
        drip.Step(16);
        const auto cas = [](VI& a, VI& b) {  // a the larger
          const VI lo = hn::Min(a, b);
          a = hn::Max(a, b);
          b = lo;
        };
        cas(c[0], c[2]), cas(c[1], c[3]), cas(c[4], c[6]), cas(c[5], c[7]);
        cas(c[0], c[4]), cas(c[1], c[5]), cas(c[2], c[6]), cas(c[3], c[7]);
        cas(c[0], c[1]), cas(c[2], c[3]), cas(c[4], c[5]), cas(c[6], c[7]);
        cas(c[2], c[4]), cas(c[3], c[5]);
        cas(c[1], c[4]), cas(c[3], c[6]);
        cas(c[1], c[2]), cas(c[3], c[4]), cas(c[5], c[6]);
        VI ninth = top[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          ninth = hn::Max(ninth, hn::Min(top[i], c[7 - i]));
          top[i] = hn::Max(top[i], c[7 - i]);
        }
        top[8] = ninth;
        cas(top[0], top[4]), cas(top[1], top[5]), cas(top[2], top[6]), cas(top[3], top[7]);
        cas(top[0], top[2]), cas(top[1], top[3]), cas(top[4], top[6]), cas(top[5], top[7]);
        cas(top[0], top[1]), cas(top[2], top[3]), cas(top[4], top[5]), cas(top[6], top[7]);
      }
    }
    for (; e < end; ++e) {
      VI c = packed(e);
      drip.Step(2);
#pragma GCC unroll 32
      for (int j = 0; j < C; ++j) {
        // The min first: then the max can overwrite the slot in place, and the carry moves to a
        // new register each slot, with no copy between them.
        const VI lo = hn::Min(top[j], c);
        top[j] = hn::Max(top[j], c);
        c = lo;
      }
    }
  }
  dripper = drip;
  // ord(+inf) = 0x7f800000 and ord(-inf) = 0x807fffff (as a signed int): a key is non-finite
  // when its ord is at or beyond them. The largest key of all is in top[0] (a +inf or +NaN key
  // puts its group first, and a NaN group is never ranked below another, so with groups too).
  auto undecided = hn::Or(hn::Gt(hn::And(top[0], high_mask), hn::Set(di, 0x7f7fffff)),
                          hn::Lt(ord_min, hn::Set(di, static_cast<int32_t>(0x80800000u))));
  const auto lossy = hn::Ne(hn::And(lost, low_mask), hn::Zero(di));
  if (k < E) {
    // Slot k exists (C >= k + 1); an index-free comparison that ties may have chosen wrongly.
    VI kth = top[0], next = top[0];
#pragma GCC unroll 32
    for (int j = 1; j < C; ++j) {
      if (j == k) {
        kth = top[j - 1];
        next = top[j];
      }
    }
    const auto tie = hn::Eq(hn::And(hn::Xor(kth, next), high_mask), hn::Zero(di));
    undecided = hn::Or(undecided, hn::And(lossy, tie));
  }

  // Indices (clamped, so that even an undecided lane reads inside xt), scores and weights.
  const VI lane = hn::Iota(di, 0), last = hn::Set(di, static_cast<int32_t>(E - 1));
  constexpr int kSlots = C - 1;  // the output slots; those at and past k are padding
  VI idx[kSlots];
  V w[kSlots];
  // Padding slots sort last: below every finite weight, and after every expert at -inf.
#pragma GCC unroll 32
  for (int j = 0; j < kSlots; ++j) {
    w[j] = hn::Set(d, -HUGE_VALF);
    idx[j] = hn::Set(di, INT_MAX);
  }
  const bool post_softmax = o.score == RouterScore::kSoftmax && !o.pre_softmax;
  V shift = hn::Set(d, -HUGE_VALF);
#pragma GCC unroll 32
  for (int j = 0; j < kSlots; ++j) {
    if (j >= k) continue;
    idx[j] = hn::Min(hn::Sub(low_mask, hn::And(top[j], low_mask)), last);
    w[j] = hn::GatherIndex(d, xt,
                           hn::Add(hn::Mul(idx[j], hn::Set(di, static_cast<int32_t>(N))), lane));
    shift = hn::Max(shift, w[j]);
  }
  if (post_softmax) {
    // softmax over the k chosen logits, shifted by their largest.
    V sum = hn::Zero(d);
#pragma GCC unroll 32
    for (int j = 0; j < kSlots; ++j) {
      if (j >= k) continue;
      w[j] = rmath::ExpShifted(d, w[j], shift);
      sum = j == 0 ? w[j] : hn::Add(sum, w[j]);
    }
#pragma GCC unroll 32
    for (int j = 0; j < kSlots; ++j) {
      if (j < k) w[j] = hn::Div(w[j], sum);
    }
  } else if (o.score != RouterScore::kSoftmax && k > 1) {
    V sum = hn::Set(d, kNormEps);
#pragma GCC unroll 32
    for (int j = 0; j < kSlots; ++j) {
      if (j < k) sum = hn::Add(sum, w[j]);
    }
#pragma GCC unroll 32
    for (int j = 0; j < kSlots; ++j) {
      if (j < k) w[j] = hn::Div(w[j], sum);
    }
  }
  const V scale = hn::Set(d, o.scaling_factor);
#pragma GCC unroll 32
  for (int j = 0; j < kSlots; ++j) {
    if (j < k) w[j] = hn::Mul(w[j], scale);
  }
  // Sort by (weight descending, expert ascending): a bubble network of compare-exchanges, which
  // is skipped when every lane is in that order already (the choice order is the weight order
  // unless a bias or a near-tie reorders it: post-softmax rows almost always are).
  auto in_order = hn::FirstN(d, N);
#pragma GCC unroll 32
  for (int j = 1; j < kSlots; ++j) {
    const auto before =
        hn::Or(hn::Gt(w[j - 1], w[j]),
               hn::And(hn::Eq(w[j - 1], w[j]), hn::RebindMask(d, hn::Lt(idx[j - 1], idx[j]))));
    in_order = hn::And(in_order, before);
  }
  if (!hn::AllTrue(d, in_order)) {
#pragma GCC unroll 32
    for (int i = 0; i < kSlots; ++i) {
#pragma GCC unroll 32
      for (int j = kSlots - 1; j > i; --j) {
        const auto swap =
            hn::Or(hn::Gt(w[j], w[j - 1]),
                   hn::And(hn::Eq(w[j], w[j - 1]), hn::RebindMask(d, hn::Lt(idx[j], idx[j - 1]))));
        const auto swap_i = hn::RebindMask(di, swap);
        const V wa = hn::IfThenElse(swap, w[j], w[j - 1]);
        w[j] = hn::IfThenElse(swap, w[j - 1], w[j]);
        w[j - 1] = wa;
        const VI ia = hn::IfThenElse(swap_i, idx[j], idx[j - 1]);
        idx[j] = hn::IfThenElse(swap_i, idx[j - 1], idx[j]);
        idx[j - 1] = ia;
      }
    }
  }
#pragma GCC unroll 32
  for (int j = 0; j < kSlots; ++j) {
    if (j >= k) continue;
    hn::Store(idx[j], di, chosen_t + j * N);
    hn::Store(w[j], d, weights_t + j * N);
  }
  return hn::RebindMask(d, undecided);
}

// ChooseAndWeigh with the fewest slots that hold k + 1, from the few networks compiled.
hn::Mask<D> Choose(const RouteOptions& o, int64_t E, const float* xt, const float* bias,
                   const float* kept, int32_t* chosen_t, float* weights_t, Dripper& dripper) {
  const bool groups = o.num_groups > 0;
  if (o.k <= 2) {
    return groups ? ChooseAndWeigh<3, true>(o, E, xt, bias, kept, chosen_t, weights_t, dripper)
                  : ChooseAndWeigh<3, false>(o, E, xt, bias, kept, chosen_t, weights_t, dripper);
  }
  if (o.k <= 4) {
    return groups ? ChooseAndWeigh<5, true>(o, E, xt, bias, kept, chosen_t, weights_t, dripper)
                  : ChooseAndWeigh<5, false>(o, E, xt, bias, kept, chosen_t, weights_t, dripper);
  }
  if (o.k <= 8) {
    return groups ? ChooseAndWeigh<9, true>(o, E, xt, bias, kept, chosen_t, weights_t, dripper)
                  : ChooseAndWeigh<9, false>(o, E, xt, bias, kept, chosen_t, weights_t, dripper);
  }
  return groups ? ChooseAndWeigh<kLaneMaxK + 1, true>(o, E, xt, bias, kept, chosen_t, weights_t,
                                                      dripper)
                : ChooseAndWeigh<kLaneMaxK + 1, false>(o, E, xt, bias, kept, chosen_t, weights_t,
                                                       dripper);
}

// Slot-major [k, N] values (slot j of lane l at j * N + l) to rows [used, k] (row l at l * k):
// on AVX-512 one 16x16 transpose and a masked store per row.
template <typename T>
void SlotsToRows(const T* slots, int32_t k, int32_t used, T* rows) {
  static_assert(sizeof(T) == sizeof(float), "32-bit values");
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  __m512 r[16];
  for (int j = 0; j < 16; ++j) {
    r[j] = j < k ? _mm512_loadu_ps(reinterpret_cast<const float*>(slots) + j * 16)
                 : _mm512_setzero_ps();
  }
  const __mmask16 first_k = static_cast<__mmask16>((1u << k) - 1);
  auto* out = reinterpret_cast<float*>(rows);
  Transpose16x16(r, [&](int l, __m512 v) {
    if (l < used) _mm512_mask_storeu_ps(out + l * k, first_k, v);
  });
#else
  const size_t N = hn::Lanes(D());
  for (int32_t l = 0; l < used; ++l) {
    for (int32_t j = 0; j < k; ++j) rows[l * k + j] = slots[j * N + l];
  }
#endif
}

// Whether a row of E logits (f32 | bf16) holds a NaN. The kernels above take a NaN's exp as 0
// and cannot keep router.h's NaN rule, so such rows go to the row path (which takes the
// reference's).
bool RowHasNaN(const char* row, DType t, int64_t E) {
  const hn::ScalableTag<uint16_t> du16;
  const hn::ScalableTag<uint32_t> du32;
  const auto scan = [E](auto du, const auto* bits, auto magnitude, auto inf) {
    // A NaN's magnitude bits exceed the infinity's.
    const size_t n = hn::Lanes(du);
    auto nan = hn::Zero(du);
    int64_t e = 0;
    for (; e + static_cast<int64_t>(n) <= E; e += n) {
      nan = hn::Or(nan,
                   hn::VecFromMask(du, hn::Gt(hn::And(hn::LoadU(du, bits + e), magnitude), inf)));
    }
    bool tail = false;
    for (; e < E; ++e) tail |= (bits[e] & hn::GetLane(magnitude)) > hn::GetLane(inf);
    return tail || !hn::AllTrue(du, hn::Eq(nan, hn::Zero(du)));
  };
  if (t == DType::kBF16) {
    return scan(du16, reinterpret_cast<const uint16_t*>(row), hn::Set(du16, 0x7fff),
                hn::Set(du16, 0x7f80));
  }
  return scan(du32, reinterpret_cast<const uint32_t*>(row), hn::Set(du32, 0x7fffffffu),
              hn::Set(du32, 0x7f800000u));
}

uint32_t RouteLanes(const RouteProblem& p, int64_t t0, int32_t rows, const float* zero_bias,
                    float* work, int32_t* chosen, float* weights, StreamQueue& queue) {
  const D d;
  const size_t N = hn::Lanes(d);
  const RouteOptions& o = p.options;
  const int64_t E = p.logits.shape[1];
  const int32_t k = o.k;
  Dripper dripper(queue);
  if (N > static_cast<size_t>(kLaneRows)) {  // a wider target: the row kernels do it all
    dripper.Finish();
    return (uint32_t{1} << rows) - 1;
  }
  // work: xt [E, N], group scores [G, N], kept [G, N], chosen and weights by slot [k, N].
  float* xt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(work) + 63) & ~uintptr_t{63});
  float* score = xt + E * static_cast<int64_t>(N);
  float* kept = score + o.num_groups * static_cast<int64_t>(N);
  auto* chosen_t = reinterpret_cast<int32_t*>(kept + o.num_groups * static_cast<int64_t>(N));
  float* weights_t = reinterpret_cast<float*>(chosen_t + k * static_cast<int64_t>(N));
  const float* bias = o.expert_bias.empty() ? zero_bias : o.expert_bias.data();

  // Under post-softmax without groups every key is a logit the network sees, and a NaN key
  // already leaves its row undecided. The scores of the other routings (exp, sigmoid, softplus)
  // lose a NaN, and groups hide an unkept group's keys, so those rows are scanned.
  const bool scan_for_nan = o.score != RouterScore::kSoftmax || o.pre_softmax || o.num_groups > 0;
  uint32_t undecided = 0;
  for (int32_t r0 = 0; r0 < rows; r0 += static_cast<int32_t>(N)) {
    const int32_t used = std::min<int32_t>(static_cast<int32_t>(N), rows - r0);
    const char *row[kLaneRows], *next[kLaneRows];
    const int64_t T = p.logits.shape[0];
    for (size_t l = 0; l < N; ++l) {
      const int64_t t = t0 + r0 + static_cast<int64_t>(l);
      row[l] = row_ptr(p.logits, std::min<int64_t>(t, t0 + r0 + used - 1));
      next[l] = row_ptr(p.logits, std::min<int64_t>(t + static_cast<int64_t>(N), T - 1));
    }
    Scores(o, E, Transpose(o, row, next, p.logits.dtype, E, xt), xt);
    if (o.num_groups > 0) KeepGroups(o, E, xt, bias, score, kept);
    const hn::Mask<D> bad = Choose(o, E, xt, bias, kept, chosen_t, weights_t, dripper);
    uint8_t bad_bits[8] = {};
    hn::StoreMaskBits(d, bad, bad_bits);
    uint32_t bad_rows = 0;
    for (int32_t l = 0; l < used; ++l) {
      const bool nan = scan_for_nan && RowHasNaN(row[l], p.logits.dtype, E);
      bad_rows |= static_cast<uint32_t>(((bad_bits[l / 8] >> (l % 8)) & 1) | nan) << l;
    }
    SlotsToRows(chosen_t, k, used, chosen + r0 * k);
    SlotsToRows(weights_t, k, used, weights + r0 * k);
    undecided |= bad_rows << r0;
  }
  dripper.Finish();
  return undecided;
}

// ---------------------------------------------------------------------------------------------
// The backward through the chosen logits (every score but pre-softmax), rows in the lanes: g, xc
// and dxc slot-major [k, kLaneRows], as route_backward_chosen documents.
void RouteBackwardChosen(const RouteOptions& o, const float* g, const float* xc, float* dxc) {
  const D d;
  const size_t N = hn::Lanes(d);
  const int32_t k = o.k;
  const auto at = [](int32_t slot, size_t r0) { return slot * kLaneRows + r0; };
  for (size_t r0 = 0; r0 < static_cast<size_t>(kLaneRows); r0 += N) {
    if (o.score == RouterScore::kSoftmax) {
      // w = softmax(xc): dxc = w * (g - <g, w>).
      V m = hn::LoadU(d, xc + at(0, r0));
      for (int32_t j = 1; j < k; ++j) m = hn::Max(m, hn::LoadU(d, xc + at(j, r0)));
      V sum = hn::Zero(d);
      for (int32_t j = 0; j < k; ++j) {
        const V e = rmath::ExpShifted(d, hn::LoadU(d, xc + at(j, r0)), m);
        hn::StoreU(e, d, dxc + at(j, r0));
        sum = hn::Add(sum, e);
      }
      V dot = hn::Zero(d);
      for (int32_t j = 0; j < k; ++j) {
        const V w = hn::Div(hn::LoadU(d, dxc + at(j, r0)), sum);
        hn::StoreU(w, d, dxc + at(j, r0));
        dot = hn::MulAdd(hn::LoadU(d, g + at(j, r0)), w, dot);
      }
      for (int32_t j = 0; j < k; ++j) {
        const V w = hn::LoadU(d, dxc + at(j, r0));
        hn::StoreU(hn::Mul(w, hn::Sub(hn::LoadU(d, g + at(j, r0)), dot)), d, dxc + at(j, r0));
      }
      continue;
    }
    // w = s / (sum + eps) when k > 1: ds = (g - <g, w>) / (sum + eps); dxc = ds * s'(xc).
    const bool sigmoid = o.score == RouterScore::kSigmoid;
    V sum = hn::Set(d, kNormEps), gs = hn::Zero(d);
    for (int32_t j = 0; j < k; ++j) {
      const V x = hn::LoadU(d, xc + at(j, r0));
      const V sv = sigmoid ? rmath::Sigmoid(d, x) : rmath::SqrtSoftplus(d, x);
      hn::StoreU(sv, d, dxc + at(j, r0));
      sum = hn::Add(sum, sv);
      gs = hn::MulAdd(hn::LoadU(d, g + at(j, r0)), sv, gs);
    }
    const V dot = hn::Div(gs, sum);
    for (int32_t j = 0; j < k; ++j) {
      const V x = hn::LoadU(d, xc + at(j, r0)), sv = hn::LoadU(d, dxc + at(j, r0));
      const V gj = hn::LoadU(d, g + at(j, r0));
      const V ds = k > 1 ? hn::Div(hn::Sub(gj, dot), sum) : gj;
      V grad;
      if (sigmoid) {
        grad = hn::Mul(sv, hn::Sub(hn::Set(d, 1.0f), sv));
      } else {
        // d sqrt(softplus(x)) / dx = sigmoid(x) / (2 s), 0 where s is 0.
        grad = hn::IfThenZeroElse(hn::Le(sv, hn::Zero(d)),
                                  hn::Div(rmath::Sigmoid(d, x), hn::Mul(hn::Set(d, 2.0f), sv)));
      }
      hn::StoreU(hn::Mul(ds, grad), d, dxc + at(j, r0));
    }
  }
}

}  // namespace moekit::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moekit::detail {

HWY_EXPORT(RouteLanes);
HWY_EXPORT(RouteBackwardChosen);

bool route_lanes_apply(const RouteOptions& o, int64_t E) {
  return o.k <= kLaneMaxK && E <= kLaneMaxExperts && o.k <= E;
}

int64_t route_lanes_work_floats(int64_t E, int32_t num_groups, int32_t k) {
  return (E + 2 * static_cast<int64_t>(num_groups) + 2 * k) * kLaneRows + 16;
}

uint32_t route_lanes(const RouteProblem& p, int64_t t0, int32_t rows, const float* zero_bias,
                     float* work, int32_t* chosen, float* weights, StreamQueue& queue) {
  return HWY_DYNAMIC_DISPATCH(RouteLanes)(p, t0, rows, zero_bias, work, chosen, weights, queue);
}

void route_backward_chosen(const RouteOptions& o, const float* g, const float* xc, float* dxc) {
  HWY_DYNAMIC_DISPATCH(RouteBackwardChosen)(o, g, xc, dxc);
}

}  // namespace moekit::detail
#endif  // HWY_ONCE
