"""Keeping rows: the row cache (index, admission sketch, eviction), the cached source (a batch's look-up, reads of its
misses, admission), hot-row files across processes and the next batch's prefetch. Imports io and the base modules;
never the GPU, prefill or integrations."""
