// The shared-memory all-reduce of ranks on one machine (allreduce.cpp), registered as
// torch.ops.kiln.shm_* (ops.cpp) and callable directly from other kernels (a fused stack that
// reduces between layers). kiln/distributed/shm_allreduce.py owns the segment's file and
// lifecycle; docs/shm_allreduce.md describes the protocol.
#pragma once

#include "common.h"

namespace kiln {

// Bytes of a segment for `world_size` ranks exchanging chunks of `chunk_bytes` (a multiple
// of 64): a header line, one control line per rank, two chunk buffers per rank.
int64_t shm_segment_bytes(int64_t world_size, int64_t chunk_bytes);

// Lays out a zeroed segment (uint8 tensor over the shared mapping of shm_segment_bytes bytes):
// the creator calls it once, before any other rank can see the segment.
void shm_segment_init(at::Tensor& segment, int64_t world_size, int64_t chunk_bytes);

// Marks `rank` attached and waits (at most timeout_s) until every rank is; checks the segment
// was made for this world size and chunk size.
void shm_segment_join(at::Tensor& segment, int64_t rank, int64_t world_size,
                      int64_t chunk_bytes, double timeout_s);

// x = sum of every rank's x, in place (fp32, or bf16 summed in fp32 and rounded once), in
// chunks of the segment's chunk size; every rank gets bit-identical results. Every rank must
// call it with the same element count and dtype, one call at a time per rank. Raises after
// waiting timeout_s for a rank that does not arrive.
void shm_all_reduce(at::Tensor& x, at::Tensor& segment, int64_t rank, double timeout_s);

// Each rank sends send_bytes[j] bytes of `send` (in rank order) to rank j and receives
// recv_bytes[j] from rank j into `recv` (in rank order), through the same segment and step
// counter as shm_all_reduce: collective in the same order, in windows of the chunk size (less
// a header of offsets) while any rank has more to send. Raises naming the ranks where a
// peer's size for this rank differs from recv_bytes, or where a peer calls shm_all_reduce.
void shm_all_to_all(const at::Tensor& send, at::IntArrayRef send_bytes, at::Tensor& recv,
                    at::IntArrayRef recv_bytes, at::Tensor& segment, int64_t rank,
                    double timeout_s);

}  // namespace kiln
