"""Dequant-scatter of quantized rows on the GPU: compile, launch, and the checks of a launch's arguments.

The kernels (``kernels/dequant.cuh``, ``float8.cuh``, ``gather.cu``) read quantized rows from a staging buffer, map
each output row to its unique row through the planner's inverse map, dequantize every GGUF type gguf can
dequantize, the float8 types and packed E2M1 (quants.row_types()), at any valid width, optionally scale, and write
float32, float16 or bfloat16, either flat ``[n, row_elems]`` or in gemma's per-layer layout
``[n_layer, n, row_elems // n_layer]``. Float8 and E2M1 tables may carry block scales (BlockScales: one F32, BF16,
UE8M0 or E4M3 scale per ``sblock`` elements of a row, in a second staging buffer, each times a float32 multiplier
``smul``), applied by the scaled kernels as float32 products rounded to nearest even with subnormals kept:
``value * (scale * smul)``, vLLM's order for ModelOpt NVFP4 (E2M1 rows, E4M3 scales per 16 elements, the
per-tensor global scale as smul), before the output scale.

Compiled once per process and type (nvrtc.py: CuPy's RawModule, ``name_expressions``) from the translation unit
of tables.py (the lookup tables from gguf), launched on the caller's stream, never synchronizing. The same
source built for the host, and the numpy oracle, are host_kernels.py.

Exactness: every type follows gguf.quants' float32 operation order. Products followed by an add are exact
(fp16 scale x small integer), so FMA contraction cannot change a result, and the sources are compiled without
it anyway (NVRTC ``--fmad=false``, g++ ``-ffp-contract=off``). The products that can meet subnormals (MXFP4
with e8m0 exponent 0 or 1, the block scales, the output scale) use an explicit ``mul.rn.f32`` on the device, so
CuPy's ``-ftz=true`` (appended to every NVRTC compile) cannot flush them. float32 output therefore equals
``gguf.quants.dequantize`` (float8: the format's value, quants.fp8_lut) bit for bit, and the GPU tests compare
exactly (no ulp tolerance). float16 and bfloat16 outputs round the (scaled) float32 value to nearest even, as
numpy ``astype(float16)`` and torch ``.to(bfloat16)`` do; only NaN payloads may differ (sm_80+ conversion
instructions and ``mul.rn`` write a canonical NaN).

cupy and torch are imported lazily; nothing here imports them at module import time.
"""
from __future__ import annotations

import functools
import math
import numbers
import operator
import threading
from dataclasses import dataclass

import numpy as np

from . import arrays, nvrtc
from .tables import source, table_blob
from ..formats import quants
from ..errors import RowWidthError, UnsupportedTypeError

R = quants.RowType

OUT_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
INDEX_CTYPES = {"int32": "int", "int64": "long long"}
BLOCK = 256          # threads per CTA (GG_BLOCK in gather.cu)
ITEM = 8             # elements per thread work item
ITEMS_PER_CTA = 2048  # work per CTA when the gather is large enough to fill the GPU
LAYOUTS = ("flat", "per_layer")
SCALED_TYPES = (R.F8_E4M3, R.F8_E5M2, R.F4_E2M1)     # row types with block-scaled kernels (GG_SCALED_TYPES)
SCALE_TYPES = (R.F32, R.BF16, R.F8_E8M0, R.F8_E4M3)  # their scale element types (GG_SCALE_TYPES in gather.cu)


@dataclass(frozen=True)
class BlockScales:
    """The block scales of a scaled gather (gather_rows' ``block_scales``; a 4- or 5-tuple in this order is taken
    too).

    sstaging : uint8 array holding the scale rows, in the memory of the other arguments
    soffsets : int64 array [U]: byte offset in sstaging of unique row u's scale row (rows may share one)
    stype : the scale element type, one of SCALE_TYPES (RowType, name or id)
    sblock : elements per scale along the row; a scale row holds ceil(row_elems / sblock) scales
    smul : a real number, rounded to float32 (nearest even), that multiplies every decoded scale before the
        element does (NVFP4's per-tensor global scale); 1.0 changes no value
    """
    sstaging: object
    soffsets: object
    stype: object
    sblock: int
    smul: float = 1.0


def as_block_scales(block_scales) -> BlockScales:
    return block_scales if isinstance(block_scales, BlockScales) else BlockScales(*block_scales)


def scale_geometry(qtype, block_scales, row_elems: int) -> tuple[quants.RowType, int, int, float]:
    """(scale type, sblock, bytes per scale row, smul as a float32 value) of a scaled gather; UnsupportedTypeError,
    TypeError or ValueError otherwise."""
    qt, bs = quants.check_supported(qtype), as_block_scales(block_scales)
    if qt not in SCALED_TYPES:
        raise UnsupportedTypeError(f"block scales apply to {', '.join(t.name for t in SCALED_TYPES)} rows, "
                                   f"not {qt.name}")
    st = quants.qtype_of(bs.stype)
    if st not in SCALE_TYPES:
        raise UnsupportedTypeError(f"block scales must be {', '.join(t.name for t in SCALE_TYPES)}, got {st.name}")
    try:
        sblock = operator.index(bs.sblock)
    except TypeError:
        raise TypeError(f"block_scales.sblock must be an int, got {bs.sblock!r}") from None
    if not 1 <= sblock < 2**31:
        raise ValueError(f"block_scales.sblock must be a positive int32, got {sblock}")
    if not isinstance(bs.smul, numbers.Real):
        raise TypeError(f"block_scales.smul must be a real number, got {bs.smul!r}")
    with np.errstate(over="ignore"):            # a float beyond float32's range is inf, as torch casts it
        smul = float(np.float32(bs.smul))
    return st, sblock, -(-int(row_elems) // sblock) * quants.block_geometry(st)[1], smul


# ---- names -----------------------------------------------------------------------------------------------------
def _index_name(index_dtype) -> str:
    name = str(index_dtype).replace("torch.", "")
    if name not in INDEX_CTYPES:
        try:
            name = np.dtype(index_dtype).name
        except TypeError:
            pass
    return name


def kernel_name(qtype, dtype="float32", index_dtype="int64", scale_type=None) -> str:
    """The C++ name expression of one kernel instance, e.g. 'gg_gather<20, 1, long long>', or with a scale type
    the scaled kernel's, e.g. 'gg_gather_scaled<1000, 1002, 2, int>'."""
    qt = quants.check_supported(qtype)
    idx = _index_name(index_dtype)
    if idx not in INDEX_CTYPES:
        raise TypeError(f"inverse indices must be int32 or int64, got {index_dtype!r}")
    tail = f"{OUT_DTYPES[arrays.dtype_name(dtype)]}, {INDEX_CTYPES[idx]}>"
    if scale_type is None:
        return f"gg_gather<{int(qt)}, {tail}"
    st = scale_geometry(qt, (None, None, scale_type, 1), 1)[0]
    return f"gg_gather_scaled<{int(qt)}, {int(st)}, {tail}"


def kernel_names(qtype) -> tuple[str, ...]:
    """Every kernel instance of one type: 3 output dtypes x 2 index types, and for SCALED_TYPES as many again per
    scale type."""
    qt = quants.check_supported(qtype)
    scales = (None, *SCALE_TYPES) if qt in SCALED_TYPES else (None,)
    return tuple(kernel_name(qt, d, i, s) for s in scales for i in INDEX_CTYPES for d in OUT_DTYPES)


# ---- GPU: compile, tables, launch ----------------------------------------------------------------------------------
def _cupy():
    return nvrtc.cupy()


def module(qtype):
    """The cupy.RawModule holding the kernels of one type (nvrtc.module: compiled on first use, then cached).

    One module per type keeps a process from compiling the types it never gathers.
    """
    return nvrtc.module(source(), kernel_names(quants.check_supported(qtype)))


@functools.cache
def _kernel(qt_id: int, dtype: str, index_dtype: str, st_id: int | None = None):
    return module(qt_id).get_function(kernel_name(qt_id, dtype, index_dtype, st_id))


_dev_lock = threading.Lock()
_dev_tables: dict[int, object] = {}
_dev_sms: dict[int, int] = {}


def _device_state(device_id: int):
    """(table blob on the device, SM count), made once per device (the one-time upload is synchronous)."""
    with _dev_lock:
        tab = _dev_tables.get(device_id)
        if tab is None:
            cp = _cupy()
            with cp.cuda.Device(device_id):
                tab = cp.asarray(table_blob())
                cp.cuda.get_current_stream().synchronize()
                _dev_sms[device_id] = int(cp.cuda.Device(device_id).attributes["MultiProcessorCount"])
            _dev_tables[device_id] = tab
        return tab, _dev_sms[device_id]


def warmup(qtypes, dtypes=("float32", "float16", "bfloat16"), index_dtypes=("int32", "int64"), device=None,
           scale_types=SCALE_TYPES):
    """Compile and load the kernels of `qtypes` and upload the tables, ahead of timing or of CUDA-graph capture;
    for SCALED_TYPES also their scaled kernels of `scale_types`.

    gather_rows does all of this lazily on first use; inside a stream capture it must already be done.
    """
    cp = _cupy()
    dev = cp.cuda.Device().id if device is None else int(device)
    if isinstance(qtypes, (str, int)):
        qtypes = (qtypes,)
    with cp.cuda.Device(dev):
        _device_state(dev)
        for qt in qtypes:
            q = quants.check_supported(qt)
            scales = (None, *(int(quants.qtype_of(s)) for s in scale_types)) if q in SCALED_TYPES else (None,)
            for s in scales:
                for d in dtypes:
                    for i in index_dtypes:     # .kernel forces the compile and the module load
                        _kernel(int(q), arrays.dtype_name(d), _index_name(i), s).kernel


def _kind(x, what: str) -> str:
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        return "cupy"
    if mod == "torch":
        if x.device.type != "cuda":
            raise TypeError(f"{what} must be on a CUDA device, got a torch tensor on {x.device}")
        return "torch"
    raise TypeError(f"{what} must be a cupy array or a torch CUDA tensor, got {type(x).__name__}")


def _describe(x, what: str, host: bool = False):
    """(kind, data pointer, dtype name, shape, device id) of a cupy array / torch CUDA tensor; contiguous only.
    host=True: of HostAccel's arrays instead (numpy / host.HostArray / torch CPU tensors; device -1)."""
    if host:
        k = arrays.kind(x)
        if k == "torch":
            if not x.is_contiguous():
                raise ValueError(f"{what} must be contiguous")
            return "torch", int(x.data_ptr()), str(x.dtype).replace("torch.", ""), tuple(x.shape), -1
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{what} must be a host array or a torch CPU tensor (HostAccel), got {type(x).__name__}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous")
        return "numpy", int(x.ctypes.data), x.dtype.name, tuple(x.shape), -1
    kind = _kind(x, what)
    if kind == "cupy":
        if not x.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous")
        return kind, int(x.data.ptr), x.dtype.name, tuple(x.shape), int(x.device.id)
    if not x.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    return kind, int(x.data_ptr()), str(x.dtype).replace("torch.", ""), tuple(x.shape), int(x.device.index or 0)


def _stream_handle(stream, kind: str, device_id: int) -> int:
    if stream is None:
        if kind == "torch":
            import torch
            return int(torch.cuda.current_stream(device_id).cuda_stream)
        return int(_cupy().cuda.get_current_stream().ptr)
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    for attr in ("cuda_stream", "ptr"):     # torch.cuda.Stream / cupy.cuda.Stream
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    raise TypeError(f"stream must be a torch or cupy stream, a raw handle (int) or None, got {stream!r}")


def geometry(qtype, row_elems: int, layout: str, n_layer):
    """(type, bytes per row, elements per output segment) of a gather; RowWidthError for a width the kernels
    cannot take."""
    qt = quants.check_supported(qtype)
    row_elems = int(row_elems)
    rb = quants.row_bytes(qt, row_elems)                 # raises RowWidthError
    if row_elems >= 2**28:
        raise RowWidthError(f"row_elems={row_elems} is beyond what the kernels index (2^28)")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "flat":
        return qt, rb, row_elems
    if n_layer is None or int(n_layer) <= 0 or row_elems % int(n_layer):
        raise RowWidthError(f"per_layer layout needs n_layer > 0 dividing row_elems={row_elems}, got {n_layer!r}")
    return qt, rb, row_elems // int(n_layer)


def _out_shape(inv_shape: tuple, n: int, row_elems: int, seg: int, layout: str) -> tuple:
    if layout == "flat":
        return tuple(inv_shape) + (row_elems,)
    return (row_elems // seg, n, seg)


def output_shape(inv_shape: tuple, qtype, row_elems: int, layout: str = "flat", n_layer=None) -> tuple:
    """The shape gather_rows gives for ids of `inv_shape` (flat: inv_shape + (row_elems,); per_layer:
    (n_layer, N, row_elems // n_layer))."""
    _, _, seg = geometry(qtype, row_elems, layout, n_layer)
    return _out_shape(tuple(inv_shape), math.prod(inv_shape), int(row_elems), seg, layout)


def launch_config(n_rows: int, row_elems: int, n_sm: int) -> tuple[int, int]:
    """(grid size, rows per CTA) of one gather.

    About ITEMS_PER_CTA 8-element items per CTA, fewer when that would leave resident CTA slots empty; among
    nearby row counts, the one whose items fill the CTA's 256 threads best (the last loop round of a CTA runs
    partly idle otherwise: 1344 items of a gemma row are 5.25 rounds).
    """
    items = -(-row_elems // ITEM)
    total = n_rows * items
    min_ctas = 8 * max(1, n_sm)                          # 8 resident CTAs of 256 threads fill an SM
    large = total >= ITEMS_PER_CTA * min_ctas
    per_cta = ITEMS_PER_CTA if large else max(BLOCK, total // min_ctas)
    cap = max(1, (2**31 - 1) // items)
    target = min(max(1, per_cta // items), cap)
    best, best_fill = target, 0.0
    for rpc in range(max(1, target // 2), min(cap, 2 * target if large else target) + 1):
        work = rpc * items
        fill = work / (-(-work // BLOCK) * BLOCK)
        if fill > best_fill + 1e-12 or (abs(fill - best_fill) <= 1e-12 and abs(rpc - target) < abs(best - target)):
            best, best_fill = rpc, fill
    return -(-n_rows // best), best


def gather_rows(staging, row_offsets, inverse, qtype, row_elems, *, out=None, dtype="float32", scale=None,
                layout="flat", n_layer=None, stream=None, block_scales=None):
    """Dequantize and scatter rows on the GPU: ``out[i] = dequant(row inverse[i]) * scale``.

    Parameters
    ----------
    staging : cupy array or torch CUDA tensor, uint8, contiguous
        Bytes holding the unique quantized rows. Compact layout: unique row u at ``u * row_bytes``.
        O_DIRECT window layout: anywhere (``plan.row_staging``); no alignment is required.
    row_offsets : int64 array [U], same kind of device memory
        Byte offset of each unique row in `staging` (``arange(U) * row_bytes`` or ``plan.row_staging``).
    inverse : int32 or int64 array, any shape (N elements)
        Output row i takes unique row ``inverse.ravel()[i]`` (the planner's ``plan.inverse``).
    qtype : row type (RowType, GGML type, name or id)
        Every type ``gds_gather.formats.quants.row_types()`` lists.
    row_elems : int
        Elements per row; a positive multiple of the type's block size.
    out : array, optional
        Preallocated contiguous output of the right shape and dtype (bfloat16 in cupy: uint16 bits).
    dtype : 'float32', 'float16' or 'bfloat16' (numpy / torch dtypes accepted)
    scale : float, optional
        Multiplies every dequantized value in float32 before rounding to `dtype` (gemma: sqrt(256) = 16).
    layout : 'flat' or 'per_layer'
        flat: shape ``inverse.shape + (row_elems,)``. per_layer: ``[n_layer, N, row_elems // n_layer]`` with
        ``out[l, i, j] = row_i[l * (row_elems // n_layer) + j]`` (gemma's [n_layer, n_tokens, 256]).
    n_layer : int
        Layers of the per_layer layout.
    stream : torch.cuda.Stream, cupy.cuda.Stream, int handle, or None
        Where the kernel runs. None: torch's current stream when `inverse` is a torch tensor, else cupy's.
    block_scales : BlockScales or (sstaging, soffsets, stype, sblock[, smul]), optional
        For SCALED_TYPES rows: element j of unique row u is multiplied by ``scale * smul``, where scale is
        ``j // sblock`` of the scale row at byte ``soffsets[u]`` of `sstaging` (two float32 products, each
        rounded to nearest even with subnormals kept: the scale times smul, then the element times that), before
        `scale`. sstaging (bytes) and soffsets (int64, one per unique row) are device arrays like the others.

    Returns
    -------
    The output, of `inverse`'s kind: a torch tensor (torch.bfloat16 for bfloat16) for torch ids, else a cupy
    array (uint16 holding bfloat16 bits, since cupy has no bfloat16).

    Notes
    -----
    Asynchronous: the launch is queued on `stream` and nothing synchronizes. Inputs are read through their
    device pointers (no copies); keep them alive, or stream-ordered, until the kernel has run. Offsets and
    inverse values are not bounds-checked on the device: they must come from a plan for this staging buffer.
    First use of a type compiles its module and uploads the tables (once per process and device); call
    `warmup` before capturing a CUDA graph. Under ``torch.cuda.graph`` pass torch tensors (the output is then
    allocated from the graph's pool) and the kernel is captured on the capturing stream. An output made here is
    allocated on the kernel's stream (torch's caching allocator and cupy's pool then hand its memory to another
    array only in that stream's order).
    """
    g = check_launch(staging, row_offsets, inverse, qtype, row_elems, dtype=dtype, layout=layout, n_layer=n_layer,
                     block_scales=block_scales)
    cp = _cupy()
    tab, n_sm = _device_state(g.dev)
    handle = _stream_handle(stream, g.kind, g.dev)
    with cp.cuda.Device(g.dev), arrays.cupy_stream(handle):
        if out is None:
            if g.kind == "torch":
                out = _torch_empty(g.shape, g.name, inverse.device, handle)
            else:
                out = cp.empty(g.shape, dtype=np.uint16 if g.name == "bfloat16" else g.name)
        out_ptr = check_out(out, g)
        if g.n == 0:
            return out
        grid, rpc = launch_config(g.n, g.row_elems, n_sm)
        args = (np.uint64(g.st_ptr), np.uint64(g.off_ptr), np.uint64(g.inv_ptr), np.uint64(out_ptr), tab,
                np.int64(g.n), np.int32(g.row_elems), np.int32(g.seg), np.int32(rpc),
                np.float32(1.0 if scale is None else scale), np.int32(scale is not None))
        if g.scales is None:
            _kernel(int(g.qt), g.name, g.inv_dtype)((grid,), (BLOCK,), args)
        else:
            sst_ptr, soff_ptr, st, sblock, smul = g.scales
            _kernel(int(g.qt), g.name, g.inv_dtype, int(st))(
                (grid,), (BLOCK,), args + (np.uint64(sst_ptr), np.uint64(soff_ptr), np.int32(sblock), np.float32(smul)))
    return out


def _torch_empty(shape, name: str, device, handle: int):
    """A torch tensor allocated on the stream `handle`: torch's current stream where it is that one (as under
    graph capture, whose pool is tied to the capturing stream object), else a wrapper of the handle made current
    for the allocation."""
    import torch
    dtype = getattr(torch, name)
    if int(torch.cuda.current_stream(device).cuda_stream) == handle:
        return torch.empty(shape, dtype=dtype, device=device)
    with torch.cuda.stream(arrays.torch_stream(handle, device)):
        return torch.empty(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class Launch:
    """One gather's checked arguments (check_launch)."""
    kind: str
    st_ptr: int
    off_ptr: int
    inv_ptr: int
    inv_dtype: str
    dev: int
    qt: quants.RowType
    seg: int
    row_elems: int
    name: str
    n: int
    shape: tuple
    scales: tuple | None = None     # (sstaging pointer, soffsets pointer, scale type, sblock, smul): scaled


def check_launch(staging, row_offsets, inverse, qtype, row_elems, *, dtype="float32", layout="flat", n_layer=None,
                 block_scales=None, host: bool = False) -> Launch:
    """The checks gather_rows makes on its arguments (kinds, dtypes, one device, the type and geometry, the block
    scales), and what the launch needs; host=True for HostAccel's arrays (host.HostAccel.gather makes the same
    checks)."""
    kind, inv_ptr, inv_dtype, inv_shape, dev = _describe(inverse, "inverse", host)
    if inv_dtype not in INDEX_CTYPES:
        raise TypeError(f"inverse must be int32 or int64, got {inv_dtype}")
    _, st_ptr, st_dtype, _, st_dev = _describe(staging, "staging", host)
    _, off_ptr, off_dtype, off_shape, off_dev = _describe(row_offsets, "row_offsets", host)
    if st_dtype not in ("uint8", "int8"):
        raise TypeError(f"staging must hold bytes (uint8), got {st_dtype}")
    if off_dtype != "int64" or len(off_shape) != 1:
        raise TypeError(f"row_offsets must be a 1-D int64 array, got {off_dtype} {off_shape}")
    if {st_dev, off_dev} != {dev}:
        raise ValueError(f"staging, row_offsets and inverse must be on one device, got {st_dev}, {off_dev}, {dev}")
    qt, _, seg = geometry(qtype, row_elems, layout, n_layer)
    scales = None
    if block_scales is not None:
        st, sblock, _, smul = scale_geometry(qt, block_scales, row_elems)
        bs = as_block_scales(block_scales)
        _, sst_ptr, sst_dtype, _, sst_dev = _describe(bs.sstaging, "block_scales.sstaging", host)
        _, soff_ptr, soff_dtype, soff_shape, soff_dev = _describe(bs.soffsets, "block_scales.soffsets", host)
        if sst_dtype not in ("uint8", "int8"):
            raise TypeError(f"block_scales.sstaging must hold bytes (uint8), got {sst_dtype}")
        if soff_dtype != "int64" or tuple(soff_shape) != tuple(off_shape):
            raise TypeError(f"block_scales.soffsets must be int64 of row_offsets' shape {tuple(off_shape)}, got "
                            f"{soff_dtype} {tuple(soff_shape)}")
        if {sst_dev, soff_dev} != {dev}:
            raise ValueError(f"block_scales must be on the device of the other arguments ({dev}), got "
                             f"{sst_dev}, {soff_dev}")
        scales = (sst_ptr, soff_ptr, st, sblock, smul)
    n = math.prod(inv_shape)
    return Launch(kind, st_ptr, off_ptr, inv_ptr, inv_dtype, dev, qt, seg, int(row_elems), arrays.dtype_name(dtype),
                  n, _out_shape(inv_shape, n, int(row_elems), seg, layout), scales)


def check_out(out, g: Launch, host: bool = False) -> int:
    """out's data pointer, once it is of the launch's dtype, shape and device (ValueError otherwise)."""
    _, out_ptr, out_dtype, out_shape, out_dev = _describe(out, "out", host)
    want = {"float32": ("float32",), "float16": ("float16",), "bfloat16": ("bfloat16", "uint16")}[g.name]
    if out_dtype not in want or tuple(out_shape) != tuple(g.shape) or out_dev != g.dev:
        raise ValueError(f"out must be {g.name} of shape {g.shape} on device {g.dev}, "
                         f"got {out_dtype} {tuple(out_shape)} on {out_dev}")
    return out_ptr
