// The CPU backend's thread pool: every index exactly once, with and without polling between jobs;
// errors reach the caller; two callers; teardown while workers poll.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "backend/cpu/thread_pool.h"

namespace {

using routemm::cpu::ThreadPool;
using std::chrono::microseconds;

// Runs `jobs` parallel_for calls of random sizes and grains; every index of every job is visited
// exactly once.
void expect_every_index_once(ThreadPool& pool, int jobs, uint32_t seed) {
  std::mt19937 rng(seed);
  for (int j = 0; j < jobs; ++j) {
    const size_t n = 1 + rng() % 2000, grain = 1 + rng() % 40;
    std::vector<std::atomic<int>> seen(n);
    pool.parallel_for(n, grain, [&](size_t begin, size_t end) {
      ASSERT_LT(begin, end);
      ASSERT_LE(end, n);
      for (size_t i = begin; i < end; ++i) seen[i].fetch_add(1);
    });
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(seen[i].load(), 1) << "job " << j << " index " << i;
  }
}

TEST(ThreadPool, EveryIndexOnceWhetherThreadsPollOrSleep) {
  for (const auto spin : {microseconds(0), microseconds(200), microseconds(100000)}) {
    ThreadPool pool(3, spin);
    EXPECT_EQ(pool.size(), 3u);
    expect_every_index_once(pool, 300, 7);
    // Gaps longer than the polling window: the workers sleep and must be woken.
    for (int i = 0; i < 5; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      expect_every_index_once(pool, 2, 11 + i);
    }
  }
}

TEST(ThreadPool, ErrorsReachTheCallerAndThePoolStaysUsable) {
  ThreadPool pool(3, microseconds(200));
  for (int round = 0; round < 20; ++round) {
    EXPECT_THROW(pool.parallel_for(64, 1,
                                   [&](size_t begin, size_t) {
                                     if (begin == 0) throw std::runtime_error("chunk failed");
                                   }),
                 std::runtime_error);
    expect_every_index_once(pool, 3, round);
  }
}

TEST(ThreadPool, TwoCallersShareThePool) {
  ThreadPool pool(2, microseconds(200));
  std::thread other([&] { expect_every_index_once(pool, 200, 1); });
  expect_every_index_once(pool, 200, 2);
  other.join();
}

TEST(ThreadPool, TeardownDoesNotWaitOutThePollingWindow) {
  const auto start = std::chrono::steady_clock::now();
  {
    ThreadPool pool(3, microseconds(10'000'000));  // 10 s of polling
    expect_every_index_once(pool, 3, 5);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

}  // namespace
