"""hf.py's refusals and descriptions on a tiny Gemma 4 (the rows checked against the model's own weight): a model
without per-layer embeddings, a second offload, a handle's use()/release() misuse, a model not loaded from a
directory, from_pretrained with verify_rows=0 (said in the log), and run_hf_prefill's argument checks."""
from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from gds_gather import hf  # noqa: E402
from gds_gather.benches.vllm_ab import tiny  # noqa: E402
from gds_gather.errors import ModelMismatchError  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny("gemma4", tmp_path_factory.mktemp("g4"), vocab=512, n_layer=2, per_layer=16)


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_model_without_per_layer_embeddings():
    class NoPle(torch.nn.Module):
        def get_per_layer_input_embeddings(self):
            raise NotImplementedError
    with pytest.raises(ModelMismatchError, match="NoPle has no per-layer embeddings"):
        hf.offload_per_layer_embeddings(NoPle())


def test_handle_and_module_describe_themselves(ckpt):
    model = _load(ckpt)
    want = model.get_per_layer_input_embeddings().weight.detach().clone()
    with hf.offload_per_layer_embeddings(model, keep_original=True) as h:
        m = model.get_per_layer_input_embeddings()
        assert isinstance(m, hf.DiskEmbedding)
        ids = torch.tensor([[0, 511, 3]])
        assert torch.equal(m.rows(ids), want[ids])
        assert h.rows_read == 3 and h.bytes_freed == 0          # keep_original: nothing freed yet
        assert repr(h) == f"OffloadHandle({str(h.table.path)!r}, F32, freed=0, rows_read=3, backend=direct)"  # auto: direct
        assert f"512, 32, table={str(h.table.path)!r} (F32), dtype=torch.float32, backend=auto" in repr(m)
        with pytest.raises(ModelMismatchError, match="already on disk"):
            hf.offload_per_layer_embeddings(model)
        with pytest.raises(ValueError, match="use\\('resident'\\) or use\\('offloaded'\\), got 'gpu'"):
            h.use("gpu")
        h.use("resident")
        assert model.get_per_layer_input_embeddings().weight.shape == (512, 32)
        h.use("offloaded")
        h.release()
        with pytest.raises(ValueError, match="the original per-layer embedding was released"):
            h.use("resident")


def test_model_not_from_a_directory(ckpt):
    cfg = transformers.AutoConfig.from_pretrained(ckpt)
    cfg._name_or_path = "google/gemma-4-E2B-it"         # a hub id, not a directory here
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ModelMismatchError, match="no table source given and the model was not loaded from a local "
                                                 r"directory \('google/gemma-4-E2B-it'\): pass source="):
        hf.offload_per_layer_embeddings(model)
    with pytest.raises(ModelMismatchError, match="sampled rows differ from the model's own .*a table of another "
                                                 "model"):
        hf.offload_per_layer_embeddings(model, source=ckpt)     # a fresh random model is not the checkpoint's


def test_from_pretrained_without_verification_says_so(ckpt, tmp_path, caplog):
    from gds_gather.convert import convert
    gguf = tmp_path / "t.gguf"
    convert(ckpt, gguf, progress=False)
    with caplog.at_level(logging.WARNING, logger="gds_gather.hf"):
        model = hf.from_pretrained(ckpt, table=gguf, verify_rows=0, dtype=torch.float32)
    assert f"{gguf}: table not checked against the checkpoint (verify_rows=0)" in caplog.text
    ref = _load(ckpt)
    ids = torch.tensor([[1, 2, 500, 2]])
    want = ref.get_per_layer_input_embeddings().weight.detach()[ids]
    assert torch.equal(model.get_per_layer_input_embeddings().rows(ids), want)
    model.gds_gather.close()


def test_run_hf_prefill_checks_its_arguments(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        hf.run_hf_prefill(tmp_path / "nope")
    with pytest.raises(ValueError, match="--ubatch and the repeat count must be > 0 and --generate >= 0, got 0, 5, 0"):
        hf.run_hf_prefill(ckpt, ubatch=0)
