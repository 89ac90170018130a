"""A checkpoint's claimed sizes are checked against its tensors (and sane bounds) before
anything is built from them: a GGUF file's metadata against its tensor table, a
config.json against its safetensors. Each hostile claim is an error naming the file,
the key, its value and what was expected, found without building per-layer structures."""
import json
import math
import shutil
import tracemalloc

import pytest

from gguf_checkpoints import write_gguf
from fusegen.engine import LLM, ModelLoadError

OPTIONS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
# The tiny Llama (conftest's llama_dir): vocabulary 448, width 64, 4 heads and 2 KV heads
# of 16, MLP 128, 2 layers.
Q_ROWS = "the rows of tensor 'blk.0.attn_q.weight'"


@pytest.fixture(scope="module")
def tiny_gguf(llama_dir, tmp_path_factory):
    return write_gguf(llama_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _gguf(llama_dir, tmp_path, **extra):
    return write_gguf(llama_dir, tmp_path / "m.gguf", extra=extra)


def _refused(path, message: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        LLM(str(path), **OPTIONS)
    assert str(info.value) == f"{path}: {message}"


def test_ten_million_layers_refused_from_the_tensor_table(llama_dir, tmp_path):
    # Before: gigabytes of per-layer names and shapes, then a bare MemoryError.
    path = _gguf(llama_dir, tmp_path, **{"llama.block_count": 10**7})
    tracemalloc.start()
    try:
        _refused(path, "GGUF metadata 'llama.block_count' is 10000000; expected 2, the layers "
                       "its tensor table holds (blk.0 to blk.1)")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20  # the header's metadata, nothing per claimed layer


def test_a_missing_layer_is_named(tiny_gguf, tmp_path):
    # blk.1's tensors renamed blk.3 (same length): two layers, but not blk.0 and blk.1
    path = tmp_path / "gap.gguf"
    path.write_bytes(tiny_gguf.read_bytes().replace(b"blk.1.", b"blk.3."))
    _refused(path, "GGUF metadata 'llama.block_count' is 2; expected layers blk.0 to blk.1, "
                   "but the tensor table has none of blk.1 (and has blk.3)")


@pytest.mark.parametrize("changes, message", [
    ({"attention.head_count": 8}, "head_count' is 8, heads of 16 (llama.attention.key_length): "
                                  f"128 rows; expected 64, {Q_ROWS}"),
    ({"attention.head_count": 10**9}, "head_count' is 1000000000, heads of 16 (llama.attention."
                                      f"key_length): 16000000000 rows; expected 64, {Q_ROWS}"),
    ({"attention.key_length": 32}, "head_count' is 4, heads of 32 (llama.attention.key_length):"
                                   f" 128 rows; expected 64, {Q_ROWS}"),
    ({"attention.head_count_kv": 1}, "head_count_kv' is 1, heads of 16 (llama.attention."
                                     "key_length): 16 rows; expected 32, the rows of tensor "
                                     "'blk.0.attn_k.weight'"),
])
def test_head_counts_against_the_projections(llama_dir, tmp_path, changes, message):
    path = _gguf(llama_dir, tmp_path, **{f"llama.{k}": v for k, v in changes.items()})
    _refused(path, f"GGUF metadata 'llama.attention.{message}")


@pytest.mark.parametrize("key, value, expected", [
    ("attention.head_count_kv", 3, "a divisor of the head count, 4"),
    ("attention.head_count_kv", [2, 2, 2], "one count per layer, 2 of them"),
    ("embedding_length", 4096, "64, the width of tensor 'token_embd.weight'"),
    ("embedding_length", 0, "a positive integer"),
    ("vocab_size", 10**9, "448, the rows of tensor 'token_embd.weight'"),
    ("feed_forward_length", 10**9, "128, the rows of tensor 'blk.0.ffn_up.weight'"),
    ("feed_forward_length", -5.0, "a positive integer"),
    ("block_count", "2", "a positive integer"),
    ("context_length", 2**25, "at most 16777216 (2^24) positions; no model in circulation "
                              "is trained on more"),
    ("rope.freq_base", math.nan, "a finite number above 0"),
    ("rope.freq_base", math.inf, "a finite number above 0"),
    ("rope.freq_base", 0.0, "a finite number above 0"),
    ("rope.freq_base", -10000.0, "a finite number above 0"),
    ("attention.layer_norm_rms_epsilon", -1.0, "a finite number at least 0"),
], ids=lambda v: str(v)[:24])
def test_hostile_metadata_named_with_what_was_expected(llama_dir, tmp_path, key, value, expected):
    path = _gguf(llama_dir, tmp_path, **{f"llama.{key}": value})
    _refused(path, f"GGUF metadata 'llama.{key}' is {value!r}; expected {expected}")


def test_vocabulary_and_embedding_must_agree(llama_dir, tmp_path):
    tokens = [f"t{i}" for i in range(100)]
    path = write_gguf(llama_dir, tmp_path / "v.gguf", drop=("llama.vocab_size",),
                      extra={"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type":
                             [1] * 100})
    _refused(path, "GGUF metadata 'tokenizer.ggml.tokens' lists 100 tokens; expected 448, "
                   "the rows of tensor 'token_embd.weight'")


def test_no_embedding_tensor(tiny_gguf, tmp_path):
    path = tmp_path / "e.gguf"
    path.write_bytes(tiny_gguf.read_bytes().replace(b"token_embd.weight", b"token_embx.weight"))
    _refused(path, "the tensor table has no 2-D 'token_embd.weight' (found None); the file is "
                   "damaged")


# -- config.json ----------------------------------------------------------------------

def _config_dir(llama_dir, tmp_path, **changes):
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | changes))
    return model


@pytest.mark.parametrize("key, value, expected", [
    ("num_hidden_layers", 10**7, "at most 10000; no model in circulation comes near it"),
    ("num_hidden_layers", 5, "2, the layers its weights hold (numbered 0 to 1)"),
    ("num_hidden_layers", 0, "a positive integer"),
    ("num_attention_heads", 0, "a positive integer"),
    ("vocab_size", -1, "a positive integer"),
    ("max_position_embeddings", 2**40, "at most 16777216; no model in circulation comes "
                                       "near it"),
    ("rope_theta", math.nan, "a finite number above 0"),
    ("rope_theta", 0.0, "a finite number above 0"),
    ("rms_norm_eps", math.inf, "a finite number at least 0"),
], ids=lambda v: str(v)[:24])
def test_hostile_config_json(llama_dir, tmp_path, key, value, expected):
    # Before: 10^7 layers built their per-layer shapes (gigabytes); 0 heads divided by
    # zero; a NaN rotary base made NaN logits.
    model = _config_dir(llama_dir, tmp_path, **{key: value})
    with pytest.raises(ModelLoadError) as info:
        LLM(str(model), **OPTIONS)
    assert str(info.value) == f"{model / 'config.json'}: {key} is {value}; expected {expected}"


def test_layers_counted_from_a_sharded_index(tmp_path):
    from checkpoints import make_hf_checkpoint

    model = make_hf_checkpoint(tmp_path / "sharded", "llama", "bpe", max_shard_size="100KB",
                               num_hidden_layers=3)
    assert (model / "model.safetensors.index.json").is_file()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 4}))
    with pytest.raises(ModelLoadError, match=r"config.json: num_hidden_layers is 4; expected "
                                             r"3, the layers its weights hold \(numbered 0 to "
                                             r"2\)$"):
        LLM(str(model), **OPTIONS)
