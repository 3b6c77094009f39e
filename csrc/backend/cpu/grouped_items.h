// The grouped routes' work items on the CPU (dense_matmul_id.cpp, quantized_matmul_id.cpp,
// ggml_format_kernels.cpp): one expert's routed rows times a column range, and the runner that
// hands them to the launch's pool.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "thread_pool.h"

namespace routemm::cpu {

// Entries [row0, row0 + rows) of the map's routed list, all of expert `expert`, times the columns
// from col0 (the route fixes how many).
struct GroupedItem {
  uint32_t expert;
  uint32_t row0, rows;
  uint32_t col0;
};

// Runs run_item on every item on the launch's pool (queue_native; none or one thread: in order on
// this one), one item at a time from a shared counter, which balances uneven expert counts (the
// builders sort the largest items first).
template <class RunItem>
void run_grouped_items(void* queue_native, const std::vector<GroupedItem>& items,
                       const RunItem& run_item) {
  auto* pool = static_cast<ThreadPool*>(queue_native);
  if (pool == nullptr || pool->size() == 1) {
    for (const GroupedItem& item : items) run_item(item);
    return;
  }
  std::atomic<size_t> next{0};
  pool->parallel_for(pool->size(), 1, [&](size_t, size_t) {
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < items.size();
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      run_item(items[i]);
    }
  });
}

}  // namespace routemm::cpu
