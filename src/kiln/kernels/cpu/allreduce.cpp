// All-reduce (sum) of ranks on one machine through one shared-memory segment. Torch reference:
// torch.distributed.all_reduce over gloo (tests/distributed/test_shm_allreduce.py).
//
// Segment layout: [header line][control line of rank 0 .. W-1][rank 0: buffer 0, buffer 1]...
// A call moves the tensor through in chunks of the segment's chunk size, one step of a
// per-rank counter each. In step s rank r copies its chunk into its buffer s % 2, records the
// chunk's size and dtype, and publishes s (a release store on its own control line); it then
// waits until every rank has published s (acquire loads) and sums the W buffers, in rank order
// so that every rank computes bit-identical sums, into its own tensor.
//
// Two buffers per rank need no "finished reading" flag: rank r overwrites buffer s % 2 at step
// s + 2, which it enters only after seeing every rank publish s + 1, and a rank publishes s + 1
// only after it has finished reading step s. The same holds for the parity-indexed sizes.
//
// An all-to-all takes steps of the same counter: each rank publishes a window of its send
// stream behind a header of its per-destination byte offsets, and every rank copies from
// every rank's window the bytes meant for it; steps repeat while any rank's stream goes on.

#include "allreduce.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <chrono>
#include <new>
#include <string>
#include <thread>

namespace kiln {

namespace {

constexpr uint64_t kMagic = 0x31305241'6e6c696bULL;  // "kilnAR01"
constexpr int64_t kLine = 64;                         // one cache line: no false sharing
constexpr int64_t kMaxRanks = 64;
constexpr int64_t kAllToAllDtype = -1;              // what an all-to-all step records as dtype
constexpr int kSpins = 1 << 10;                       // busy polls before yielding the core
constexpr int64_t kGrain = 1 << 16;                   // elements per thread of the sum

using Clock = std::chrono::steady_clock;

// Written once by the creator before any other rank can map the segment.
struct alignas(kLine) Header {
  uint64_t magic;
  int64_t world_size;
  int64_t chunk_bytes;
};

// One rank's control line; only that rank writes it. elements/dtype of step s live at index
// s % 2, written before `published` is stored and read after it is loaded.
struct alignas(kLine) RankControl {
  std::atomic<uint64_t> published{0};  // the last step whose chunk is in this rank's buffer
  std::atomic<uint64_t> joined{0};     // 1 once the rank has attached
  int64_t elements[2] = {0, 0};
  int64_t dtype[2] = {0, 0};
};

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "atomics shared between processes must be lock-free");
static_assert(sizeof(Header) == kLine && sizeof(RankControl) == kLine);

struct Segment {
  RankControl* control;  // [world_size]
  char* buffers;         // [world_size][2][chunk_bytes]
  int64_t world_size, chunk_bytes;

  char* buffer(int64_t rank, uint64_t step) const {
    return buffers + (rank * 2 + static_cast<int64_t>(step & 1)) * chunk_bytes;
  }
};

char* segment_base(at::Tensor& segment) {
  TORCH_CHECK(segment.device().is_cpu() && segment.scalar_type() == at::kByte &&
                  segment.is_contiguous(),
              "shm all-reduce: the segment must be a contiguous uint8 CPU tensor");
  char* base = static_cast<char*>(segment.data_ptr());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % kLine == 0,
              "shm all-reduce: the segment must be 64-byte aligned");
  return base;
}

Segment view(at::Tensor& segment) {
  char* base = segment_base(segment);
  TORCH_CHECK(segment.numel() >= kLine, "shm all-reduce: segment of ", segment.numel(),
              " bytes is too small");
  const auto* header = reinterpret_cast<const Header*>(base);
  TORCH_CHECK(header->magic == kMagic, "shm all-reduce: not an initialized segment");
  TORCH_CHECK(segment.numel() >= shm_segment_bytes(header->world_size, header->chunk_bytes),
              "shm all-reduce: segment of ", segment.numel(), " bytes is smaller than its ",
              "header's layout");
  return {reinterpret_cast<RankControl*>(base + kLine),
          base + kLine * (1 + header->world_size), header->world_size, header->chunk_bytes};
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Returns once ready() holds: polls briefly (a rank on another core arrives within
// microseconds), then yields the core between polls (ranks may share cores), then sleeps
// between them once the wait is long; raises after timeout_s, so a dead or stuck rank fails
// the call rather than hanging it.
template <typename Ready, typename Describe>
void wait_until(Ready&& ready, double timeout_s, Describe&& describe) {
  for (int i = 0; i < kSpins; ++i) {
    if (ready()) return;
    cpu_relax();
  }
  const auto start = Clock::now();
  const std::chrono::duration<double> limit(timeout_s), patient(0.01);
  for (uint32_t i = 1;; ++i) {
    if (ready()) return;
    if (i % 64 != 0) {
      std::this_thread::yield();
      continue;
    }
    const auto waited = Clock::now() - start;
    TORCH_CHECK(waited < limit, describe(), " (waited ", timeout_s, " s)");
    if (waited > patient) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KILN_ALLREDUCE_AVX512 1

inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// Rounds to nearest even as c10::BFloat16(float) does, NaN to its quiet NaN 0x7fc0 (the
// AVX512-BF16 conversion would flush subnormals instead).
inline void store16(c10::BFloat16* p, __mmask16 m, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7fc00000));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
#endif

// out[i] = sum over ranks r = 0, 1, .. of src[r][i] for i in [begin, end): fp32 accumulation,
// one rounding to T, the same order on every rank.
template <typename T>
void sum_ranks(T* out, const T* const* src, int64_t ranks, int64_t begin, int64_t end) {
#if defined(KILN_ALLREDUCE_AVX512)
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = lanes(end - i);
    __m512 acc = load16(src[0] + i, m);
    for (int64_t r = 1; r < ranks; ++r) acc = _mm512_add_ps(acc, load16(src[r] + i, m));
    store16(out + i, m, acc);
  }
#else
  for (int64_t i = begin; i < end; ++i) {
    float acc = f32(src[0][i]);
    for (int64_t r = 1; r < ranks; ++r) acc += f32(src[r][i]);
    out[i] = static_cast<T>(acc);
  }
#endif
}

void await_step(const Segment& seg, int64_t peer, int64_t rank, uint64_t step,
                double timeout_s) {
  const RankControl& other = seg.control[peer];
  wait_until([&] { return other.published.load(std::memory_order_acquire) >= step; },
             timeout_s, [&] {
               return "shm all-reduce: rank " + std::to_string(rank) + " gave up waiting for " +
                      "rank " + std::to_string(peer) + " at step " + std::to_string(step) +
                      " (did that rank exit or stop calling all_reduce?)";
             });
}

void check_same_chunk(const Segment& seg, int64_t peer, int64_t rank, uint64_t step,
                      int64_t count, int64_t dtype) {
  const RankControl& other = seg.control[peer];
  const int64_t their_count = other.elements[step & 1], their_dtype = other.dtype[step & 1];
  TORCH_CHECK(their_dtype != kAllToAllDtype, "shm all-reduce: rank ", rank, " reduces but rank ",
              peer, " exchanges all-to-all: every rank must call the same collective");
  TORCH_CHECK(their_count == count && their_dtype == dtype, "shm all-reduce: rank ", rank,
              " reduces a chunk of ", count, " elements of ", c10::ScalarType(dtype),
              " but rank ", peer, " one of ", their_count, " of ", c10::ScalarType(their_dtype),
              ": every rank must pass the same element count and dtype");
}

// One step: publish this rank's chunk, wait for every rank's, sum them into data[0, count).
template <typename T>
void reduce_step(T* data, int64_t count, int64_t dtype, const Segment& seg, int64_t rank,
                 double timeout_s) {
  RankControl& self = seg.control[rank];
  const uint64_t step = self.published.load(std::memory_order_relaxed) + 1;
  std::memcpy(seg.buffer(rank, step), data, count * sizeof(T));
  self.elements[step & 1] = count;
  self.dtype[step & 1] = dtype;
  self.published.store(step, std::memory_order_release);

  const T* src[kMaxRanks];
  for (int64_t r = 0; r < seg.world_size; ++r) {
    if (r != rank) {
      await_step(seg, r, rank, step, timeout_s);
      check_same_chunk(seg, r, rank, step, count, dtype);
    }
    src[r] = reinterpret_cast<const T*>(seg.buffer(r, step));
  }
  at::parallel_for(0, count, kGrain, [&](int64_t begin, int64_t end) {
    sum_ranks(data, src, seg.world_size, begin, end);
  });
}

template <typename T>
void reduce_chunks(T* data, int64_t n, int64_t dtype, const Segment& seg, int64_t rank,
                   double timeout_s) {
  const int64_t per_chunk = seg.chunk_bytes / static_cast<int64_t>(sizeof(T));
  for (int64_t offset = 0; offset < n; offset += per_chunk)
    reduce_step(data + offset, std::min(per_chunk, n - offset), dtype, seg, rank, timeout_s);
}

// An all-to-all step's buffer: this header line(s), then a window of the rank's send stream.
// offsets[j] .. offsets[j + 1] are the stream's bytes for rank j; total = offsets[world_size].

int64_t all_to_all_header_bytes(int64_t world_size) {
  return (static_cast<int64_t>(sizeof(int64_t)) * (world_size + 1) + kLine - 1) / kLine * kLine;
}

void check_all_to_all_peer(const Segment& seg, int64_t peer, int64_t rank, uint64_t step,
                           const int64_t* offsets, int64_t expected) {
  TORCH_CHECK(seg.control[peer].dtype[step & 1] == kAllToAllDtype, "shm all-to-all: rank ",
              rank, " exchanges all-to-all but rank ", peer, " called another collective");
  const int64_t sent = offsets[rank + 1] - offsets[rank];
  TORCH_CHECK(sent == expected, "shm all-to-all: rank ", rank, " expects ", expected,
              " bytes from rank ", peer, ", which sends it ", sent);
}

// One step: publish window `window` (of `data_bytes` per step) of this rank's send stream,
// then copy from every rank's window the part of its stream meant for this rank. Returns
// whether any rank's stream goes past this window (the same answer on every rank).
bool all_to_all_step(const char* send, const int64_t* offsets, char* recv,
                     const int64_t* recv_at, const int64_t* recv_bytes, int64_t window,
                     const Segment& seg, int64_t rank, double timeout_s) {
  RankControl& self = seg.control[rank];
  const uint64_t step = self.published.load(std::memory_order_relaxed) + 1;
  const int64_t head = all_to_all_header_bytes(seg.world_size);
  const int64_t data_bytes = seg.chunk_bytes - head, lo = window * data_bytes;
  const int64_t total = offsets[seg.world_size];
  char* own = seg.buffer(rank, step);
  std::memcpy(own, offsets, sizeof(int64_t) * (seg.world_size + 1));
  if (total > lo) std::memcpy(own + head, send + lo, std::min(data_bytes, total - lo));
  self.elements[step & 1] = 0;
  self.dtype[step & 1] = kAllToAllDtype;
  self.published.store(step, std::memory_order_release);

  bool more = false;
  for (int64_t r = 0; r < seg.world_size; ++r) {
    if (r != rank) await_step(seg, r, rank, step, timeout_s);
    const char* theirs = seg.buffer(r, step);
    int64_t peer[kMaxRanks + 1];
    std::memcpy(peer, theirs, sizeof(int64_t) * (seg.world_size + 1));
    check_all_to_all_peer(seg, r, rank, step, peer, recv_bytes[r]);
    const int64_t begin = std::max(peer[rank], lo);
    const int64_t end = std::min(peer[rank + 1], lo + data_bytes);
    if (end > begin)
      std::memcpy(recv + recv_at[r] + (begin - peer[rank]), theirs + head + (begin - lo),
                  end - begin);
    more = more || peer[seg.world_size] > lo + data_bytes;
  }
  return more;
}

}  // namespace

void shm_all_to_all(const at::Tensor& send, at::IntArrayRef send_bytes, at::Tensor& recv,
                    at::IntArrayRef recv_bytes, at::Tensor& segment, int64_t rank,
                    double timeout_s) {
  const Segment seg = view(segment);
  const int64_t w = seg.world_size;
  TORCH_CHECK(0 <= rank && rank < w, "shm all-to-all: rank ", rank, " is outside [0, ", w, ")");
  TORCH_CHECK(static_cast<int64_t>(send_bytes.size()) == w &&
                  static_cast<int64_t>(recv_bytes.size()) == w,
              "shm all-to-all: need one send and one receive size per rank (", w, ")");
  TORCH_CHECK(seg.chunk_bytes > all_to_all_header_bytes(w),
              "shm all-to-all: chunks of ", seg.chunk_bytes, " bytes leave no room for data");
  TORCH_CHECK(send.device().is_cpu() && send.is_contiguous() && recv.device().is_cpu() &&
                  recv.is_contiguous(),
              "shm all-to-all: send and recv must be contiguous CPU tensors");
  int64_t offsets[kMaxRanks + 1] = {0}, recv_at[kMaxRanks] = {0};
  for (int64_t j = 0; j < w; ++j) {
    offsets[j + 1] = offsets[j] + send_bytes[j];
    if (j) recv_at[j] = recv_at[j - 1] + recv_bytes[j - 1];
  }
  TORCH_CHECK(offsets[w] == send.nbytes() && recv_at[w - 1] + recv_bytes[w - 1] == recv.nbytes(),
              "shm all-to-all: the sizes do not add up to the tensors' ", send.nbytes(),
              " and ", recv.nbytes(), " bytes");
  const auto* src = static_cast<const char*>(send.data_ptr());
  auto* dst = static_cast<char*>(recv.data_ptr());
  for (int64_t window = 0;
       all_to_all_step(src, offsets, dst, recv_at, recv_bytes.data(), window, seg, rank,
                       timeout_s);
       ++window) {
  }
}

int64_t shm_segment_bytes(int64_t world_size, int64_t chunk_bytes) {
  TORCH_CHECK(1 <= world_size && world_size <= kMaxRanks, "shm all-reduce: world size ",
              world_size, " is outside [1, ", kMaxRanks, "]");
  TORCH_CHECK(chunk_bytes > 0 && chunk_bytes % kLine == 0, "shm all-reduce: chunk of ",
              chunk_bytes, " bytes must be a positive multiple of ", kLine);
  return kLine * (1 + world_size) + world_size * 2 * chunk_bytes;
}

void shm_segment_init(at::Tensor& segment, int64_t world_size, int64_t chunk_bytes) {
  const int64_t bytes = shm_segment_bytes(world_size, chunk_bytes);
  char* base = segment_base(segment);
  TORCH_CHECK(segment.numel() >= bytes, "shm all-reduce: segment of ", segment.numel(),
              " bytes, ", bytes, " needed");
  for (int64_t r = 0; r < world_size; ++r) new (base + kLine * (1 + r)) RankControl();
  auto* header = new (base) Header{0, world_size, chunk_bytes};
  std::atomic_thread_fence(std::memory_order_release);
  header->magic = kMagic;
}

void shm_segment_join(at::Tensor& segment, int64_t rank, int64_t world_size,
                      int64_t chunk_bytes, double timeout_s) {
  const Segment seg = view(segment);
  TORCH_CHECK(seg.world_size == world_size && seg.chunk_bytes == chunk_bytes,
              "shm all-reduce: the segment was made for ", seg.world_size, " ranks and ",
              seg.chunk_bytes, "-byte chunks, rank ", rank, " expects ", world_size, " and ",
              chunk_bytes);
  TORCH_CHECK(0 <= rank && rank < world_size, "shm all-reduce: rank ", rank,
              " is outside [0, ", world_size, ")");
  TORCH_CHECK(seg.control[rank].joined.exchange(1, std::memory_order_acq_rel) == 0,
              "shm all-reduce: rank ", rank, " attached twice to one segment");
  for (int64_t r = 0; r < world_size; ++r) {
    const RankControl& other = seg.control[r];
    wait_until([&] { return other.joined.load(std::memory_order_acquire) == 1; }, timeout_s,
               [&] {
                 return "shm all-reduce: rank " + std::to_string(rank) + " gave up waiting "
                        "for rank " + std::to_string(r) + " to attach";
               });
  }
}

void shm_all_reduce(at::Tensor& x, at::Tensor& segment, int64_t rank, double timeout_s) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(),
              "shm all-reduce: the tensor must be a contiguous CPU tensor");
  const Segment seg = view(segment);
  TORCH_CHECK(0 <= rank && rank < seg.world_size, "shm all-reduce: rank ", rank,
              " is outside [0, ", seg.world_size, ")");
  const auto dtype = static_cast<int64_t>(x.scalar_type());
  if (x.scalar_type() == at::kFloat)
    reduce_chunks(x.data_ptr<float>(), x.numel(), dtype, seg, rank, timeout_s);
  else if (x.scalar_type() == at::kBFloat16)
    reduce_chunks(x.data_ptr<c10::BFloat16>(), x.numel(), dtype, seg, rank, timeout_s);
  else
    TORCH_CHECK(false, "shm all-reduce: float32 or bfloat16 tensors only, got ",
                x.scalar_type());
}

}  // namespace kiln
