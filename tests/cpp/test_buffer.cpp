// Buffers and devices: allocation, views, copies, backend discovery.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "routemm/buffer.h"
#include "routemm/device.h"
#include "routemm/error.h"

using namespace routemm;

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::U8), 1u);
  EXPECT_EQ(dtype_name(DType::BF16), "bf16");
  EXPECT_EQ(dtype_name(DType::I32), "i32");
}

TEST(Device, CpuIsAlwaysAvailableAndOthersSayWhy) {
  const auto names = available_backends();
  const auto cpu_at = std::find(names.begin(), names.end(), "cpu");
  ASSERT_NE(cpu_at, names.end());
  // Only test backends rank below the CPU: they are never the default device.
  for (auto it = cpu_at + 1; it != names.end(); ++it) EXPECT_EQ(*it, "metal_emu");
  for (const auto& status : backend_status()) {
    if (!status.available) {
      EXPECT_FALSE(status.reason.empty()) << status.name;
    }
  }
  Device cpu(std::string("cpu"));
  EXPECT_EQ(cpu.backend_name(), "cpu");
  EXPECT_THROW(Device(std::string("bogus")), InvalidArgument);
}

TEST(Buffer, ViewsComposeAndStayInRange) {
  Device device(std::string("cpu"));
  Buffer parent = device.alloc(64, DType::U8, {64});
  EXPECT_EQ(parent.byte_offset(), 0u);
  EXPECT_EQ(parent.nbytes(), 64u);
  Buffer a = parent.view(16, 32, DType::F32, {8});
  EXPECT_EQ(a.byte_offset(), 16u);
  EXPECT_EQ(a.address(), parent.address());
  Buffer b = a.view(8, 8, DType::U32, {2});
  EXPECT_EQ(b.byte_offset(), 24u);
  EXPECT_EQ(b.logical_range().first, parent.address() + 24);
  EXPECT_EQ(b.logical_range().second, parent.address() + 32);
  EXPECT_THROW(a.view(8, 32, DType::U8, {}), InvalidArgument);   // past the parent's end
  EXPECT_THROW(a.view(0, 6, DType::F32, {}), InvalidArgument);   // not whole f32 elements
  EXPECT_THROW(a.view(0, 8, DType::F32, {3}), InvalidArgument);  // shape disagrees with bytes
}

TEST(Buffer, HostCopiesCoverExactlyTheView) {
  Device device(std::string("cpu"));
  Buffer parent = device.alloc(16, DType::U8, {16});
  std::vector<uint8_t> poison(16, 0xAB);
  parent.copy_from_host(poison.data(), poison.size());
  Buffer view = parent.view(4, 8, DType::U8, {8});
  const std::vector<uint8_t> data = {1, 2, 3, 4, 5, 6, 7, 8};
  view.copy_from_host(data.data(), data.size());
  std::vector<uint8_t> back(16);
  parent.copy_to_host(back.data(), back.size());
  for (int i = 0; i < 16; ++i) {
    const uint8_t want = (i >= 4 && i < 12) ? static_cast<uint8_t>(i - 3) : 0xAB;
    EXPECT_EQ(back[i], want) << i;
  }
  EXPECT_THROW(view.copy_from_host(data.data(), 7), InvalidArgument);
}
