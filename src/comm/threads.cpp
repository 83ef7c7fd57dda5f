// The in-process engine: P threads of one process play the P ranks, and rows move by memcpy.
//
// Small collectives meet at a std::barrier: each rank posts a pointer to its buffer, the barrier
// makes every post visible, each rank reads what it needs, and a second barrier keeps the
// buffers alive until all have read.
//
// Exchanges are split-phase, so they cannot meet at a barrier. The k-th exchange of every rank is
// the same exchange (collective order); it lives in slot k % kRing of each rank. exchange_start
// publishes the rank's send list in its slot (a release store of k). exchange_wait pulls: for
// each peer q it waits until q has published k, copies q's blocks addressed to this rank into
// the matching receive blocks, and counts one read on q's slot; then it waits until all P
// ranks have read its own slot, after which its send buffers are free again. A slot's read count
// only grows: after the u-th use of a slot it stands at u * P.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <cstring>
#include <memory>
#include <vector>

#include "comm/blocks.h"
#include "moekit/ep.h"

namespace moekit {
namespace {

constexpr int kRing = Communicator::kMaxExchangesInFlight;

// One rank's published exchange.
struct Slot {
  std::atomic<int64_t> published{-1};  // the exchange whose send list is below
  std::atomic<int64_t> reads{0};       // ranks that have read this slot's blocks, ever
  size_t row_bytes = 0;
  std::vector<SendBlock> send;
};

struct Hub {
  explicit Hub(int P)
      : num_ranks(P),
        barrier(P),
        posts(static_cast<size_t>(P)),
        flags(static_cast<size_t>(P), -1),
        slots(std::make_unique<Slot[]>(static_cast<size_t>(P) * kRing)) {}
  Slot& slot(int rank, int64_t exchange) {
    return slots[static_cast<size_t>(rank) * kRing + static_cast<size_t>(exchange % kRing)];
  }

  const int num_ranks;
  std::barrier<> barrier;
  std::vector<void*> posts;    // per rank: its buffer in the small collective under way
  std::vector<int64_t> flags;  // per rank: all_reduce_sum's first overflowing element, or -1
  std::unique_ptr<Slot[]> slots;
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<Hub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return hub_->num_ranks; }
  const char* engine() const override { return "threads"; }

  Status all_gather(const void* send, void* recv, size_t bytes) override {
    post(const_cast<void*>(send));
    for (int q = 0; q < size(); ++q) {
      std::memcpy(static_cast<std::byte*>(recv) + static_cast<size_t>(q) * bytes,
                  hub_->posts[static_cast<size_t>(q)], bytes);
    }
    hub_->barrier.arrive_and_wait();
    return {};
  }

  // Rank r sums slice r of every rank's data (in rank order, so every element is summed the
  // same way whoever holds it), then, once all have read, writes it into every rank's data. An
  // i32 sum that overflows is an error on every rank. Called with bad arguments it returns the
  // error on this rank alone (the ep_* ops agree on their arguments before they call it).
  Status all_reduce_sum(void* data, int64_t n, DType dtype) override {
    if (n < 0 || (n > 0 && !data) || (dtype != DType::kF32 && dtype != DType::kI32)) {
      return Status::invalid_argument("all_reduce_sum", "data",
                                      fmt::format("[{}] {}", n, dtype_name(dtype)),
                                      "needs n >= 0 f32 or i32 elements");
    }
    post(data);
    const int P = size();
    const int64_t lo = n * rank_ / P, hi = n * (rank_ + 1) / P;
    slice_.resize(static_cast<size_t>(hi - lo) * 4);
    int64_t overflow = -1;
    if (dtype == DType::kF32) {
      auto* out = reinterpret_cast<float*>(slice_.data());
      for (int64_t i = lo; i < hi; ++i) {
        float s = 0.0f;
        for (int q = 0; q < P; ++q) s += static_cast<const float*>(hub_->posts[q])[i];
        out[i - lo] = s;
      }
    } else {
      auto* out = reinterpret_cast<int32_t*>(slice_.data());
      for (int64_t i = lo; i < hi; ++i) {
        int64_t s = 0;
        for (int q = 0; q < P; ++q) s += static_cast<const int32_t*>(hub_->posts[q])[i];
        if (s != static_cast<int32_t>(s) && overflow < 0) overflow = i;
        out[i - lo] = static_cast<int32_t>(s);
      }
    }
    hub_->flags[static_cast<size_t>(rank_)] = overflow;
    hub_->barrier.arrive_and_wait();          // every rank has read every input
    for (int q = 0; q < P && hi > lo; ++q) {  // no slice: nothing to copy (and maybe no data)
      std::memcpy(static_cast<std::byte*>(hub_->posts[q]) + lo * 4, slice_.data(), slice_.size());
    }
    hub_->barrier.arrive_and_wait();  // every slice is in place, every flag visible
    for (int q = 0; q < P; ++q) {
      if (hub_->flags[static_cast<size_t>(q)] >= 0) {
        return Status::invalid_argument(
            "all_reduce_sum", fmt::format("data[{}]", hub_->flags[static_cast<size_t>(q)]),
            "its sum over the ranks", "does not fit int32");
      }
    }
    return {};
  }

  Status exchange_start(size_t row_bytes, std::span<const SendBlock> send,
                        std::span<const RecvBlock> recv, int64_t* ticket) override {
    constexpr const char* op = "exchange_start";
    MOEKIT_RETURN_IF_ERROR(detail::check_blocks(op, "send", send, size(), row_bytes));
    MOEKIT_RETURN_IF_ERROR(detail::check_blocks(op, "recv", recv, size(), row_bytes));
    if (!ticket) return Status::invalid_argument(op, "ticket", "null", "must point to an int64");
    const int64_t k = next_;
    Local& mine = local_[static_cast<size_t>(k % kRing)];
    if (mine.active) {
      return Status::invalid_argument(
          op, "exchanges in flight", std::to_string(kRing),
          fmt::format("at most {} may be started and not yet waited for", kRing));
    }
    ++next_;
    mine.active = true;
    mine.exchange = k;
    mine.row_bytes = row_bytes;
    mine.recv.assign(recv.begin(), recv.end());
    Slot& s = hub_->slot(rank_, k);
    s.row_bytes = row_bytes;
    s.send.assign(send.begin(), send.end());
    s.published.store(k, std::memory_order_release);
    s.published.notify_all();
    *ticket = k;
    return {};
  }

  Status exchange_wait(int64_t ticket) override {
    Local* mine = ticket >= 0 ? &local_[static_cast<size_t>(ticket % kRing)] : nullptr;
    if (!mine || !mine->active || mine->exchange != ticket) {
      return Status::invalid_argument("exchange_wait", "ticket", std::to_string(ticket),
                                      "no such exchange in flight on this rank");
    }
    Status status;
    const int P = size();
    for (int i = 0; i < P; ++i) {
      const int q = (rank_ + i) % P;  // start with self: spreads the readers over the slots
      Slot& theirs = hub_->slot(q, ticket);
      for (int64_t v; (v = theirs.published.load(std::memory_order_acquire)) != ticket;) {
        theirs.published.wait(v, std::memory_order_acquire);
      }
      Status s = pull(q, theirs, *mine);
      if (status.ok()) status = s;
      theirs.reads.fetch_add(1, std::memory_order_acq_rel);
      theirs.reads.notify_all();
    }
    // Our send buffers are free once every rank has read them.
    Slot& ours = hub_->slot(rank_, ticket);
    const int64_t done = (ticket / kRing + 1) * P;
    for (int64_t v; (v = ours.reads.load(std::memory_order_acquire)) < done;) {
      ours.reads.wait(v, std::memory_order_acquire);
    }
    mine->active = false;
    return status;
  }

 private:
  // What this rank keeps of an exchange of its own.
  struct Local {
    bool active = false;
    int64_t exchange = -1;
    size_t row_bytes = 0;
    std::vector<RecvBlock> recv;
  };

  // The first barrier of a small collective: our buffer is posted and everyone else's visible.
  void post(void* buffer) {
    hub_->posts[static_cast<size_t>(rank_)] = buffer;
    hub_->barrier.arrive_and_wait();
  }

  // Copies peer q's blocks for this rank into our receive blocks from q, pairing them in order.
  Status pull(int q, const Slot& theirs, const Local& mine) {
    size_t next = 0;  // our next receive block from q
    Status status;
    for (const SendBlock& b : theirs.send) {
      if (b.peer != rank_ || b.rows == 0) continue;
      while (next < mine.recv.size() && (mine.recv[next].peer != q || mine.recv[next].rows == 0)) {
        ++next;
      }
      if (next == mine.recv.size() || mine.recv[next].rows != b.rows ||
          theirs.row_bytes != mine.row_bytes) {
        if (status.ok()) {
          status = Status::internal(
              "exchange_wait",
              fmt::format("rank {} sends a block of {} rows of {} bytes that rank {} has no "
                          "matching receive block for",
                          q, b.rows, theirs.row_bytes, rank_));
        }
        continue;
      }
      std::memcpy(mine.recv[next].data, b.data, static_cast<size_t>(b.rows) * mine.row_bytes);
      ++next;
    }
    return status;
  }

  std::shared_ptr<Hub> hub_;
  const int rank_;
  int64_t next_ = 0;  // the next exchange's number
  std::array<Local, kRing> local_;
  std::vector<std::byte> slice_;  // all_reduce_sum's slice
};

}  // namespace

Status thread_communicators(int num_ranks, std::vector<std::unique_ptr<Communicator>>* out) {
  if (num_ranks < 1) {
    return Status::invalid_argument("thread_communicators", "num_ranks", std::to_string(num_ranks),
                                    "must be >= 1");
  }
  if (!out) {
    return Status::invalid_argument("thread_communicators", "out", "null",
                                    "must point to a vector");
  }
  auto hub = std::make_shared<Hub>(num_ranks);
  out->clear();
  for (int p = 0; p < num_ranks; ++p) out->push_back(std::make_unique<ThreadCommunicator>(hub, p));
  return {};
}

}  // namespace moekit
