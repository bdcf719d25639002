"""Reading rows from storage into host memory: the io_uring submitter, the readers (direct and the baselines), page-cache
residency, the native helpers, block-device facts, safe output files and measurement of what storage delivered.
Imports gds_gather's base modules (config, errors, planner, platform) and formats; never the caches, the GPU, prefill
or integrations."""
