"""The device: the Accel interface (interface.py) with its CUDA (cuda.py) and host (host.py) implementations, a
Table's device reads (device_path.py), destinations of device rows, the device row cache, the dequant kernels'
modules, lookup tables, launch and host build, the host-device schedule and the graph's flags.
Imports backends, cache, io, formats and the base modules; never table, prefill or integrations."""
