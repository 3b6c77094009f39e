// CapturedGraph: what consumes a capture (spec §2.4). A capture (CommandEncoder::take_capture) is a
// list of dispatch nodes, each with the byte ranges it reads and writes and its op kind, and
// barrier nodes. A CapturedGraph replays it into an encoder:
//
// - encode_sequential: the nodes in order, recorded barriers as barriers;
// - encode_with_barriers: the nodes in order with barriers re-derived from the ranges: one goes
//   before a dispatch that reads a range written earlier in the current group (RAW) or writes a
//   range read or written earlier in the group (WAR / WAW); recorded barriers still force one;
// - reordered(): barriers stripped, then a greedy pass with a lookahead of 64 dispatches pulls
//   later dispatches that conflict neither with the current group nor with the dispatches skipped
//   over into the group; it stops at a dispatch that is not reorderable (Sdpa, Softmax);
// - instantiate(): on backends with graph objects (CUDA), one graph whose edges are the same
//   conflicts, so independent dispatches run concurrently.
//
// Missing ranges are never taken as "no conflict": a dispatch that declares no write range is
// ordered after everything before it and before everything after it (a barrier on both sides, or
// edges to every neighbour), and reordered() refuses it, naming it. Every replay launches the
// recorded kernels with the recorded arguments, so it computes the same bits as the eager run. A
// replay is all or nothing (CommandEncoder::Transaction): a node refused partway (a receipt
// without room for every dispatch) leaves the encoder as it was.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "routemm/encoder.h"

namespace routemm {

class CapturedGraph {
 public:
  // Every dispatch node must carry its command (nodes taken from a capture do).
  explicit CapturedGraph(std::vector<CapturedNode> nodes);

  const std::vector<CapturedNode>& nodes() const { return nodes_; }
  size_t dispatch_count() const;

  void encode_sequential(CommandEncoder& encoder) const;
  void encode_with_barriers(CommandEncoder& encoder) const;
  // The reordered graph (no barrier nodes; encode it with encode_with_barriers). Refuses a graph
  // with a dispatch that declares no write range.
  CapturedGraph reordered() const;

  // Per node, whether encode_with_barriers puts a barrier before it (false for barrier nodes).
  std::vector<bool> barriers_before() const;
  // Per dispatch (numbered among dispatches only), the earlier dispatches it must run after: its
  // range conflicts within its barrier group, and every dispatch of the previous non-empty group.
  std::vector<std::vector<size_t>> dependencies() const;

  // One backend graph of every dispatch with dependencies() as its edges, or nullptr when the
  // backend has none (replay with encode_with_barriers there). Encode it with
  // CommandEncoder::encode_graph(graph, keep_alive()).
  std::shared_ptr<const GraphExec> instantiate(Backend& backend) const;
  // The storages the dispatches bind, to keep alive while an instantiated graph runs.
  std::vector<std::shared_ptr<Storage>> keep_alive() const;

 private:
  std::vector<CapturedNode> nodes_;
};

// A recorded session (spec §2.4 and its consumer's GraphSession): capture starts on the encoder at
// construction; ops encode into encoder(); finish() replays the capture in order and
// finish_with_reorder() reordered with derived barriers, each committing and waiting.
class GraphSession {
 public:
  explicit GraphSession(CommandEncoder& encoder);
  CommandEncoder& encoder() { return encoder_; }
  void finish();
  void finish_with_reorder();

 private:
  CapturedGraph take();
  CommandEncoder& encoder_;
};

}  // namespace routemm
