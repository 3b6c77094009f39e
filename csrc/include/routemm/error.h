// Error model: every failure the library reports is a routemm::Error; bad caller input is the
// InvalidArgument subclass, whose message names the operation and the offending value.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace routemm {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// An honest allocation failure: the size is possible, the device has no memory for it now.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// A pipeline that is not registered (or whose lookup was made to fail on purpose).
class KernelNotFound : public Error {
 public:
  using Error::Error;
};

// A submission that the backend reported as failed (launch error, sticky device error, a kernel
// that rejected its launch). `pipeline_label` names the pipeline whose launch failed, when one did.
class CommandBufferError : public Error {
 public:
  using Error::Error;
  CommandBufferError(const std::string& message, std::string pipeline_label)
      : Error(message), pipeline_label_(std::move(pipeline_label)) {}
  const std::string& pipeline_label() const { return pipeline_label_; }

 private:
  std::string pipeline_label_;
};

}  // namespace routemm
