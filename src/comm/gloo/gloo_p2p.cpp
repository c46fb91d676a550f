// [Note: point-to-point all-gather and reduce-scatter]
// Gloo in libtorch 1.13 has no reduce_scatter and no _allgather_base. Its allgather and
// all_to_all_single would do, but at a cost this file avoids:
//   - Gloo's allgather gathers into a flat tensor it allocates itself on every call and
//     then copies it into the chunk views it was given: an allocation (page faults above
//     glibc's mmap threshold) plus a full copy. Here every rank sends its shard to each
//     peer and receives each peer's shard straight into that peer's chunk of the flat
//     buffer: (N-1) shards sent, the ring optimum, and no copy but our own chunk.
//   - all_to_all_single needs a fresh receive buffer of the whole flat size, moves every
//     byte before the local sum can start, and receives our own chunk as a copy. Here
//     the chunk is cut into *segments* of ~comm_segment_bytes(); every segment's messages
//     are posted up front (so the transfer proceeds while the caller computes), and
//     wait() sums segment k as soon as it has arrived while later segments are still in
//     flight. Our own row is read in place; the receive buffer holds the N-1 peer rows
//     and is leased from the group when large ([Note: per-group comm state]).
// Large shards go in segments for all-gather too: one 32 MiB message per peer moved
// markedly slower over loopback TCP than 4 MiB ones (docs/benchmarks.md).
// Send/recv are completed by Gloo's transport thread, so they do not queue behind other
// collectives on Gloo's worker threads. Small flat buffers at N >= 3 take Gloo's alltoall
// instead (gloo_alltoall.cpp), which costs fewer wake-ups.
// The sum per element is row 0 + row 1 + ... + row N-1 in rank order (row_sum.h), the
// same order as every other transport and so the same bits, on every run.
#include "gloo_p2p.h"

#include <algorithm>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/comm_tuning.h"
#include "gloo_transport.h"
#include "comm/row_sum.h"
#include "comm/tensor_bytes.h"

namespace fsdp::comm::detail {

namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

WorkPtr send(const GroupDesc& g, const at::Tensor& t, int peer, int tag) {
  std::vector<at::Tensor> v{gloo_wire_view(t)};
  return g.c10d()->send(v, peer, tag);
}

WorkPtr recv(const GroupDesc& g, const at::Tensor& t, int peer, int tag) {
  std::vector<at::Tensor> v{gloo_wire_view(t)};
  return g.c10d()->recv(v, peer, tag);
}

// Elements per segment for a buffer of `t`'s dtype: comm_segment_bytes() rounded down to
// whole elements, at least one.
int64_t segment_numel(const at::Tensor& t) {
  return std::max<int64_t>(1, comm_tuning().segment_bytes.load() / static_cast<int64_t>(t.element_size()));
}

// One reduce-scatter over send/recv, from posting its messages to the last segment's sum.
// Peer p's row for this rank lands in received_[slot(p)], slot(p) = p < me ? p : p - 1.
class P2pReduceScatter {
 public:
  P2pReduceScatter(GlooTransport& t, GroupDesc g, at::Tensor out, at::Tensor flat, ReduceOp op)
      : transport_(t.shared_from_this()), g_(std::move(g)), out_(std::move(out)),
        flat_(std::move(flat)), op_(op), n_(g_.size()), me_(g_.rank()), chunk_(out_.numel()),
        seg_(segment_numel(flat_)), nseg_(static_cast<int>((chunk_ + seg_ - 1) / seg_)) {}

  // Posts every segment's receives and sends (recvs_[s*(n-1) + k-1]: segment s from peer
  // me-k; sends_ likewise to peer me+k).
  void post() {
    auto rows = flat_.view({n_, chunk_});
    scratch_ = transport_->comm_state().acquire_scratch(nbytes(out_) * (n_ - 1));
    received_ = scratch_.narrow(0, 0, nbytes(out_) * (n_ - 1)).view(flat_.scalar_type()).view({n_ - 1, chunk_});
    const int tag0 = transport_->comm_state().reserve_tags(nseg_);
    recvs_.reserve(size_t(nseg_) * (n_ - 1));
    sends_.reserve(size_t(nseg_) * (n_ - 1));
    for (int s = 0; s < nseg_; ++s) {
      const int64_t c0 = s * seg_, len = std::min(seg_, chunk_ - c0);
      for (int k = 1; k < n_; ++k) {
        const int peer = (me_ + n_ - k) % n_;
        recvs_.push_back(recv(g_, received_[slot(peer)].narrow(0, c0, len), peer, tag0 + s));
      }
      for (int k = 1; k < n_; ++k) {
        const int peer = (me_ + k) % n_;
        sends_.push_back(send(g_, rows[peer].narrow(0, c0, len), peer, tag0 + s));
      }
    }
  }

  // Sums each segment as soon as its rows are here, then gives the receive buffer back.
  void finish() {
    // Writing `out` while parts of `flat` are still being sent would corrupt them if the
    // two overlap: then sum into a temporary and copy at the end.
    const bool alias = overlaps(out_, flat_);
    auto acc = alias ? at::empty_like(out_) : out_;
    std::vector<at::Tensor> parts;
    parts.reserve(n_);
    for (int s = 0; s < nseg_; ++s) {
      for (int k = 0; k < n_ - 1; ++k) transport_->wait(recvs_[size_t(s) * (n_ - 1) + k], g_, "reduce_scatter");
      const int64_t c0 = s * seg_, len = std::min(seg_, chunk_ - c0);
      auto a = acc.narrow(0, c0, len);
      parts.clear();
      for (int p = 0; p < n_; ++p) parts.push_back(row(p, c0, len));
      sum_rows_into(a, parts);
      if (op_ == ReduceOp::kAvg) a.div_(n_);
    }
    for (const auto& w : sends_) transport_->wait(w, g_, "reduce_scatter");
    if (alias) out_.copy_(acc);
    // Every message into the scratch has completed: the next call may have it.
    recvs_.clear();
    received_ = at::Tensor();
    transport_->comm_state().release_scratch(std::move(scratch_));
  }

 private:
  int slot(int peer) const { return peer < me_ ? peer : peer - 1; }
  // Elements [c0, c0+len) of rank p's row for us: ours in place, a peer's as received.
  at::Tensor row(int p, int64_t c0, int64_t len) const {
    return p == me_ ? flat_.narrow(0, int64_t(me_) * chunk_ + c0, len) : received_[slot(p)].narrow(0, c0, len);
  }

  std::shared_ptr<GlooTransport> transport_;
  GroupDesc g_;
  at::Tensor out_, flat_;
  ReduceOp op_;
  int n_, me_;
  int64_t chunk_, seg_;
  int nseg_;
  at::Tensor scratch_;   // kByte, leased from the group
  at::Tensor received_;  // [n-1, chunk] of flat's dtype, on scratch_
  std::vector<WorkPtr> recvs_, sends_;
};

}  // namespace

Issued p2p_all_gather(GlooTransport& t, const GroupDesc& g, const at::Tensor& flat, const at::Tensor& shard) {
  const int n = g.size(), me = g.rank();
  const int64_t chunk = shard.numel();
  auto chunks = flat.view({n, chunk});
  auto mine = chunks[me];
  const int64_t seg = segment_numel(flat);
  const int nseg = static_cast<int>((chunk + seg - 1) / seg);
  const int tag0 = t.comm_state().reserve_tags(nseg);
  std::vector<WorkPtr> works;
  works.reserve(size_t(2) * nseg * (n - 1));
  for (int s = 0; s < nseg; ++s) {
    const int64_t c0 = s * seg, len = std::min(seg, chunk - c0);
    // Receives first, so a peer's data finds its destination already posted.
    for (int k = 1; k < n; ++k) {
      const int peer = (me + n - k) % n;
      works.push_back(recv(g, chunks[peer].narrow(0, c0, len), peer, tag0 + s));
    }
    for (int k = 1; k < n; ++k) works.push_back(send(g, shard.narrow(0, c0, len), (me + k) % n, tag0 + s));
  }
  // Our own chunk is copied while the messages are in flight.
  if (mine.data_ptr() != shard.data_ptr()) mine.copy_(shard);
  return Issued{{}, [self = t.shared_from_this(), works, g]() {
    for (const auto& w : works) self->wait(w, g, "all_gather");
  }, CommPath::kGloo};
}

Issued p2p_reduce_scatter(GlooTransport& t, const GroupDesc& g, const at::Tensor& out, const at::Tensor& flat,
                          ReduceOp op) {
  auto rs = std::make_shared<P2pReduceScatter>(t, g, out, flat, op);
  rs->post();
  return Issued{{}, [rs]() { rs->finish(); }, CommPath::kGloo};
}

}  // namespace fsdp::comm::detail
