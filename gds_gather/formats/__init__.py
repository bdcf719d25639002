"""File formats: the bounded GGUF header parser, GGUF and safetensors tables located in their files, and the GGML
type facts (from gguf). Imports only gds_gather.errors and gguf; knows nothing of reading rows."""
