"""The one exception hierarchy: every error gds_gather raises on bad input derives from GatherError."""
import argparse


class GatherError(Exception):
    """Base class of every gds_gather error."""


class NotGGUFError(GatherError, ValueError):
    """The file is not a GGUF file (bad magic, unsupported version, unreadable header)."""


class HeaderError(GatherError, ValueError):
    """The GGUF header is malformed: absurd counts, duplicate names, bad alignment."""


class TruncatedFileError(GatherError, ValueError):
    """The file ends before data its header promises (metadata or tensor data past the end)."""


class TableNotFoundError(GatherError, KeyError):
    """The requested tensor is in none of the model's files."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ModelNotFoundError(GatherError, FileNotFoundError):
    """A model path (or a shard or file it names) that does not exist; the message names the path."""


class UnsupportedTypeError(GatherError, TypeError):
    """A GGML type gds_gather cannot dequantize (or an unknown type id)."""


class RowWidthError(GatherError, ValueError):
    """The row width is not a multiple of the type's block size."""


class BadIdsError(GatherError, IndexError):
    """Row ids that are not integers or lie outside [0, n_rows)."""


class BackendError(GatherError, RuntimeError):
    """A backend that is unknown or unavailable on this machine."""


class ReadError(GatherError, OSError):
    """An I/O failure while reading rows: names the file and the offset."""


class NotSafetensorsError(NotGGUFError):
    """The file is not a safetensors file (bad header length or JSON); a NotGGUFError: no table format fits."""


class ModelMismatchError(GatherError, ValueError):
    """A model and a table that do not fit: no per-layer embedding, or rows, width or dtype that differ."""


class TableLayoutError(GatherError, ValueError):
    """A table whose per-layer layout (layer count, elements per layer) is missing or does not fit its rows."""


class BadDtypeError(GatherError, TypeError):
    """An output dtype gds_gather cannot produce (the message names the accepted ones)."""


class TokenizerError(GatherError, ValueError):
    """The file's tokenizer metadata is of a kind this module does not run, or is inconsistent."""


class StagingCapacityError(GatherError):
    """A plan needs more staging than a captured graph's buffer holds (refused before anything is read)."""


class PromptError(GatherError, ValueError):
    """A prompt file that cannot be used (missing, not a regular file, unreadable, no words) or a bad length."""


class OutputPathError(GatherError, OSError):
    """An output path that cannot be written safely (missing directory, non-regular target, no space)."""


class WaitValueRefused(BackendError):
    """The driver refused a stream wait/write-value operation (no stream memory operations here): run eagerly."""


class StreamOrderError(BackendError):
    """accel.HostAccel: queued work met host state a GPU would hang on or read wrong (a wait on an unset flag, a
    copy larger than its launch)."""


class TableClosedError(GatherError, ValueError):
    """A table used after close(): a model whose per-layer embedding it served cannot run any more."""


class SizeError(GatherError, argparse.ArgumentTypeError, ValueError):
    """A size text refused (units.parse_size): one line. An argparse type's error (argparse prints it after the flag's
    name) and a ValueError for every other caller."""


class MemoryBudgetError(GatherError, ValueError):
    """An explicit budget (the row cache's) larger than the memory this process may use: one line naming the value,
    the limit and where the limit came from (io/memory.py)."""


class CapError(GatherError):
    """A memory cgroup for `bench gather --memory-limit` cannot be made or used here (benches/memcap.py)."""


class ServerExited(GatherError, RuntimeError):
    """A vLLM server (benches/vllm_server.py) exited before it answered /health: its exit status, its log, whether
    its port ever accepted a connection."""

    def __init__(self, rc: int, log: str, port_opened: bool):
        super().__init__(f"the vLLM server exited with status {rc} before it was ready:\n{log[-6000:]}")
        self.rc, self.log, self.port_opened = rc, log, port_opened


class CompileError(BackendError):
    """The compiler refused a run-time build (io/cbuild.py); `output` is what it printed (stderr)."""

    def __init__(self, message: str, output: str):
        super().__init__(message)
        self.output = output
