"""The main job: prompts and tokenizers, model families (row ids, per-layer layout), the CPU and GPU pipelines and the
run that prints the report. Imports the table, gpu, cache, io, formats and the base modules; never integrations."""
