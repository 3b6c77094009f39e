"""The core layer: the native types of routemm._core and their Python half, errors, environment
knobs, JSON records and their schemas, zero-copy interop. It imports no other layer."""
