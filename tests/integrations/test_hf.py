"""transformers' Gemma 4 / Gemma 3n with the PLE table on disk: the oracle is transformers' own model code.

Tiny text models are built from small configs with random weights (no download), saved with save_pretrained,
and loaded twice: one copy stays as it is (transformers' own load), the other gets offload_per_layer_embeddings
or is loaded by gds_gather.integrations.transformers.from_pretrained (without its table). Also gguf's quantizer for
the error bounds, and /proc/self/status of fresh processes for the memory a load takes.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import pathlib
import re
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants as gq  # noqa: E402

from gds_gather import BadIdsError, GatherError, TableClosedError, open_table  # noqa: E402
from gds_gather.benches.tiny import add_noise, text_model  # noqa: E402
from gds_gather.cli import main  # noqa: E402
from gds_gather.integrations.convert import convert  # noqa: E402
from gds_gather.errors import ModelMismatchError  # noqa: E402
from gds_gather.integrations.transformers import (DiskEmbedding, error_bound, from_pretrained,  # noqa: E402
                                                  offload_per_layer_embeddings, parameter_bytes)

VOCAB, N_LAYER, PER_LAYER = 384, 4, 16
PLE_NAME = "model.embed_tokens_per_layer.weight"


def _config(kind: str, **kw):
    return text_model(kind, vocab=VOCAB, n_layer=N_LAYER, per_layer=PER_LAYER, **kw)


def build(path, kind: str, dtype=torch.float32, seed: int = 0, max_shard_size=None, **kw):
    """A tiny random model saved to `path`, every parameter with noise (benches.tiny.add_noise)."""
    cls, cfg = _config(kind, **kw)
    torch.manual_seed(seed)
    model = add_noise(cls(cfg).eval(), seed + 1).to(dtype)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


def load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{(kind, dtype name): model dir}: Gemma 4 and Gemma 3n, float32 and bfloat16 checkpoints."""
    out = {}
    for kind in ("gemma4", "gemma3n"):
        for dt in (torch.float32, torch.bfloat16):
            name = str(dt).replace("torch.", "")
            out[kind, name] = build(tmp_path_factory.mktemp(f"{kind}-{name}"), kind, dt)
    return out


def _ids(seed=0, shape=(2, 24)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, shape, generator=g)
    ids[0, 0], ids[-1, -1], ids[-1, 3] = 0, VOCAB - 1, ids[0, 5]     # first and last row, a repeat
    return ids


def _check_equal(ref, model, handle, ids):
    """Logits torch.equal, greedy generate equal; counters count the lookups."""
    before = (handle.row_ids, handle.rows_read)
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    assert a.dtype == b.dtype and torch.equal(a, b)
    assert handle.row_ids - before[0] == ids.numel()
    assert handle.rows_read - before[1] == torch.unique(ids).numel()
    ga = ref.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
    gb = model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
    assert torch.equal(ga, gb)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["gemma4", "gemma3n"])
def test_offload_from_checkpoint_is_exact(models, kind, dtype):
    path = models[kind, dtype]
    ref, model = load(path), load(path)
    w = model.get_per_layer_input_embeddings().weight
    assert str(w.dtype) == f"torch.{dtype}" and tuple(w.shape) == (VOCAB, N_LAYER * PER_LAYER)
    table_bytes = w.numel() * w.element_size()
    p0 = parameter_bytes(model)
    with offload_per_layer_embeddings(model, path) as h:
        assert h.table.qtype.name == {"float32": "F32", "bfloat16": "BF16"}[dtype]
        assert h.table.name == PLE_NAME and h.table.arch == kind
        assert h.bytes_freed == table_bytes == h.table.n_bytes
        assert p0 - parameter_bytes(model) == table_bytes
        assert w.numel() == 0                    # the original storage is released
        assert h.verified_rows > 2 and h.exact and h.backend
        _check_equal(ref, model, h, _ids(1))
        assert h.stats()["rows_read"] == h.rows_read > 0


def test_offload_from_converted_gguf_is_exact(models, tmp_path, capsys):
    for (kind, dtype), path in models.items():
        out = tmp_path / f"{kind}-{dtype}.gguf"
        res = convert(path, out, progress=False)
        assert res["exact"] and res["max_abs_error"] == 0 and res["qtype"] == {"float32": "F32",
                                                                                "bfloat16": "BF16"}[dtype]
        with open_table(out) as t:                # llama.cpp's name and metadata
            assert (t.name, t.arch, t.n_rows, t.row_elems) == ("per_layer_token_embd.weight", kind, VOCAB,
                                                                N_LAYER * PER_LAYER)
            assert t.field(f"{kind}.block_count") == N_LAYER
            assert t.field(f"{kind}.embedding_length_per_layer_input") == PER_LAYER
        ref, model = load(path), load(path)
        with offload_per_layer_embeddings(model, out) as h:
            _check_equal(ref, model, h, _ids(2))
    assert main(["info", str(out)]) == 0
    assert "copied from" in capsys.readouterr().out


def test_quantized_table_within_tolerance(models, tmp_path, capsys):
    """Q8_0 rows: the per-layer embedding output is within the recorded max error x the embed scale, and the
    logits within 0.25 x their standard deviation of the exact model's. Measured on these random tiny models
    (3 prompts): max |logit error| 0.021-0.074 on Gemma 4 (std 0.43), 0.001-0.002 on Gemma 3n; Q4_0 gives
    0.35-0.53 on Gemma 4, about 1.2 x std."""
    path = models["gemma4", "float32"]
    out = tmp_path / "q8.gguf"
    res = convert(path, out, "Q8_0", progress=False)
    assert res["row_bytes"] == N_LAYER * PER_LAYER // 32 * 34 and not res["exact"]
    src = load(path).get_per_layer_input_embeddings().weight.detach().numpy()
    from gguf import GGUFReader
    from gguf import quants as gq
    r = GGUFReader(str(out))
    t = r.tensors[0]
    deq = gq.dequantize(np.asarray(t.data), t.tensor_type).reshape(VOCAB, -1)
    assert res["max_abs_error"] == pytest.approx(float(np.abs(deq - src).max()), rel=1e-6)
    assert 0 < res["max_abs_error"] < 1e-3
    assert main(["info", str(out)]) == 0
    assert "max |error|" in capsys.readouterr().out
    for kind in ("gemma4", "gemma3n"):
        path = models[kind, "float32"]
        out = tmp_path / f"{kind}-q8.gguf"
        convert(path, out, "q8_0", progress=False)
        ref, model = load(path), load(path)
        with pytest.raises(ModelMismatchError, match="allow_quantized"):
            offload_per_layer_embeddings(model, out)
        with offload_per_layer_embeddings(model, out, allow_quantized=True) as h:
            assert not h.exact and 0 < h.max_abs_error < 1e-3
            ids = _ids(3)
            with torch.no_grad():
                pa = ref.get_per_layer_input_embeddings()(ids)
                pb = model.get_per_layer_input_embeddings()(ids)
                la, lb = ref(ids).logits, model(ids).logits
            scale = PER_LAYER ** 0.5
            assert (float((pa - pb).abs().max())
                    <= h.table.field("gds_gather.integrations.convert.max_abs_error") * scale * 1.0001)
            assert not torch.equal(la, lb)       # the table reaches the logits: this test can fail
            torch.testing.assert_close(lb, la, rtol=0, atol=0.25 * float(la.std()))


def test_convert_streams_in_chunks(models, tmp_path):
    """Small chunks (3 rows) give the same bytes as gguf's quantizer on the whole table, and the whole-table error."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf import quants as gq
    from gds_gather import RowWidthError
    path = models["gemma3n", "bfloat16"]
    src = load(path).get_per_layer_input_embeddings().weight.detach().float().numpy()
    for qtype in ("Q4_0", "Q5_1", "F16"):
        out = tmp_path / f"{qtype}.gguf"
        res = convert(path, out, qtype, progress=False, chunk_bytes=3 * N_LAYER * PER_LAYER * 4)
        t = GGUFReader(str(out)).tensors[0]
        qt = GGMLQuantizationType[qtype]
        want = gq.quantize(src, qt)
        assert np.asarray(t.data).tobytes() == want.tobytes()
        err = np.abs(gq.dequantize(want.view(np.uint8).reshape(VOCAB, -1), qt).reshape(VOCAB, -1) - src)
        assert res["max_abs_error"] == pytest.approx(float(err.max()), rel=1e-6)
        assert res["rms_error"] == pytest.approx(float(np.sqrt(np.mean(err.astype(np.float64) ** 2))), rel=1e-6)
    with pytest.raises(RowWidthError):            # 64-wide rows are not whole 256-element TQ1_0 blocks
        convert(path, tmp_path / "tq.gguf", "TQ1_0", progress=False)
    assert not (tmp_path / "tq.gguf").exists()


def test_sharded_checkpoint(tmp_path):
    path = build(tmp_path / "sharded", "gemma4", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    ref, model = load(path), load(path)
    with offload_per_layer_embeddings(model) as h:     # source: the directory the model was loaded from
        assert h.table.path.parent == path and h.table.path.name != "model.safetensors"
        _check_equal(ref, model, h, _ids(4))


def test_multimodal_gemma4(tmp_path):
    """Gemma4ForConditionalGeneration keeps the table as model.language_model.embed_tokens_per_layer."""
    _, text = _config("gemma4")
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    mm = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision, audio_config=None)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in mm.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    mm.save_pretrained(tmp_path)
    cls = transformers.Gemma4ForConditionalGeneration
    ref, model = (cls.from_pretrained(tmp_path, dtype="auto").eval() for _ in range(2))
    with offload_per_layer_embeddings(model, tmp_path) as h:
        assert h.table.name == "model.language_model.embed_tokens_per_layer.weight" and h.table.arch == "gemma4"
        ids = _ids(9)
        with torch.no_grad():
            assert torch.equal(ref(input_ids=ids).logits, model(input_ids=ids).logits)
        assert h.rows_read == torch.unique(ids).numel()


def test_padded_gemma3n_gguf(models, tmp_path):
    """llama.cpp pads Gemma 3n's table (262,144 -> 262,400 rows): accepted, ids past the vocabulary refused."""
    from gguf import GGUFWriter
    path = models["gemma3n", "float32"]
    w = load(path).get_per_layer_input_embeddings().weight.detach().numpy()
    out = tmp_path / "padded.gguf"
    gw = GGUFWriter(str(out), "gemma3n")
    gw.add_tensor("per_layer_token_embd.weight", np.concatenate([w, np.zeros((16, w.shape[1]), np.float32)]))
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()
    ref, model = load(path), load(path)
    with offload_per_layer_embeddings(model, out) as h:
        assert h.table.n_rows == VOCAB + 16
        _check_equal(ref, model, h, _ids(8))
        with pytest.raises(BadIdsError, match=f"out of range \\[0, {VOCAB}\\)"):
            model.get_per_layer_input_embeddings()(torch.tensor([[3, VOCAB + 2]]))


def test_mismatches_are_clear(models, tmp_path):
    path = models["gemma4", "float32"]
    # a model without per-layer embeddings
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ModelMismatchError, match="no per-layer embeddings"):
        offload_per_layer_embeddings(llama, path)
    # another vocabulary, another row width, other rows of the same shape
    other_vocab = build(tmp_path / "v", "gemma4", vocab_size=256, vocab_size_per_layer_input=256)
    other_width = build(tmp_path / "w", "gemma4", hidden_size_per_layer_input=8)
    other_rows = build(tmp_path / "r", "gemma4", seed=7)
    for src, match in ((other_vocab, "rows, but the model's vocab_size_per_layer_input"),
                       (other_width, "num_hidden_layers x hidden_size_per_layer_input"),
                       (other_rows, "sampled rows differ")):
        model = load(path)
        with pytest.raises(ModelMismatchError, match=match):
            offload_per_layer_embeddings(model, src)
        assert model.get_per_layer_input_embeddings().weight.numel() > 0     # untouched on error
    # the bf16 copy's table on the float32 model: an exact type (a widening) whose rows are not these: refused
    model = load(path)
    with pytest.raises(ModelMismatchError, match="BF16 rows must equal the model's torch.float32 rows"):
        offload_per_layer_embeddings(model, models["gemma4", "bfloat16"])
    # a narrower float table than the weights (F16 for bfloat16): lossy, refused unless allowed, then bounded
    bf = load(models["gemma4", "bfloat16"])
    f16 = tmp_path / "f16.gguf"
    convert(models["gemma4", "bfloat16"], f16, "F16", progress=False)
    with pytest.raises(ModelMismatchError, match="F16 table cannot give the model's torch.bfloat16 rows exactly"):
        offload_per_layer_embeddings(bf, f16)
    with offload_per_layer_embeddings(bf, f16, allow_quantized=True) as h:
        assert h.verified_rows > 2 and h.max_abs_error >= 0
    # already offloaded; ids out of range; a closed table
    with offload_per_layer_embeddings(model, path):
        with pytest.raises(ModelMismatchError, match="already on disk"):
            offload_per_layer_embeddings(model, path)
        with pytest.raises(BadIdsError):
            model.get_per_layer_input_embeddings()(torch.tensor([[1, VOCAB]]))
    with pytest.raises(TableClosedError, match="was closed .* load it again"):
        model.get_per_layer_input_embeddings()(torch.tensor([[1, 2]]))
    assert issubclass(ModelMismatchError, GatherError)


def test_gemma_math_matches_transformers(models):
    """model/gemma.py's per-layer inputs (written from llama.cpp's graph) vs transformers' get_per_layer_inputs +
    project_per_layer_inputs on the same weights: equal in float32; within bfloat16 rounding in bfloat16
    (transformers rounds the projection, norm and sum to bfloat16 in between, gemma.py keeps float32)."""
    from gds_gather.model.gemma import per_layer_inputs
    for (kind, dtype), path in models.items():
        m = load(path).model
        cfg = m.config
        ids = _ids(5, (1, 40))
        with torch.no_grad():
            emb = m.embed_tokens(ids)
            rows_t = m.get_per_layer_inputs(ids, emb) if kind == "gemma4" else m.get_per_layer_inputs(ids)
            ref = m.project_per_layer_inputs(emb, rows_t)[0].permute(1, 0, 2)          # [L, T, P]
            ours = per_layer_inputs(m.embed_tokens_per_layer.weight[ids[0]], emb[0],
                                    m.per_layer_model_projection.weight, m.per_layer_projection_norm.weight,
                                    n_layer=cfg.num_hidden_layers, n_embd_per_layer=cfg.hidden_size_per_layer_input,
                                    eps=cfg.rms_norm_eps)
        assert ours.dtype == ref.dtype and ours.shape == ref.shape
        if dtype == "float32":
            assert torch.equal(ours, ref.contiguous()), kind
        else:
            torch.testing.assert_close(ours.float(), ref.float(), rtol=2 ** -6, atol=2 ** -5)
            assert not torch.equal(ours, ref.contiguous())     # the bf16 intermediates do differ


def test_cli_prefill_hf(models, tmp_path, capsys):
    path = models["gemma3n", "bfloat16"]
    assert main(["prefill", "--hf", str(path), "--tokens", "96", "--ubatch", "32", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    w = N_LAYER * PER_LAYER * VOCAB * 2
    assert res["logits_equal"] and res["bytes_freed"] == w
    assert res["parameter_bytes_before"] - res["parameter_bytes_after"] == w
    assert res["row_ids_per_run"] == 96 and 0 < res["rows_read_per_run"] <= 96
    assert res["tok_per_s_resident"] > 0 and res["tok_per_s_offloaded"] > 0 and res["backend"]
    assert 0 < res["ple_seconds_offloaded"] < min(res["seconds_offloaded"])
    gguf = tmp_path / "t.gguf"
    assert main(["convert", str(path), "-o", str(gguf), "-q"]) == 0
    capsys.readouterr()
    assert main(["prefill", "--hf", str(path), "--table", str(gguf), "--tokens", "40", "--ubatch", "16"]) == 0
    out = capsys.readouterr().out
    assert "last token: equal" in out and f"{w:,} B freed" in out and "tok/s" in out and "PLE step" in out
    assert main(["convert", str(path), "-o", str(tmp_path / "k.gguf"), "--qtype", "Q6_K"]) == 2
    assert "no quantizer for Q6_K" in capsys.readouterr().err
    # at least 5 rounds, medians with their spread, a ratio only where the spread allows; --generate both ways
    assert main(["prefill", "--hf", str(path), "--tokens", "48", "--ubatch", "16", "--generate", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["repeat"] >= 5 and len(res["seconds_offloaded"]) == res["repeat"]
    for k in ("resident", "offloaded"):
        v = res[f"seconds_{k}"]
        assert res[f"spread_{k}"] == pytest.approx((max(v) - min(v)) / float(np.median(v)))
    assert res["noisy"] == (max(res["spread_resident"], res["spread_offloaded"]) > 0.2)
    assert (res["offloaded_vs_resident"] is None) == res["noisy"]
    assert res["generations_equal"] and res["generate"] == 3
    assert res["generate_ms_per_token_resident"] > 0 and res["generate_ms_per_token_offloaded"] > 0
    assert res["logits_equal"] and res["logits_max_abs_diff"] == 0
    # a quantized table: the size of the logits' difference, against their spread
    q8 = tmp_path / "q8.gguf"
    assert main(["convert", str(models["gemma3n", "float32"]), "-o", str(q8), "--qtype", "Q8_0", "-q"]) == 0
    capsys.readouterr()
    assert main(["prefill", "--hf", str(models["gemma3n", "float32"]), "--table", str(q8), "--tokens", "32",
                 "--ubatch", "16"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"max \|diff\| ([0-9.e-]+) = ([0-9.]+)% of the logits' std", out)
    assert m and float(m.group(1)) > 0 and 0 < float(m.group(2)) < 25, out
    assert ("ratio     none: a spread above 20%" in out) != ("ratio     offloaded" in out)
    assert main(["prefill", "--generate", "3"]) == 2


@pytest.mark.gpu
def test_offload_on_cuda_ids(models, tmp_path):
    for (kind, dtype), path in models.items():
        gguf = tmp_path / f"{kind}-{dtype}.gguf"
        convert(path, gguf, progress=False)
        for src in (path, gguf):
            ref, model = load(path).to("cuda"), load(path).to("cuda")
            with offload_per_layer_embeddings(model, src) as h:
                ids = _ids(6).to("cuda")
                _check_equal(ref, model, h, ids)
                assert h.device_backend is not None
                out = model.get_per_layer_input_embeddings()(ids)
                assert out.device == ids.device and out.dtype == getattr(torch, dtype)


# ---- gds_gather.integrations.transformers.from_pretrained ------------------------------------------------------------

REPO = pathlib.Path(__file__).resolve().parents[2]
PLE_KEY = "model.embed_tokens_per_layer.weight"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_hf", REPO / "bench" / "bench_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _same(ref, model, ids):
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    assert a.dtype == b.dtype and torch.equal(a, b)
    ga = ref.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
    gb = model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
    assert torch.equal(ga, gb)


def _plain(path, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kw).eval()


@pytest.mark.parametrize("load_dtype", ["auto", "float32", "bfloat16"])
@pytest.mark.parametrize("ckpt_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["gemma4", "gemma3n"])
def test_from_pretrained_exact(models, kind, ckpt_dtype, load_dtype):
    """Every load dtype transformers offers, from either checkpoint dtype: widenings (bf16 -> float32) and
    transformers' own casts (float32 -> bf16) give the unmodified model's logits and generations exactly."""
    path = models[kind, ckpt_dtype]
    dt = load_dtype if load_dtype == "auto" else getattr(torch, load_dtype)
    ref = _plain(path, dtype=dt)
    model = from_pretrained(path, dtype=dt)
    assert type(model) is type(ref)                     # the plain transformers class, not the loading subclass
    disk = model.get_per_layer_input_embeddings()
    assert isinstance(disk, DiskEmbedding) and disk.weight_dtype == ref.get_per_layer_input_embeddings().weight.dtype
    assert PLE_KEY not in model.state_dict() and not any("per_layer" in n and "embed_tokens" in n
                                                          for n, _ in model.named_parameters())
    table_bytes = ref.get_per_layer_input_embeddings().weight.numel() * disk.weight_dtype.itemsize
    assert (sum(p.numel() * p.element_size() for p in ref.parameters())
            - sum(p.numel() * p.element_size() for p in model.parameters())) == table_bytes
    h = model.gds_gather
    assert h.table.qtype.name == {"float32": "F32", "bfloat16": "BF16"}[ckpt_dtype] and h.exact
    _same(ref, model, _ids(1))
    assert h.rows_read > 0 and h.row_ids > 0
    h.close()


def test_table_from_converted_gguf_and_decode_path(models, tmp_path):
    """A `convert` GGUF as the table (checked against the checkpoint's rows); 1-token and few-token lookups (the
    plan-free path) equal the resident module's rows."""
    path = models["gemma4", "bfloat16"]
    gguf = tmp_path / "t.gguf"
    convert(path, gguf, progress=False)
    ref = _plain(path, dtype=torch.float32)
    model = from_pretrained(path, table=gguf, dtype=torch.float32)
    h = model.gds_gather
    assert h.table.path == gguf and h.verified_rows > 2 and h.exact
    _same(ref, model, _ids(2))
    a, b = ref.get_per_layer_input_embeddings(), model.get_per_layer_input_embeddings()
    b.recent.clear()
    hits = b.recent.hits
    with torch.no_grad():
        for ids in ([[5]], [[5]], [[7, 5, 7, VOCAB - 1]], [[0]]):       # misses, then row-cache hits
            t = torch.tensor(ids)
            assert torch.equal(a(t), b(t))
        assert b.recent.hits - hits == 1                                # the second [[5]]: a rows-read-lately hit
        b.recent.clear()
        assert torch.equal(a(torch.tensor([[5]])), b(torch.tensor([[5]])))
    assert h.table.stats()["rows_from_cache"] > 0
    for bad in ([[VOCAB]], [[-1]], [[3, VOCAB + 5]]):
        with pytest.raises(BadIdsError, match="out of range"):
            b(torch.tensor(bad))


def test_quantized_tables_bounded_and_wrong_model_refused(models, tmp_path):
    """A Q8_0 table of the model itself: refused without allow_quantized, accepted with it (its error within the
    Q8_0 bound); Gemma 3n's Q8_0 table of the same shape on Gemma 4 is refused whatever the flag."""
    g4, g3n = models["gemma4", "float32"], models["gemma3n", "float32"]
    own, other = tmp_path / "own-q8.gguf", tmp_path / "other-q8.gguf"
    convert(g4, own, "Q8_0", progress=False)
    convert(g3n, other, "Q8_0", progress=False)
    with pytest.raises(ModelMismatchError, match="allow_quantized"):
        from_pretrained(g4, table=own)
    model = from_pretrained(g4, table=own, allow_quantized=True)
    h = model.gds_gather
    assert not h.exact and 0 < h.max_abs_error < 1e-3 and h.verified_rows > 2
    ref = _plain(g4)
    with torch.no_grad():
        la, lb = ref(_ids(3)).logits, model(_ids(3)).logits
    assert not torch.equal(la, lb)
    torch.testing.assert_close(lb, la, rtol=0, atol=0.25 * float(la.std()))
    for allow in (False, True):
        with pytest.raises(ModelMismatchError, match="another model" if allow else "allow_quantized"):
            from_pretrained(g4, table=other, allow_quantized=allow)
        with pytest.raises(ModelMismatchError, match="another model" if allow else "allow_quantized"):
            offload_per_layer_embeddings(_plain(g4), other, allow_quantized=allow)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.F16,
                                   Q.BF16])
def test_error_bound_holds_for_gguf_quantizer(qtype):
    """error_bound vs gguf's own quantizer on rows of very different scales (outliers, a zero row, a block of tiny
    values): the table's own rows always within it, every row of another table outside it."""
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((256, 256)) * np.exp(rng.standard_normal((256, 1)))).astype(np.float32)
    x[::7, ::5] *= 10
    x[3] = 0
    x[5, :32] = 1e-6
    y = (rng.standard_normal((256, 256)) * np.exp(rng.standard_normal((256, 1)))).astype(np.float32)
    bound = error_bound(qtype, torch.from_numpy(x)).numpy()
    own = gq.dequantize(gq.quantize(x, qtype), qtype).reshape(x.shape)
    other = gq.dequantize(gq.quantize(y, qtype), qtype).reshape(x.shape)
    assert (np.abs(own.astype(np.float64) - x) <= bound).all()
    assert (np.abs(other.astype(np.float64) - x) > bound).any(axis=1).all()


def test_lifetime_and_close(models):
    path = models["gemma3n", "bfloat16"]
    ref = _plain(path)
    model = from_pretrained(path)
    table = weakref.ref(model.gds_gather.table)
    gc.collect()
    _same(ref, model, _ids(4))                   # no handle kept by the caller: still usable
    del model
    gc.collect()
    assert table() is None                       # the table went with the model
    model = from_pretrained(path)
    model.gds_gather.close()
    with pytest.raises(TableClosedError, match="was closed"):
        model(_ids(4))


def test_hub_id_through_a_fixture_cache(models, tmp_path):
    """An id resolves in a Hugging Face cache directory (laid out as huggingface_hub writes it); local_files_only
    passes through to transformers, as every other keyword (no network)."""
    src = models["gemma4", "bfloat16"]
    repo = tmp_path / "hub" / "models--someone--tiny-gemma4"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in src.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    hub = dict(cache_dir=tmp_path / "hub", local_files_only=True)
    ref = _plain("someone/tiny-gemma4", **hub)
    model = from_pretrained("someone/tiny-gemma4", **hub)
    assert model.gds_gather.table.path.parent == snap
    _same(ref, model, _ids(5))
    with pytest.raises(OSError):
        from_pretrained("someone/not-in-the-cache", **hub)


def test_multimodal_model_class(tmp_path):
    _, text = _config("gemma4")
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    cls = transformers.Gemma4ForConditionalGeneration
    mm = cls(transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision, audio_config=None)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in mm.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    mm.save_pretrained(tmp_path)
    ref = cls.from_pretrained(tmp_path, dtype="auto").eval()
    model = from_pretrained(tmp_path, model_class=cls)
    assert type(model) is cls
    assert model.gds_gather.table.name == "model.language_model.embed_tokens_per_layer.weight"
    ids = _ids(9)
    with torch.no_grad():
        assert torch.equal(ref(input_ids=ids).logits, model(input_ids=ids).logits)
    # an Auto class without a public mapping: its class learnt by building it on the meta device
    pre = from_pretrained(tmp_path, model_class=transformers.AutoModelForPreTraining)
    assert type(pre) is cls
    with torch.no_grad():
        assert torch.equal(ref(input_ids=ids).logits, pre(input_ids=ids).logits)


# the real per-layer shape is 262,144 x 4 x 256; here the vocabulary is 65,536 (a 128 MiB bf16 table, 256 MiB in
# float32): the real shape takes ~12 s to write and ~35 s to measure on the development VM, too long for the suite
# (bench/bench_hf.py memory measures it); the bounds below stay unambiguous at this size (see
# docs/decisions/transformers-offload.md)
MEM_VOCAB = 65536


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return _bench().make_model(tmp_path_factory.mktemp("big"), vocab=MEM_VOCAB)


def test_load_memory_in_fresh_processes(big):
    """Peak RSS of a float32 (converting) load at most the resident load's minus 0.8 x the table's float32 size; a
    mapped bf16 load no higher than the resident model's, at load and after a forward."""
    bench = _bench()
    r = bench.run_cases(big, tokens=512, jobs=2, threads=1)     # (the logits compared bit for bit: one thread)
    f32_mib = MEM_VOCAB * N_LAYER_BIG * PER_LAYER_BIG * 4 / 2**20
    assert r["f32-offloaded"]["peak_load"] <= r["f32-resident"]["peak_load"] - 0.8 * f32_mib, r
    assert r["bf16-offloaded"]["peak_load"] <= r["bf16-resident"]["peak_load"] + 4, r        # (4 MiB: page noise)
    assert r["bf16-offloaded"]["rss_load"] <= r["bf16-resident"]["rss_load"] + 4, r
    assert r["bf16-offloaded"]["rss_forward"] <= r["bf16-resident"]["rss_forward"], r
    assert r["bf16-offloaded"]["logit0"] == r["bf16-resident"]["logit0"]
    assert r["f32-offloaded"]["logit0"] == r["f32-resident"]["logit0"]
    print(json.dumps(r))


N_LAYER_BIG, PER_LAYER_BIG = 4, 256


@pytest.mark.gpu
def test_cuda_load_memory(big):
    """device_map='cuda': max_memory_allocated after the load at most the resident load's minus 0.9 x the table."""
    def peak(load):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        m = load()
        p = torch.cuda.max_memory_allocated()
        ids = torch.randint(0, MEM_VOCAB, (1, 64), device="cuda")
        with torch.no_grad():
            out = m(ids).logits
        del m
        return p, out
    pr, a = peak(lambda: _plain(big, dtype="auto", device_map="cuda"))
    po, b = peak(lambda: from_pretrained(big, dtype="auto", device_map="cuda"))
    table = MEM_VOCAB * N_LAYER_BIG * PER_LAYER_BIG * 2
    assert po <= pr - 0.9 * table, (pr, po)
    assert torch.equal(a, b)
