"""The transformers integration's refusals and descriptions on a tiny Gemma 4 (the rows checked against the model's
own weight): a model without per-layer embeddings, a second offload, a handle's use()/release() misuse, a model not
loaded from a directory, from_pretrained with verify_rows=0 (said in the log), run_hf_prefill's argument checks; and
its resolution branches: a checkpoint found in the local Hugging Face cache by hub id, a config no causal-LM class
maps, a model directory without a safetensors checkpoint, the prefill's HF tokenizer wrapper against the tokenizers
library's own encoding, the model classes, shared and meta-device weights."""
from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from gds_gather.integrations import transformers as hf  # noqa: E402
from gds_gather.benches import hf_ab  # noqa: E402
from gds_gather.benches.tiny import tiny  # noqa: E402
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
        # auto: direct
        assert repr(h) == f"OffloadHandle({str(h.table.path)!r}, F32, freed=0, rows_read=3, backend=direct)"
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
    from gds_gather.integrations.convert import convert
    gguf = tmp_path / "t.gguf"
    convert(ckpt, gguf, progress=False)
    with caplog.at_level(logging.WARNING, logger="gds_gather.integrations.transformers"):
        model = hf.from_pretrained(ckpt, table=gguf, verify_rows=0, dtype=torch.float32)
    assert f"{gguf}: table not checked against the checkpoint (verify_rows=0)" in caplog.text
    ref = _load(ckpt)
    ids = torch.tensor([[1, 2, 500, 2]])
    want = ref.get_per_layer_input_embeddings().weight.detach()[ids]
    assert torch.equal(model.get_per_layer_input_embeddings().rows(ids), want)
    model.gds_gather.close()


def test_run_hf_prefill_checks_its_arguments(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        hf_ab.run_hf_prefill(tmp_path / "nope")
    with pytest.raises(ValueError, match="--ubatch and the repeat count must be > 0 and --generate >= 0, got 0, 5, 0"):
        hf_ab.run_hf_prefill(ckpt, ubatch=0)


def _same_class_and_rows(ref, model, ids):
    """from_pretrained's model is of ref's class and its disk rows are ref's own weight's; then it is closed."""
    try:
        assert type(model) is type(ref)
        want = ref.get_per_layer_input_embeddings().weight.detach()[ids]
        assert torch.equal(model.get_per_layer_input_embeddings().rows(ids), want)
    finally:
        model.gds_gather.close()


def test_checkpoint_path_of_a_hub_id_comes_from_the_local_cache(tmp_path):
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--someone--tiny-gemma"
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    assert hf.checkpoint_path("someone/tiny-gemma", cache_dir=tmp_path) is None      # nothing cached yet
    (snap / "model.safetensors").write_bytes(b"\0" * 8)
    assert hf.checkpoint_path("someone/tiny-gemma", cache_dir=tmp_path) == snap / "model.safetensors"
    (snap / "model.safetensors.index.json").write_text("{}")                         # the index wins
    assert hf.checkpoint_path("someone/tiny-gemma", cache_dir=tmp_path) == snap / "model.safetensors.index.json"


def test_a_config_no_causal_lm_class_maps_is_refused(tmp_path):
    transformers.ViTConfig().save_pretrained(tmp_path)       # a vision encoder: no causal-LM class
    with pytest.raises(ModelMismatchError, match=rf"^{tmp_path}: AutoModelForCausalLM has no model class for "
                                                 r"ViTConfig; pass model_class=$"):
        hf.from_pretrained(tmp_path)
    with pytest.raises(ModelMismatchError, match=rf"^{tmp_path}: AutoModelForCausalLM has no model class for "):
        hf.from_pretrained(tmp_path, model_class=transformers.AutoModelForCausalLM)
    # an Auto class without a public mapping: its from_config on the meta device refuses the config
    with pytest.raises(ModelMismatchError, match=rf"^{tmp_path}: AutoModelForTextToWaveform has no model class for "
                                                 r"ViTConfig; pass model_class=$"):
        hf.from_pretrained(tmp_path, model_class=transformers.AutoModelForTextToWaveform)


def test_a_model_directory_without_safetensors_needs_a_table(ckpt, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    out = tmp_path / "bin-only"
    out.mkdir()
    model.config.save_pretrained(out)
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    assert not list(out.glob("*.safetensors*"))
    with pytest.raises(ModelMismatchError, match=rf"^{out}: no safetensors checkpoint found to read the table from: "
                                                 r"pass table=$"):
        hf.from_pretrained(out, dtype=torch.float32)


def test_prefill_tokenizer_encodes_as_the_tokenizers_library(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    assert hf_ab.hf_tokenizer(tmp_path) is None                        # no tokenizer files: none
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(tmp_path)
    tok = hf_ab.hf_tokenizer(tmp_path)
    got = tok.encode("the cat sat on the mat")
    assert got.dtype.name == "int64"
    assert got.tolist() == raw.encode("the cat sat on the mat").ids == [1, 2, 3, 0, 1, 0]


def test_a_concrete_model_class_is_used_as_given(ckpt):
    ref = _load(ckpt)
    cls = type(ref)
    model = hf.from_pretrained(ckpt, model_class=cls, dtype=torch.float32)
    _same_class_and_rows(ref, model, torch.tensor([[0, 7, 511, 7]]))


def test_per_layer_embedding_of_another_kind_than_asked(ckpt):
    model = _load(ckpt)
    kind = type(model.get_per_layer_input_embeddings()).__name__
    with pytest.raises(ModelMismatchError, match=rf"'s per-layer embedding is a {kind}, not DiskEmbedding$"):
        hf.per_layer_embedding(model, hf.DiskEmbedding)


def test_another_auto_class_maps_through_its_own_mapping(ckpt):
    ref = transformers.AutoModel.from_pretrained(ckpt, dtype=torch.float32).eval()
    model = hf.from_pretrained(ckpt, model_class=transformers.AutoModel, dtype=torch.float32)
    _same_class_and_rows(ref, model, torch.tensor([[3, 500]]))


def test_a_model_whose_config_disagrees_with_its_own_embedding(ckpt):
    model = _load(ckpt)
    _, cfg = hf.per_layer_embedding(model)
    cfg.hidden_size_per_layer_input = 8                  # the module is [512, 2 x 16]
    with pytest.raises(ModelMismatchError, match=r"^the model's per-layer embedding is \[512, 32\], its config says "
                                                 r"\[512, 2 x 8\]$"):
        hf.offload_per_layer_embeddings(model, source=ckpt)
    assert isinstance(model.get_per_layer_input_embeddings(), torch.nn.Embedding)     # left as it was


def test_offload_without_verification_checks_no_rows(ckpt):
    model = _load(ckpt)
    want = model.get_per_layer_input_embeddings().weight.detach().clone()
    with hf.offload_per_layer_embeddings(model, source=ckpt, verify_rows=0) as h:
        assert h.verified_rows == 0
        assert h.max_abs_error != h.max_abs_error and h.rms_error != h.rms_error       # NaN: nothing measured
        ids = torch.tensor([[9, 0, 511]])
        assert torch.equal(model.get_per_layer_input_embeddings().rows(ids), want[ids])
    model2 = _load(ckpt)
    with hf.offload_per_layer_embeddings(model2, source=ckpt, verify_rows=8) as h2:
        assert h2.verified_rows >= 2 and h2.max_abs_error == 0.0                        # the same checkpoint


def test_a_weight_shared_with_another_parameter_is_not_freed(ckpt, caplog):
    import logging
    model = _load(ckpt)
    w = model.get_per_layer_input_embeddings().weight
    model.register_parameter("gds_test_view", torch.nn.Parameter(w.detach()[:1], requires_grad=False))
    want = w.detach().clone()
    with caplog.at_level(logging.WARNING, logger="gds_gather.integrations.disk_embedding"):
        h = hf.offload_per_layer_embeddings(model, source=ckpt)
    try:
        assert "per-layer embedding weight is shared with another parameter: not freed" in caplog.text
        assert h.bytes_freed == 0
        assert torch.equal(model.gds_test_view, want[:1])                   # the other parameter is intact
        ids = torch.tensor([[4, 2]])
        assert torch.equal(model.get_per_layer_input_embeddings().rows(ids), want[ids])
    finally:
        h.close()


def test_a_model_built_on_the_meta_device_gets_its_rows_from_disk(ckpt):
    cfg = transformers.AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert model.get_per_layer_input_embeddings().weight.device.type == "meta"
    ref = _load(ckpt).get_per_layer_input_embeddings().weight.detach()
    with hf.offload_per_layer_embeddings(model, source=ckpt) as h:
        assert h.bytes_freed == 0 and h.verified_rows == 0        # no weight to free, none to compare with
        ids = torch.tensor([[1, 510, 1]])
        assert torch.equal(model.get_per_layer_input_embeddings().rows(ids), ref[ids])


def test_config_is_transformers_and_gg_config_is_gds_gathers(ckpt):
    """Every keyword goes to transformers, config= too (a model config the caller changed); gds_gather's own Config
    is gg_config=; gds_gather's Config given as config= is refused, naming gg_config."""
    from gds_gather.config import Config
    cfg = transformers.AutoConfig.from_pretrained(ckpt)
    cfg.use_cache = False                   # a change transformers keeps on the model, not in the weights
    model = hf.from_pretrained(ckpt, config=cfg, gg_config=Config(cache_bytes=0), dtype=torch.float32)
    try:
        assert model.config.use_cache is False
        assert model.gds_gather.table.config.cache_bytes == 0
    finally:
        model.gds_gather.close()
    _same_class_and_rows(_load(ckpt), hf.from_pretrained(ckpt, config=cfg, dtype=torch.float32),
                         torch.tensor([[1, 2, 3]]))
    with pytest.raises(TypeError, match="gg_config="):
        hf.from_pretrained(ckpt, config=Config(cache_bytes=0))
