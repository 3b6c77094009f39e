// CommandEncoder, capture nodes, dispatch receipts and counters.
#include <pybind11/stl.h>

#include <exception>
#include <memory>
#include <optional>
#include <type_traits>

#include "bindings.h"
#include "routemm/device.h"
#include "routemm/encoder.h"
#include "routemm/error.h"
#include "routemm/graph.h"
#include "routemm/registry.h"

namespace routemm::python {
namespace {

const char* kind_name(DispatchKind kind) {
  return kind == DispatchKind::Threads ? "threads" : "thread_groups";
}

// EncodedKernelDispatch as the plain dict routemm.EncodedKernelDispatch is built from.
py::dict dispatch_dict(const EncodedKernelDispatch& d) {
  py::dict out;
  out["pipeline_label"] = d.pipeline_label;
  out["dispatch_kind"] = kind_name(d.dispatch_kind);
  out["grid"] = py::make_tuple(d.grid[0], d.grid[1], d.grid[2]);
  out["threads_per_threadgroup"] = py::make_tuple(
      d.threads_per_threadgroup[0], d.threads_per_threadgroup[1], d.threads_per_threadgroup[2]);
  py::list memory;
  for (const auto& [index, bytes] : d.threadgroup_memory)
    memory.append(py::make_tuple(index, bytes));
  out["threadgroup_memory"] = py::tuple(memory);
  return out;
}

py::list ranges_list(const std::vector<ByteRange>& ranges) {
  py::list out;
  for (const auto& r : ranges) out.append(py::make_tuple(r.start, r.end));
  return out;
}

py::dict node_dict(const CapturedNode& node) {
  py::dict out;
  if (node.kind == CapturedNode::Kind::Barrier) {
    out["kind"] = "barrier";
    return out;
  }
  out["kind"] = "dispatch";
  out["dispatch"] = dispatch_dict(node.dispatch);
  py::list bindings;
  for (const auto& b : node.bindings) {
    py::dict binding;
    binding["slot"] = b.slot;
    if (b.is_bytes) {
      binding["bytes"] = py::bytes(reinterpret_cast<const char*>(b.bytes.data()), b.bytes.size());
    } else {
      binding["address"] = b.address;
      binding["offset"] = b.offset;
    }
    bindings.append(binding);
  }
  out["bindings"] = bindings;
  out["reads"] = ranges_list(node.reads);
  out["writes"] = ranges_list(node.writes);
  out["op_kind"] = std::string(to_string(node.op_kind));
  return out;
}

py::list nodes_list(const std::vector<CapturedNode>& nodes) {
  py::list out;
  for (const auto& node : nodes) out.append(node_dict(node));
  return out;
}

// An instantiated backend graph with the storages its dispatches bind.
struct InstantiatedGraph {
  std::shared_ptr<const GraphExec> exec;
  std::vector<std::shared_ptr<Storage>> keep_alive;
};

// (slot, Buffer) | (slot, (Buffer, offset)) | (slot, bytes), as CommandEncoder._dispatch takes them.
std::vector<std::pair<uint32_t, KernelArg>> kernel_args(const py::list& args) {
  std::vector<std::pair<uint32_t, KernelArg>> bound;
  for (const auto& item : args) {
    const auto pair = item.cast<py::tuple>();
    const auto slot = pair[0].cast<uint32_t>();
    const py::object value = pair[1];
    if (py::isinstance<Buffer>(value)) {
      bound.emplace_back(slot, KernelArg::of(value.cast<Buffer>()));
    } else if (py::isinstance<py::bytes>(value)) {
      const std::string data = value.cast<std::string>();
      bound.emplace_back(slot, KernelArg::raw(data.data(), data.size()));
    } else {
      const auto at = value.cast<py::tuple>();
      bound.emplace_back(slot, KernelArg::at(at[0].cast<Buffer>(), at[1].cast<uint64_t>()));
    }
  }
  return bound;
}

// CommandEncoder::Transaction as a Python context manager: the with-block is one unit, committed
// when it ends normally and dropped when it raises (routemm.moe's experts block uses it).
struct PyTransaction {
  explicit PyTransaction(CommandEncoder& e) : encoder(e) {}
  CommandEncoder& encoder;
  std::optional<CommandEncoder::Transaction> open;
};

std::vector<ByteRange> to_ranges(const std::vector<std::pair<uint64_t, uint64_t>>& pairs) {
  std::vector<ByteRange> out;
  for (const auto& [start, end] : pairs) out.push_back({start, end});
  return out;
}

}  // namespace

py::dict encoded_dispatch_dict(const EncodedKernelDispatch& d) { return dispatch_dict(d); }

void init_encoder(py::module_& m) {
  m.def("dispatch_count", &dispatch_count,
        "Dispatches encoded by this process since the last reset.");
  m.def("encoder_counters", [] {
    const auto c = encoder_counters();
    py::dict out;
    out["encoders_created"] = c.encoders_created;
    out["command_buffers"] = c.command_buffers;
    out["dispatches"] = c.dispatches;
    out["barriers"] = c.barriers;
    out["commits"] = c.commits;
    out["waits"] = c.waits;
    out["streams_created"] = c.streams_created;
    out["device_allocations"] = c.device_allocations;
    out["host_waits"] = c.host_waits;
    return out;
  });
  m.def("reset_encoder_counters", &reset_encoder_counters);

  py::class_<CommandEncoder>(m, "CommandEncoder",
                             "Records dispatches and barriers for one device queue, then commits "
                             "them. Belongs to one thread at a time: a call that enters it while "
                             "another thread is inside it raises routemm.Error and changes nothing "
                             "(give each thread its own encoder).")
      .def_property_readonly("device_registry_id", &CommandEncoder::device_registry_id)
      .def_property_readonly("pending_dispatches", &CommandEncoder::pending_dispatches)
      .def("memory_barrier", &CommandEncoder::memory_barrier)
      .def(
          "_transaction", [](CommandEncoder& e) { return std::make_unique<PyTransaction>(e); },
          py::keep_alive<0, 1>(),
          "A context manager making what its block encodes all or nothing: a block that raises "
          "leaves the encoder as it was (see CommandEncoder::Transaction).")
      .def(
          "commit_and_wait", [](CommandEncoder& e) { without_gil([&] { e.commit_and_wait(); }); },
          "Run everything encoded so far and wait for it (the GIL is released meanwhile). An "
          "encoder belongs to one thread at a time: a call from another thread while this runs "
          "raises routemm.Error.")
      .def(
          "commit_wait_with_gpu_time",
          [](CommandEncoder& e) {
            const GpuInterval t = without_gil([&] { return e.commit_wait_with_gpu_time(); });
            return py::make_tuple(t.start_s, t.end_s);
          },
          "Commit, wait, and return (gpu_start_s, gpu_end_s).")
      .def("start_capture", &CommandEncoder::start_capture)
      .def("is_capturing", &CommandEncoder::is_capturing)
      .def("_take_capture",
           [](CommandEncoder& e) -> py::object {
             auto nodes = e.take_capture();
             if (!nodes) return py::none();
             py::list out;
             for (const auto& node : *nodes) out.append(node_dict(node));
             return out;
           })
      .def("start_encoded_dispatch_receipt", &CommandEncoder::start_encoded_dispatch_receipt,
           py::arg("capacity"))
      .def("has_open_receipt", &CommandEncoder::has_open_receipt)
      .def("_take_encoded_dispatch_receipt",
           [](CommandEncoder& e) {
             py::list out;
             for (const auto& d : e.take_encoded_dispatch_receipt()) out.append(dispatch_dict(d));
             return out;
           })
      .def(
          "set_pending_buffer_ranges",
          [](CommandEncoder& e, const std::vector<std::pair<uint64_t, uint64_t>>& reads,
             const std::vector<std::pair<uint64_t, uint64_t>>& writes) {
            e.set_pending_buffer_ranges(to_ranges(reads), to_ranges(writes));
          },
          py::arg("reads"), py::arg("writes"))
      .def("_dispatch",
           [](CommandEncoder& e, const Pipeline& pipeline, const py::list& args,
              std::array<uint64_t, 3> grid, std::array<uint64_t, 3> threads, bool threads_kind,
              std::vector<std::pair<uint64_t, uint64_t>> threadgroup_memory) {
             const auto bound = kernel_args(args);
             e.dispatch(pipeline, bound, Dim3{grid[0], grid[1], grid[2]},
                        Dim3{threads[0], threads[1], threads[2]},
                        threads_kind ? DispatchKind::Threads : DispatchKind::ThreadGroups,
                        std::move(threadgroup_memory));
           })
      .def("_dispatch_tracked",
           [](CommandEncoder& e, const Pipeline& pipeline, const py::list& args,
              std::array<uint64_t, 3> grid, std::array<uint64_t, 3> threads, bool threads_kind,
              std::vector<std::pair<uint64_t, uint64_t>> threadgroup_memory,
              const std::vector<Buffer>& reads, const std::vector<Buffer>& writes) {
             const auto bound = kernel_args(args);
             e.dispatch_tracked(pipeline, bound, Dim3{grid[0], grid[1], grid[2]},
                                Dim3{threads[0], threads[1], threads[2]},
                                threads_kind ? DispatchKind::Threads : DispatchKind::ThreadGroups,
                                std::move(threadgroup_memory), reads, writes);
           })
      .def(
          "set_op_kind",
          [](CommandEncoder& e, const std::string& kind) {
            e.set_op_kind(op_kind_from_string(kind));
          },
          py::arg("kind"),
          "Tag the next dispatch with an op kind (other, rms_norm, elem_mul, elem_add, sdpa, "
          "softmax); sdpa and softmax dispatches are never reordered.")
      .def_property("auto_barrier", &CommandEncoder::auto_barrier,
                    &CommandEncoder::set_auto_barrier,
                    "The automatic-barrier tracker for dispatch_tracked (default: "
                    "ROUTEMM_ENCODER_AUTO_BARRIER).")
      .def("force_barrier_and_reset_tracker", &CommandEncoder::force_barrier_and_reset_tracker)
      .def("commit", &CommandEncoder::commit,
           "Start everything encoded so far and return without waiting.")
      .def(
          "commit_labeled",
          [](CommandEncoder& e, const std::string& label) { e.commit_labeled(label); },
          py::arg("label"),
          "commit() with a label for the backend's profiler (NVTX range on CUDA, command-buffer "
          "label on Metal).")
      .def(
          "wait_until_completed",
          [](CommandEncoder& e) { without_gil([&] { e.wait_until_completed(); }); },
          "Wait for every committed submission (the GIL is released meanwhile); raises the first "
          "failure among them.")
      .def(
          "commit_and_wait_labeled",
          [](CommandEncoder& e, const std::string& label) {
            without_gil([&] { e.commit_and_wait_labeled(label); });
          },
          py::arg("label"))
      .def(
          "take_graph",
          [](CommandEncoder& e) -> std::optional<CapturedGraph> {
            auto nodes = e.take_capture();
            if (!nodes) return std::nullopt;
            return CapturedGraph(std::move(*nodes));
          },
          "End capture and return the recorded nodes as a CapturedGraph (None when not "
          "capturing).")
      .def(
          "encode_graph",
          [](CommandEncoder& e, const InstantiatedGraph& g) {
            e.encode_graph(g.exec, g.keep_alive);
          },
          py::arg("graph"), "Record an instantiated graph as one command of this submission.");

  py::class_<PyTransaction>(m, "_EncoderTransaction")
      .def(
          "__enter__",
          [](PyTransaction& t) -> PyTransaction& {
            if (t.open) throw Error("an encoder transaction is entered once");
            t.open.emplace(t.encoder, "transaction");
            return t;
          },
          py::return_value_policy::reference)
      .def("__exit__",
           [](PyTransaction& t, const py::object& type, const py::object&, const py::object&) {
             if (!t.open) return false;
             struct Close {
               std::optional<CommandEncoder::Transaction>& open;
               ~Close() { open.reset(); }  // after a commit: nothing to drop
             } close{t.open};
             if (type.is_none()) t.open->commit();
             return false;
           });

  py::class_<InstantiatedGraph>(m, "GraphExec",
                                "A backend graph (a CUDA graph) instantiated from a CapturedGraph.")
      .def_property_readonly("node_count",
                             [](const InstantiatedGraph& g) { return g.exec->node_count(); })
      .def_property_readonly("edge_count",
                             [](const InstantiatedGraph& g) { return g.exec->edge_count(); });

  py::class_<CapturedGraph>(
      m, "CapturedGraph",
      "A capture to replay: in order, with barriers derived from the recorded "
      "byte ranges, reordered, or instantiated as a backend graph.")
      .def_property_readonly("_nodes", [](const CapturedGraph& g) { return nodes_list(g.nodes()); })
      .def_property_readonly("dispatch_count", &CapturedGraph::dispatch_count)
      .def("encode_sequential", &CapturedGraph::encode_sequential, py::arg("encoder"))
      .def("encode_with_barriers", &CapturedGraph::encode_with_barriers, py::arg("encoder"))
      .def("reordered", &CapturedGraph::reordered)
      .def("barriers_before", &CapturedGraph::barriers_before)
      .def("dependencies", &CapturedGraph::dependencies)
      .def(
          "instantiate",
          [](const CapturedGraph& g, const Device& device) -> std::optional<InstantiatedGraph> {
            auto exec = g.instantiate(*device.backend());
            if (exec == nullptr) return std::nullopt;
            return InstantiatedGraph{std::move(exec), g.keep_alive()};
          },
          py::arg("device"),
          "A backend graph of this capture (None where the backend has no graph object).");

  py::class_<GraphSession>(m, "GraphSession",
                           "Capture on an encoder, then replay in order (finish) or reordered with "
                           "derived barriers (finish_with_reorder), committing and waiting.")
      .def(py::init<CommandEncoder&>(), py::arg("encoder"), py::keep_alive<1, 2>())
      .def_property_readonly("encoder", &GraphSession::encoder,
                             py::return_value_policy::reference_internal)
      .def("finish", [](GraphSession& s) { without_gil([&] { s.finish(); }); })
      .def("finish_with_reorder",
           [](GraphSession& s) { without_gil([&] { s.finish_with_reorder(); }); });
}

}  // namespace routemm::python
