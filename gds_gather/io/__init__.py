"""Reading rows from storage into host memory: the io_uring submitter (uring, uring_abi, uring_groups), the readers
(readers: the protocol and the baselines; direct: the O_DIRECT engine), page-cache residency, the native helpers and
their run-time build, libc, block-device facts, safe output files and measurement of what storage delivered.
Imports the base modules (config, errors, units, planner, platform) and formats; never the caches, the GPU, prefill
or integrations."""
