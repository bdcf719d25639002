"""The device: the Accel interface with its CUDA and host implementations, device arrays and streams, destinations of
device rows, the device row cache, the dequant kernels' loading and launch, the host-device schedule and graph flags.
Imports cache, io, formats and the base modules; never prefill or integrations."""
