"""Keeping rows: the row cache (store, its index and admission sketch, the per-file registry in rowcache), the cached
source (a batch's look-up, reads of its misses, admission), hot-row files across processes and the next batch's
prefetch. Imports io, formats and the base modules; never the GPU, prefill or integrations."""
