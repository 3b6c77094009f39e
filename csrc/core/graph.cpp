// CapturedGraph and GraphSession: replay, derived barriers, reorder and backend graphs.
#include "routemm/graph.h"

#include <algorithm>
#include <span>
#include <string>

#include "routemm/error.h"

namespace routemm {
namespace {

// The reorder's lookahead, as in the spec (a port of llama.cpp's graph_optimize_reorder).
constexpr size_t kReorderLookahead = 64;

bool overlaps(const ByteRange& a, const ByteRange& b) { return a.start < b.end && b.start < a.end; }

bool any_overlap(std::span<const ByteRange> a, std::span<const ByteRange> b) {
  for (const auto& x : a) {
    for (const auto& y : b) {
      if (overlaps(x, y)) return true;
    }
  }
  return false;
}

// A dispatch that declares no write range: its effects are unknown.
bool unknown(const CapturedNode& node) { return node.writes.empty(); }

// The ranges of a group of dispatches, and whether one of them is unknown.
struct Footprint {
  std::vector<ByteRange> reads, writes;
  bool unknown = false;
  bool empty() const { return reads.empty() && writes.empty() && !unknown; }
  void add(const CapturedNode& node) {
    reads.insert(reads.end(), node.reads.begin(), node.reads.end());
    writes.insert(writes.end(), node.writes.begin(), node.writes.end());
    unknown = unknown || routemm::unknown(node);
  }
  // RAW, WAR or WAW between `node` and this footprint (either order).
  bool conflicts(const CapturedNode& node) const {
    if (empty()) return false;
    if (unknown || routemm::unknown(node)) return true;
    return any_overlap(node.reads, writes) || any_overlap(node.writes, writes) ||
           any_overlap(node.writes, reads);
  }
};

bool conflict(const CapturedNode& a, const CapturedNode& b) {
  Footprint f;
  f.add(a);
  return f.conflicts(b);
}

}  // namespace

CapturedGraph::CapturedGraph(std::vector<CapturedNode> nodes) : nodes_(std::move(nodes)) {
  for (const auto& node : nodes_) {
    if (node.kind == CapturedNode::Kind::Dispatch && node.command == nullptr) {
      throw InvalidArgument("captured graph: dispatch '" + node.dispatch.pipeline_label +
                            "' carries no command; build graphs from take_capture()");
    }
  }
}

size_t CapturedGraph::dispatch_count() const {
  return static_cast<size_t>(std::count_if(nodes_.begin(), nodes_.end(), [](const auto& n) {
    return n.kind == CapturedNode::Kind::Dispatch;
  }));
}

void CapturedGraph::encode_sequential(CommandEncoder& encoder) const {
  // One unit: a node refused partway (e.g. by a full receipt) leaves nothing of the replay behind.
  CommandEncoder::Transaction transaction(encoder, "encode_sequential");
  for (const auto& node : nodes_) encoder.encode_captured(node);
  transaction.commit();
}

std::vector<bool> CapturedGraph::barriers_before() const {
  std::vector<bool> out(nodes_.size(), false);
  Footprint group;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const CapturedNode& node = nodes_[i];
    if (node.kind == CapturedNode::Kind::Barrier) {
      group = {};
      continue;
    }
    if (group.conflicts(node)) {
      out[i] = true;
      group = {};
    }
    group.add(node);
  }
  return out;
}

void CapturedGraph::encode_with_barriers(CommandEncoder& encoder) const {
  CommandEncoder::Transaction transaction(encoder, "encode_with_barriers");
  const std::vector<bool> barrier = barriers_before();
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i].kind == CapturedNode::Kind::Barrier) {
      encoder.memory_barrier();
      continue;
    }
    if (barrier[i]) encoder.memory_barrier();
    encoder.encode_captured(nodes_[i]);
  }
  transaction.commit();
}

CapturedGraph CapturedGraph::reordered() const {
  std::vector<const CapturedNode*> dispatches;
  for (const auto& node : nodes_) {
    if (node.kind != CapturedNode::Kind::Dispatch) continue;
    if (unknown(node)) {
      throw InvalidArgument("graph reorder: dispatch '" + node.dispatch.pipeline_label +
                            "' (node " + std::to_string(dispatches.size()) +
                            ") declares no write range; reordered dispatches must carry complete "
                            "hazard ranges");
    }
    dispatches.push_back(&node);
  }
  std::vector<CapturedNode> out;
  out.reserve(dispatches.size());
  std::vector<bool> used(dispatches.size(), false);
  for (size_t i = 0; i < dispatches.size(); ++i) {
    if (used[i]) continue;
    used[i] = true;
    out.push_back(*dispatches[i]);
    if (!is_reorderable(dispatches[i]->op_kind)) continue;
    Footprint group, skipped;
    group.add(*dispatches[i]);
    const size_t stop = std::min(dispatches.size(), i + 1 + kReorderLookahead);
    for (size_t j = i + 1; j < stop; ++j) {
      if (used[j]) continue;
      const CapturedNode& candidate = *dispatches[j];
      if (!is_reorderable(candidate.op_kind)) break;
      if (group.conflicts(candidate) || skipped.conflicts(candidate)) {
        skipped.add(candidate);
        continue;
      }
      used[j] = true;
      group.add(candidate);
      out.push_back(candidate);
    }
  }
  return CapturedGraph(std::move(out));
}

std::vector<std::vector<size_t>> CapturedGraph::dependencies() const {
  std::vector<std::vector<size_t>> deps;
  std::vector<size_t> previous_group, group;  // dispatch indices
  std::vector<const CapturedNode*> group_nodes;
  auto close_group = [&] {
    if (!group.empty()) previous_group = std::move(group);
    group.clear();
    group_nodes.clear();
  };
  for (const auto& node : nodes_) {
    if (node.kind == CapturedNode::Kind::Barrier) {
      close_group();
      continue;
    }
    // An unknown dispatch stands in a group of its own.
    if (unknown(node)) close_group();
    std::vector<size_t> after = previous_group;
    for (size_t g = 0; g < group.size(); ++g) {
      if (conflict(*group_nodes[g], node)) after.push_back(group[g]);
    }
    const size_t index = deps.size();
    deps.push_back(std::move(after));
    group.push_back(index);
    group_nodes.push_back(&node);
    if (unknown(node)) close_group();
  }
  return deps;
}

std::shared_ptr<const GraphExec> CapturedGraph::instantiate(Backend& backend) const {
  const auto deps = dependencies();
  std::vector<GraphDispatch> dispatches;
  dispatches.reserve(deps.size());
  size_t d = 0;
  for (const auto& node : nodes_) {
    if (node.kind != CapturedNode::Kind::Dispatch) continue;
    if (!node.command->keep_alive.empty() &&
        node.command->keep_alive.front()->backend().get() != &backend) {
      throw InvalidArgument("captured graph: dispatch '" + node.dispatch.pipeline_label +
                            "' binds memory of backend '" +
                            std::string(node.command->keep_alive.front()->backend()->name()) +
                            "', not of '" + std::string(backend.name()) + "'");
    }
    dispatches.push_back(GraphDispatch{node.command.get(), deps[d++]});
  }
  return backend.instantiate_graph(dispatches);
}

std::vector<std::shared_ptr<Storage>> CapturedGraph::keep_alive() const {
  std::vector<std::shared_ptr<Storage>> out;
  for (const auto& node : nodes_) {
    if (node.command == nullptr) continue;
    for (const auto& storage : node.command->keep_alive) {
      if (std::find(out.begin(), out.end(), storage) == out.end()) out.push_back(storage);
    }
  }
  return out;
}

GraphSession::GraphSession(CommandEncoder& encoder) : encoder_(encoder) {
  encoder_.start_capture();
}

CapturedGraph GraphSession::take() {
  auto nodes = encoder_.take_capture();
  if (!nodes) throw InvalidArgument("graph session: the encoder is no longer capturing");
  return CapturedGraph(std::move(*nodes));
}

void GraphSession::finish() {
  const CapturedGraph graph = take();
  graph.encode_sequential(encoder_);
  encoder_.commit_and_wait();
}

void GraphSession::finish_with_reorder() {
  const CapturedGraph graph = take().reordered();
  graph.encode_with_barriers(encoder_);
  encoder_.commit_and_wait();
}

}  // namespace routemm
