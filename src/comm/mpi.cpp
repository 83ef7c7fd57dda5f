// The MPI engine. Small collectives are MPI_Allgather and MPI_Allreduce; an exchange posts one
// MPI_Irecv per receive block and one MPI_Isend per send block (blocks to and from this rank
// itself are copied in exchange_wait, while the messages are in flight). Blocks between two
// ranks pair up in order: both sides post them in the same order with the same tags, and MPI
// matches messages of one source, tag and communicator in the order they were posted.
#include <fmt/format.h>

#include <array>
#include <climits>
#include <cstring>
#include <map>
#include <vector>

#include "comm/blocks.h"
#include "moekit/ep_mpi.h"

namespace moekit {
namespace {

constexpr int kRing = Communicator::kMaxExchangesInFlight;
constexpr const char* kEngine = "mpi";

Status mpi_error(const char* op, const char* call, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return Status::internal(op, fmt::format("{} failed: {}", call, std::string(text, len)));
}

#define MOEKIT_MPI_CALL(op, call)                    \
  do {                                               \
    const int moekit_mpi_code_ = (call);             \
    if (moekit_mpi_code_ != MPI_SUCCESS) {           \
      return mpi_error(op, #call, moekit_mpi_code_); \
    }                                                \
  } while (0)

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;  // too late to free anything; MPI has
    for (auto& [bytes, type] : row_types_) MPI_Type_free(&type);
    MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* engine() const override { return kEngine; }

  Status all_gather(const void* send, void* recv, size_t bytes) override {
    if (bytes > static_cast<size_t>(INT_MAX)) {
      return Status::invalid_argument("all_gather", "bytes", std::to_string(bytes), "must fit int");
    }
    MOEKIT_MPI_CALL("all_gather", MPI_Allgather(send, static_cast<int>(bytes), MPI_BYTE, recv,
                                                static_cast<int>(bytes), MPI_BYTE, comm_));
    return {};
  }

  // f32: MPI_Allreduce in place (MPI gives every rank the same bits). i32: summed as int64, so
  // that an overflow is seen, alike, on every rank.
  Status all_reduce_sum(void* data, int64_t n, DType dtype) override {
    constexpr const char* op = "all_reduce_sum";
    if (n < 0 || (n > 0 && !data) || (dtype != DType::kF32 && dtype != DType::kI32)) {
      return Status::invalid_argument(op, "data", fmt::format("[{}] {}", n, dtype_name(dtype)),
                                      "needs n >= 0 f32 or i32 elements");
    }
    if (dtype == DType::kI32) {
      wide_.assign(static_cast<const int32_t*>(data), static_cast<const int32_t*>(data) + n);
    }
    for (int64_t done = 0; done < n;) {  // MPI counts are int
      const int count = static_cast<int>(std::min<int64_t>(n - done, INT_MAX));
      if (dtype == DType::kF32) {
        MOEKIT_MPI_CALL(op, MPI_Allreduce(MPI_IN_PLACE, static_cast<float*>(data) + done, count,
                                          MPI_FLOAT, MPI_SUM, comm_));
      } else {
        MOEKIT_MPI_CALL(op, MPI_Allreduce(MPI_IN_PLACE, wide_.data() + done, count, MPI_INT64_T,
                                          MPI_SUM, comm_));
      }
      done += count;
    }
    if (dtype == DType::kI32) {
      auto* out = static_cast<int32_t*>(data);
      for (int64_t i = 0; i < n; ++i) {
        if (wide_[i] != static_cast<int32_t>(wide_[i])) {
          return Status::invalid_argument(op, fmt::format("data[{}]", i), "its sum over the ranks",
                                          "does not fit int32");
        }
        out[i] = static_cast<int32_t>(wide_[i]);
      }
    }
    return {};
  }

  Status exchange_start(size_t row_bytes, std::span<const SendBlock> send,
                        std::span<const RecvBlock> recv, int64_t* ticket) override {
    constexpr const char* op = "exchange_start";
    if (!ticket) return Status::invalid_argument(op, "ticket", "null", "must point to an int64");
    // MPI counts are int: a block may hold up to INT_MAX rows of the row datatype.
    MOEKIT_RETURN_IF_ERROR(detail::check_blocks(op, "send", send, size_, row_bytes, INT_MAX));
    MOEKIT_RETURN_IF_ERROR(detail::check_blocks(op, "recv", recv, size_, row_bytes, INT_MAX));
    const int64_t k = next_;
    Flight& f = flights_[static_cast<size_t>(k % kRing)];
    if (f.active) {
      return Status::invalid_argument(
          op, "exchanges in flight", std::to_string(kRing),
          fmt::format("at most {} may be started and not yet waited for", kRing));
    }
    MPI_Datatype row;
    MOEKIT_RETURN_IF_ERROR(row_type(row_bytes, &row));

    f.requests.clear();
    f.self_send.clear();
    f.self_recv.clear();
    f.row_bytes = row_bytes;
    // Receives first, so that most messages find their buffer posted. The tag of a block is its
    // position among the blocks between the two ranks.
    tags_.assign(static_cast<size_t>(size_), 0);
    for (const RecvBlock& b : recv) {
      if (b.rows == 0) continue;
      if (b.peer == rank_) {
        f.self_recv.push_back(b);
        continue;
      }
      f.requests.emplace_back();
      const int code = MPI_Irecv(b.data, static_cast<int>(b.rows), row, b.peer, next_tag(b.peer),
                                 comm_, &f.requests.back());
      if (code != MPI_SUCCESS) return abandon(f, mpi_error(op, "MPI_Irecv", code));
    }
    tags_.assign(static_cast<size_t>(size_), 0);
    for (const SendBlock& b : send) {
      if (b.rows == 0) continue;
      if (b.peer == rank_) {
        f.self_send.push_back(b);
        continue;
      }
      f.requests.emplace_back();
      const int code = MPI_Isend(b.data, static_cast<int>(b.rows), row, b.peer, next_tag(b.peer),
                                 comm_, &f.requests.back());
      if (code != MPI_SUCCESS) return abandon(f, mpi_error(op, "MPI_Isend", code));
    }
    if (f.self_send.size() != f.self_recv.size()) {
      return abandon(
          f, Status::invalid_argument(
                 op, "blocks to this rank itself",
                 fmt::format("{} sent, {} received", f.self_send.size(), f.self_recv.size()),
                 "must pair up"));
    }
    f.active = true;
    f.exchange = k;
    ++next_;
    *ticket = k;
    return {};
  }

  Status exchange_wait(int64_t ticket) override {
    constexpr const char* op = "exchange_wait";
    Flight* f = ticket >= 0 ? &flights_[static_cast<size_t>(ticket % kRing)] : nullptr;
    if (!f || !f->active || f->exchange != ticket) {
      return Status::invalid_argument(op, "ticket", std::to_string(ticket),
                                      "no such exchange in flight on this rank");
    }
    f->active = false;
    Status status;
    for (size_t i = 0; i < f->self_send.size(); ++i) {
      const SendBlock& s = f->self_send[i];
      const RecvBlock& r = f->self_recv[i];
      if (s.rows != r.rows) {
        if (status.ok()) {
          status = Status::internal(op, fmt::format("a block of {} rows to this rank itself meets "
                                                    "a receive block of {} rows",
                                                    s.rows, r.rows));
        }
        continue;
      }
      std::memcpy(r.data, s.data, static_cast<size_t>(s.rows) * f->row_bytes);
    }
    const int code =
        MPI_Waitall(static_cast<int>(f->requests.size()), f->requests.data(), MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS && status.ok()) status = mpi_error(op, "MPI_Waitall", code);
    return status;
  }

 private:
  struct Flight {
    bool active = false;
    int64_t exchange = -1;
    size_t row_bytes = 0;
    std::vector<MPI_Request> requests;
    std::vector<SendBlock> self_send;
    std::vector<RecvBlock> self_recv;
  };

  // A contiguous datatype of row_bytes bytes, made once per size.
  Status row_type(size_t row_bytes, MPI_Datatype* type) {
    if (row_bytes == 0 || row_bytes > static_cast<size_t>(INT_MAX)) {
      return Status::invalid_argument("exchange_start", "row_bytes", std::to_string(row_bytes),
                                      "must be in [1, 2^31)");
    }
    auto it = row_types_.find(row_bytes);
    if (it == row_types_.end()) {
      MPI_Datatype t;
      MOEKIT_MPI_CALL("exchange_start",
                      MPI_Type_contiguous(static_cast<int>(row_bytes), MPI_BYTE, &t));
      MOEKIT_MPI_CALL("exchange_start", MPI_Type_commit(&t));
      it = row_types_.emplace(row_bytes, t).first;
    }
    *type = it->second;
    return {};
  }

  int next_tag(int peer) { return tags_[static_cast<size_t>(peer)]++ % (kMaxTag + 1); }

  // A start that failed half-way: cancel what was posted, so that nothing stays in flight.
  static Status abandon(Flight& f, Status s) {
    for (MPI_Request& r : f.requests) {
      if (r != MPI_REQUEST_NULL) {
        MPI_Cancel(&r);
        MPI_Request_free(&r);
      }
    }
    f.requests.clear();
    return s;
  }

  static constexpr int kMaxTag = 32767;  // the least MPI_TAG_UB the standard allows
  MPI_Comm comm_;
  const int rank_, size_;
  int64_t next_ = 0;
  std::array<Flight, kRing> flights_;
  std::map<size_t, MPI_Datatype> row_types_;
  std::vector<int> tags_;
  std::vector<int64_t> wide_;  // all_reduce_sum's i32 sums
};

}  // namespace

Status mpi_communicator(MPI_Comm comm, std::unique_ptr<Communicator>* out) {
  constexpr const char* op = "mpi_communicator";
  if (!out) return Status::invalid_argument(op, "out", "null", "must point to a unique_ptr");
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    return Status::invalid_argument(op, "MPI", finalized ? "finalized" : "not initialised",
                                    "call between MPI_Init and MPI_Finalize");
  }
  if (comm == MPI_COMM_NULL)
    return Status::invalid_argument(op, "comm", "MPI_COMM_NULL", "needs a communicator");
  MPI_Comm dup;
  MOEKIT_MPI_CALL(op, MPI_Comm_dup(comm, &dup));
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);  // errors come back as codes, not aborts
  int rank = 0, size = 0;
  MPI_Comm_rank(dup, &rank);
  MPI_Comm_size(dup, &size);
  *out = std::make_unique<MpiCommunicator>(dup, rank, size);
  return {};
}

}  // namespace moekit
