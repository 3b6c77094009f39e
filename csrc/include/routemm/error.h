// Error model: every failure the library reports is a routemm::Error; bad caller input is the
// InvalidArgument subclass, whose message names the operation and the offending value.
#pragma once

#include <stdexcept>
#include <string>

namespace routemm {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A pipeline that is not registered (or whose lookup was made to fail on purpose).
class KernelNotFound : public Error {
 public:
  using Error::Error;
};

// A submission that the backend reported as failed (launch error, sticky device error).
class CommandBufferError : public Error {
 public:
  using Error::Error;
};

}  // namespace routemm
