// The Metal backend: the system default device, shared-storage buffers, and pipelines from
// routemm.metallib (plus the optional routemm_tensor.metallib).
//
// Thin by design: the op front doors in the core validate arguments, pick routes, compute
// geometry and record receipts. This file only turns a KernelLaunch into Metal calls.
//
// Queue model (spec §2.1, §2.2): one command buffer and one concurrent compute encoder per
// submission, both created on the first dispatch. A barrier is memoryBarrierWithScope:Buffers, and
// a no-op while nothing has been encoded. commit() ends the encoder, labels the command buffer and
// commits it without waiting; wait() waits for every committed command buffer and reports any
// status other than Completed as CommandBufferError; GPU times are the command buffer's
// GPUStartTime / GPUEndTime. An empty commit still commits an (empty) command buffer, so that a
// counted submission is a real one. Dropping a queue ends its encoder and never commits; storages
// of committed commands stay alive until the wait.
//
// Library lookup: ROUTEMM_METALLIB_PATH (the path of routemm.metallib) when set, else
// routemm.metallib beside the binary holding this code (the Python extension, or a test
// executable), else the build tree. A failure lists every place tried and why. The tensor library
// is looked for beside the base library that loaded.
//
// Tensor-API probe (spec §5.6 AUTO_PROBE): the tensor-route pipelines are registered only when
// routemm_tensor.metallib loads and each pipeline builds on this device; otherwise they are
// absent from kernels() (reported unavailable, never an error) and properties()["tensor_api"] says
// why.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <CommonCrypto/CommonDigest.h>
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"
#include "routemm/backend.h"
#include "routemm/error.h"
#include "routemm/ops/q4_matmul.h"
#include "routemm/registry.h"

#ifndef ROUTEMM_METALLIB_BUILD_DIR
#define ROUTEMM_METALLIB_BUILD_DIR ""
#endif

namespace routemm::metal {
namespace {

constexpr const char* kBaseLibrary = "routemm.metallib";
constexpr const char* kTensorLibrary = "routemm_tensor.metallib";

std::string text(NSString* s) { return s == nil ? std::string() : std::string([s UTF8String]); }
std::string error_text(NSError* e) {
  return e == nil ? std::string("unknown error") : text([e localizedDescription]);
}

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

// The directory of the binary this code is linked into.
std::string module_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&module_directory), &info) == 0 ||
      info.dli_fname == nullptr)
    return {};
  return directory_of(info.dli_fname);
}

std::string sha256_hex(NSData* data) {
  unsigned char digest[CC_SHA256_DIGEST_LENGTH];
  CC_SHA256(data.bytes, static_cast<CC_LONG>(data.length), digest);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : digest) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

struct Library {
  id<MTLLibrary> library = nil;
  std::string path;
  std::string sha256;  // of the metallib file: the pipelines' content hash
};

// Loads `path`, or returns an empty Library and appends "path (reason)" to `tried`.
Library try_load(id<MTLDevice> device, const std::string& path, std::string& tried) {
  Library out;
  NSString* ns_path = [NSString stringWithUTF8String:path.c_str()];
  NSData* bytes = [NSData dataWithContentsOfFile:ns_path];
  if (bytes == nil) {
    tried += (tried.empty() ? "" : "; ") + path + " (not readable)";
    return out;
  }
  NSError* error = nil;
  id<MTLLibrary> library = [device newLibraryWithURL:[NSURL fileURLWithPath:ns_path] error:&error];
  if (library == nil) {
    tried += (tried.empty() ? "" : "; ") + path + " (" + error_text(error) + ")";
    return out;
  }
  out.library = library;
  out.path = path;
  out.sha256 = sha256_hex(bytes);
  return out;
}

std::vector<std::string> base_library_candidates() {
  if (const char* env = std::getenv("ROUTEMM_METALLIB_PATH"); env != nullptr && *env != '\0')
    return {env};
  std::vector<std::string> out;
  if (const std::string dir = module_directory(); !dir.empty())
    out.push_back(dir + "/" + kBaseLibrary);
  if (std::strlen(ROUTEMM_METALLIB_BUILD_DIR) != 0)
    out.push_back(std::string(ROUTEMM_METALLIB_BUILD_DIR) + "/" + kBaseLibrary);
  return out;
}

struct Allocation {
  id<MTLBuffer> buffer = nil;
  size_t length = 0;
};

class MetalBackend final : public Backend {
 public:
  MetalBackend() {
    @autoreleasepool {
      device_ = MTLCreateSystemDefaultDevice();
      if (device_ == nil)
        throw Error("metal backend: MTLCreateSystemDefaultDevice returned no device");
      queue_ = [device_ newCommandQueue];
      if (queue_ == nil) throw Error("metal backend: cannot create a command queue");
      std::string tried;
      for (const std::string& path : base_library_candidates()) {
        base_ = try_load(device_, path, tried);
        if (base_.library != nil) break;
      }
      if (base_.library == nil) {
        throw Error(std::string("metal backend: cannot load ") + kBaseLibrary + "; tried: " +
                    (tried.empty() ? std::string("nothing (no candidate path)") : tried) +
                    ". Set ROUTEMM_METALLIB_PATH to its path.");
      }
      std::string tensor_tried;
      tensor_ = try_load(device_, directory_of(base_.path) + "/" + kTensorLibrary, tensor_tried);
      tensor_status_ = tensor_.library != nil ? "available" : "unavailable: " + tensor_tried;
      register_kernels();
    }
  }

  std::string_view name() const override { return "metal"; }
  std::string device_name() const override { return text(device_.name); }
  uint64_t registry_id() const override { return device_.registryID; }
  std::map<std::string, std::string> properties() const override {
    return {{"metallib", base_.path},
            {"metallib_sha256", base_.sha256},
            {"tensor_api", tensor_status_},
            {"unified_memory", device_.hasUnifiedMemory ? "true" : "false"},
            {"max_threadgroup_memory_bytes", std::to_string(device_.maxThreadgroupMemoryLength)}};
  }
  bool host_accessible() const override { return true; }  // shared storage on unified memory
  int32_t dlpack_device_type() const override { return 8; }

  std::shared_ptr<Storage> allocate(size_t nbytes) override {
    note_device_allocation();
    id<MTLBuffer> buffer = [device_ newBufferWithLength:(nbytes == 0 ? 1 : nbytes)
                                                options:MTLResourceStorageModeShared];
    if (buffer == nil)
      throw Error("metal backend: cannot allocate " + std::to_string(nbytes) + " bytes");
    void* data = buffer.contents;
    {
      std::lock_guard lock(mutex_);
      allocations_[reinterpret_cast<uintptr_t>(data)] =
          Allocation{buffer, nbytes == 0 ? 1 : nbytes};
    }
    return std::make_shared<Storage>(shared_from_this(), data, nbytes, true);
  }
  void deallocate(void* data, size_t) noexcept override {
    std::lock_guard lock(mutex_);
    allocations_.erase(reinterpret_cast<uintptr_t>(data));  // command buffers retain what they use
  }
  void copy_from_host(void* dst, const void* src, size_t nbytes) override {
    if (nbytes) std::memcpy(dst, src, nbytes);
  }
  void copy_to_host(void* dst, const void* src, size_t nbytes) override {
    if (nbytes) std::memcpy(dst, src, nbytes);
  }

  std::unique_ptr<Queue> create_queue(const QueueOptions& options) override;
  const std::vector<KernelDef>& kernels() const override { return kernels_; }

  id<MTLCommandQueue> command_queue() const { return queue_; }

  // The Metal buffer holding `address` and the offset of `address` inside it.
  std::pair<id<MTLBuffer>, NSUInteger> resolve(const void* address, const std::string& label,
                                               size_t slot) const {
    const auto a = reinterpret_cast<uintptr_t>(address);
    std::lock_guard lock(mutex_);
    auto it = allocations_.upper_bound(a);
    if (it != allocations_.begin()) {
      --it;
      if (a < it->first + it->second.length)
        return {it->second.buffer, static_cast<NSUInteger>(a - it->first)};
    }
    throw Error(label + ": argument slot " + std::to_string(slot) +
                " is not memory of this Metal device");
  }

  // The pipeline state for `function` specialised with `constants`, cached by label.
  id<MTLComputePipelineState> pipeline(std::string_view function, const std::string& label,
                                       const std::vector<std::pair<uint32_t, int32_t>>& constants) {
    const std::string key = std::string(function) + "#" + label;
    std::lock_guard lock(pipelines_mutex_);
    if (auto it = pipelines_.find(key); it != pipelines_.end()) return it->second;
    std::string why;
    id<MTLComputePipelineState> state = build(function, label, constants, why);
    if (state == nil) throw Error("metal backend: pipeline '" + label + "' is unavailable: " + why);
    pipelines_.emplace(key, state);
    return state;
  }

 private:
  id<MTLComputePipelineState> build(std::string_view function, const std::string& label,
                                    const std::vector<std::pair<uint32_t, int32_t>>& constants,
                                    std::string& why) {
    @autoreleasepool {
      NSString* name = [[NSString alloc] initWithBytes:function.data()
                                                length:function.size()
                                              encoding:NSUTF8StringEncoding];
      MTLFunctionConstantValues* values = [MTLFunctionConstantValues new];
      for (const auto& [index, value] : constants) {
        const int32_t v = value;
        [values setConstantValue:&v type:MTLDataTypeInt atIndex:index];
      }
      id<MTLFunction> fn = nil;
      id<MTLLibrary> libraries[] = {base_.library, tensor_.library};
      for (id<MTLLibrary> library : libraries) {
        if (library == nil || ![[library functionNames] containsObject:name]) continue;
        NSError* error = nil;
        fn = [library newFunctionWithName:name constantValues:values error:&error];
        if (fn == nil) {
          why = "function '" + std::string(function) + "': " + error_text(error);
          return nil;
        }
        break;
      }
      if (fn == nil) {
        why = "no function '" + std::string(function) + "' in the loaded libraries";
        return nil;
      }
      MTLComputePipelineDescriptor* descriptor = [MTLComputePipelineDescriptor new];
      descriptor.label = [NSString stringWithUTF8String:label.c_str()];
      descriptor.computeFunction = fn;
      NSError* error = nil;
      id<MTLComputePipelineState> state =
          [device_ newComputePipelineStateWithDescriptor:descriptor
                                                 options:MTLPipelineOptionNone
                                              reflection:nil
                                                   error:&error];
      if (state == nil) why = error_text(error);
      return state;
    }
  }

  // Builds every pipeline once, with the constants its op fetches it with, so that KernelDefs carry
  // the device's real thread limit and a broken library fails at open, not mid-encode.
  void register_kernels() {
    const std::vector<std::pair<uint32_t, int32_t>> q4(kQ4PipelineConstants.begin(),
                                                       kQ4PipelineConstants.end());
    const std::vector<std::pair<uint32_t, int32_t>> none;
    std::string tensor_failures;
    for (const MetalPipelineSpec& spec : metal_pipeline_specs()) {
      const auto& constants = spec.q4_constants ? q4 : none;
      const std::string label = pipeline_label(spec.name, constants);
      std::string why;
      id<MTLComputePipelineState> state = nil;
      if (spec.library == MetalLibrary::Base || tensor_.library != nil)
        state = build(spec.name, label, constants, why);
      if (state == nil) {
        if (spec.library == MetalLibrary::Tensor) {
          if (tensor_.library != nil)
            tensor_failures += (tensor_failures.empty() ? "" : "; ") + label + ": " + why;
          continue;  // the route is unavailable here, not an error
        }
        throw Error("metal backend: " + base_.path + " cannot build pipeline '" + label +
                    "': " + why);
      }
      pipelines_.emplace(std::string(spec.name) + "#" + label, state);
      KernelDef def =
          metal_kernel_def(spec, state.maxTotalThreadsPerThreadgroup, "metallib",
                           spec.library == MetalLibrary::Base ? base_.sha256 : tensor_.sha256);
      kernels_.push_back(std::move(def));
    }
    if (!tensor_failures.empty()) tensor_status_ = "unavailable: " + tensor_failures;
  }

  id<MTLDevice> device_ = nil;
  id<MTLCommandQueue> queue_ = nil;
  Library base_;
  Library tensor_;
  std::string tensor_status_;
  std::vector<KernelDef> kernels_;
  mutable std::mutex mutex_;
  std::map<uintptr_t, Allocation> allocations_;
  std::mutex pipelines_mutex_;
  std::map<std::string, id<MTLComputePipelineState>> pipelines_;
};

class MetalQueue final : public Queue, public MetalLaunchTarget {
 public:
  explicit MetalQueue(std::shared_ptr<MetalBackend> backend) : backend_(std::move(backend)) {}
  ~MetalQueue() override {
    // Dropping a queue ends its encoder and never commits (spec §2.1); committed work finishes
    // before its storages go.
    if (encoder_ != nil) [encoder_ endEncoding];
    for (const auto& f : in_flight_) [f.buffer waitUntilCompleted];
  }

  void submit(QueuedCommand command) override {
    @autoreleasepool {
      if (command.kind == QueuedCommand::Kind::Barrier) {
        if (encoder_ != nil) [encoder_ memoryBarrierWithScope:MTLBarrierScopeBuffers];
        return;
      }
      if (command.kind != QueuedCommand::Kind::Dispatch)
        throw Error("metal backend: graph commands are not supported");
      if (command_buffer_ == nil) command_buffer_ = [backend_->command_queue() commandBuffer];
      if (encoder_ == nil) {
        encoder_ =
            [command_buffer_ computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
      }
      command.fn(command.launch, static_cast<MetalLaunchTarget*>(this));
      pending_.push_back(std::move(command));
    }
  }

  void commit(const std::string& label, bool timed) override {
    @autoreleasepool {
      id<MTLCommandBuffer> buffer =
          command_buffer_ != nil ? command_buffer_ : [backend_->command_queue() commandBuffer];
      if (!label.empty()) buffer.label = [NSString stringWithUTF8String:label.c_str()];
      if (encoder_ != nil) {
        if (!label.empty()) encoder_.label = buffer.label;
        [encoder_ endEncoding];
      }
      encoder_ = nil;
      command_buffer_ = nil;
      [buffer commit];
      in_flight_.push_back(InFlight{buffer, std::move(pending_), timed});
      pending_.clear();
    }
  }

  GpuInterval wait() override {
    @autoreleasepool {
      GpuInterval interval;
      std::string failure;
      for (const auto& f : in_flight_) {
        [f.buffer waitUntilCompleted];
        if (f.buffer.status != MTLCommandBufferStatusCompleted && failure.empty()) {
          std::string labels;
          for (const auto& c : f.commands) {
            if (labels.find(c.launch.label) == std::string::npos)
              labels += (labels.empty() ? "" : ", ") + c.launch.label;
          }
          failure = "metal backend: GPU command buffer completed with error status " +
                    std::to_string(static_cast<long>(f.buffer.status)) + ": " +
                    error_text(f.buffer.error) +
                    (labels.empty() ? std::string() : " (pipelines: " + labels + ")");
        }
        if (f.timed) interval = {f.buffer.GPUStartTime, f.buffer.GPUEndTime};
      }
      if (!in_flight_.empty()) note_host_wait();
      in_flight_.clear();
      if (!failure.empty()) throw CommandBufferError(failure);
      return interval;
    }
  }

  void encode(std::string_view function, const KernelLaunch& launch) override {
    if (encoder_ == nil)
      throw Error("metal backend: '" + launch.label + "' encoded outside a submission");
    [encoder_
        setComputePipelineState:backend_->pipeline(function, launch.label, launch.int_constants)];
    for (size_t slot = 0; slot < launch.args.size(); ++slot) {
      const BoundArg& arg = launch.args[slot];
      if (arg.kind == BoundArg::Kind::Buffer) {
        const auto [buffer, offset] = backend_->resolve(arg.data, launch.label, slot);
        [encoder_ setBuffer:buffer offset:offset atIndex:slot];
      } else if (arg.kind == BoundArg::Kind::Bytes) {
        [encoder_ setBytes:arg.data length:arg.size atIndex:slot];
      }
    }
    for (const auto& [index, bytes] : launch.threadgroup_memory) {
      [encoder_ setThreadgroupMemoryLength:bytes atIndex:index];
    }
    const MTLSize grid = MTLSizeMake(launch.grid.x, launch.grid.y, launch.grid.z);
    const MTLSize threads = MTLSizeMake(launch.threads.x, launch.threads.y, launch.threads.z);
    if (launch.kind == DispatchKind::Threads) {
      [encoder_ dispatchThreads:grid threadsPerThreadgroup:threads];
    } else {
      [encoder_ dispatchThreadgroups:grid threadsPerThreadgroup:threads];
    }
  }

 private:
  struct InFlight {
    id<MTLCommandBuffer> buffer;
    std::vector<QueuedCommand> commands;
    bool timed = false;
  };

  std::shared_ptr<MetalBackend> backend_;
  id<MTLCommandBuffer> command_buffer_ = nil;
  id<MTLComputeCommandEncoder> encoder_ = nil;
  std::vector<QueuedCommand> pending_;
  std::vector<InFlight> in_flight_;
};

std::unique_ptr<Queue> MetalBackend::create_queue(const QueueOptions& options) {
  if (options.stream) {
    throw InvalidArgument(
        "metal backend: command_encoder(stream=...) needs a backend with streams (cuda)");
  }
  return std::make_unique<MetalQueue>(std::static_pointer_cast<MetalBackend>(shared_from_this()));
}

std::string probe() {
  @autoreleasepool {
    id<MTLDevice> device = MTLCreateSystemDefaultDevice();
    if (device == nil) return "no Metal device (MTLCreateSystemDefaultDevice returned nil)";
    std::string tried;
    for (const std::string& path : base_library_candidates()) {
      if ([[NSFileManager defaultManager]
              fileExistsAtPath:[NSString stringWithUTF8String:path.c_str()]])
        return {};
      tried += (tried.empty() ? "" : "; ") + path;
    }
    return std::string(kBaseLibrary) + " not found (tried: " + (tried.empty() ? "nothing" : tried) +
           "); set ROUTEMM_METALLIB_PATH";
  }
}

}  // namespace

void register_metal_backend() {
  register_backend(BackendEntry{"metal", 10, probe, []() -> std::shared_ptr<Backend> {
                                  // Process-wide; a failed open is retried next time.
                                  static std::mutex mutex;
                                  static std::shared_ptr<Backend> backend;
                                  std::lock_guard lock(mutex);
                                  if (!backend) backend = std::make_shared<MetalBackend>();
                                  return backend;
                                }});
}

}  // namespace routemm::metal
