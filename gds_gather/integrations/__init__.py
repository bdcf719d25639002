"""Other programs' models: Hugging Face transformers (the disk-backed per-layer embedding), the vLLM plugin, and
`convert` (a checkpoint's table as a GGUF). The top layer: imports anything below it, nothing imports it but the CLI."""
