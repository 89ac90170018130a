"""The GGUF reader on files the tests write with the `gguf` package: every weight type
dequantizes to exactly what `gguf` itself gives, a tiny Llama converted to GGUF runs
token for token like its safetensors directory (split, streamed, quantized), and a
broken file fails with an error that says what is wrong."""
import dataclasses
import struct

import numpy as np
import pytest
import torch

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import Q, gguf, write_gguf
from fusegen.engine import LLM, ModelLoadError, SamplingParams
from fusegen.engine.memory.placement import minimum_device_budget
from fusegen.engine.weights import gguf as reader
from fusegen.engine.weights.gguf import GGUFFile, LazyTensor, load_gguf_state_dict
from fusegen.engine.weights.gguf_names import is_gguf
from fusegen.engine.weights.loader import load_state_dict

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "日本語 🎉 text",
           " leading spaces\nand a newline", "1 2 3 4 5 6 7 8 9 10"]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128)
# Types gguf can quantize into; the K types it only dequantizes get raw blocks.
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
RAW_BLOCKS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    # Six layers: few enough to be quick, enough that none fits beside two staging slots.
    return make_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", "bpe", seed=3,
                              num_hidden_layers=6, max_position_embeddings=128)


@pytest.fixture(scope="module")
def llama_gguf(llama_dir, tmp_path_factory):
    return write_gguf(llama_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def reference(llama_dir):
    with LLM(str(llama_dir), **OPTIONS) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def _raw_blocks(qtype, rows: int, rng) -> np.ndarray:
    # Random block bytes whose float16 scales are finite: every f16 field sits at an
    # even offset of its block, so clearing bit 6 of each odd byte caps its exponent.
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, 2 * block_bytes), dtype=np.uint8)
    raw[:, 1::2] &= 0xBF
    return raw


@pytest.mark.parametrize("qtype", QUANTIZABLE + RAW_BLOCKS, ids=lambda t: t.name)
def test_dequantized_values_equal_gguf(qtype, tmp_path):
    rng = np.random.default_rng(0)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype in QUANTIZABLE:
        values = rng.standard_normal((3, 2 * block)).astype(np.float32)
        data = gguf.quants.quantize(values, qtype)
    else:
        data = _raw_blocks(qtype, 3, rng)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("w", data, raw_dtype=None if qtype == Q.F32 else qtype)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    theirs = gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    want = torch.from_numpy(np.array(gguf.quants.dequantize(theirs.data, qtype)))
    file = GGUFFile.open(tmp_path / "t.gguf")
    info = file.tensors["w"]
    assert (info.qtype, info.shape) == (qtype, (3, 2 * block))
    assert torch.equal(file.read(info, torch.float32), want)
    assert torch.isfinite(want).all() and want.abs().sum() > 0
    assert torch.equal(file.read(info, torch.bfloat16), want.to(torch.bfloat16))


def test_f32_gguf_weights_equal_safetensors(llama_dir, llama_gguf):
    # llama.cpp's q/k permutation undone exactly; the tied head left out as it is there.
    file = GGUFFile.open(llama_gguf)
    cfg = reader.gguf_model_config(llama_gguf)
    assert "output.weight" in file.tensors and not cfg.tie_word_embeddings
    ours = load_gguf_state_dict(llama_gguf, cfg, torch.float32)
    theirs = load_state_dict(llama_dir, cfg)
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert isinstance(tensor, LazyTensor) and tensor.device.type == "meta"
        assert torch.equal(tensor.to("cpu"), theirs[name]), name


def test_f32_gguf_generates_like_safetensors(llama_gguf, llama_dir, reference):
    with LLM(str(llama_gguf), **OPTIONS) as llm, LLM(str(llama_dir), **OPTIONS) as hf_dir:
        # The tokenizer built from the embedded vocabulary encodes as tokenizer.json does.
        for prompt in PROMPTS:
            assert llm.tokenizer.encode(prompt) == hf_dir.tokenizer.encode(prompt), prompt
        outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)


def test_streamed_layers_from_gguf(llama_gguf, reference):
    # Every layer on the disk tier: dequantized from the file into a staging slot each step.
    with LLM(str(llama_gguf), **OPTIONS) as llm:
        smallest = minimum_device_budget(llm.placement.sizes)
    with LLM(str(llama_gguf), device_memory=smallest, host_memory=0, **OPTIONS) as llm:
        assert llm.placement.layer_tiers == ["disk"] * 6
        outs = llm.generate(PROMPTS, PARAMS)
        assert llm.memory_report()["streamed"]["loads"] == 2 + 6 * llm.stats()["num_steps"]
    assert [o.token_ids for o in outs] == reference


def test_weights_dequantized_only_when_used(llama_gguf, monkeypatch):
    reads = []
    real = GGUFFile.read
    monkeypatch.setattr(GGUFFile, "read", lambda self, info, *a: reads.append(info.name)
                        or real(self, info, *a))
    cfg = reader.gguf_model_config(llama_gguf)
    state = load_gguf_state_dict(llama_gguf, cfg, torch.float32)
    assert reads == []
    state["model.layers.1.mlp.down_proj.weight"].to("cpu")
    assert reads == ["blk.1.ffn_down.weight"]


def test_split_gguf_equals_single_file(llama_dir, tmp_path, reference):
    first = write_gguf(llama_dir, tmp_path / "tiny.gguf", split_max_tensors=20)
    parts = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert first == parts[0] and len(parts) == 3  # 57 tensors, at most 20 a file
    with LLM(str(first), **OPTIONS) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference
    with pytest.raises(ModelLoadError, match="part 2 of a split GGUF set; pass its first "
                       f"file, {parts[0]}"):
        GGUFFile.open(parts[1])
    parts[2].unlink()
    with pytest.raises(ModelLoadError, match=f"the split set's files {parts[2]} are missing"):
        GGUFFile.open(first)


def test_quantized_gguf_generates_like_transformers(llama_dir, tmp_path):
    # Q8_0 weights, read by transformers' own GGUF loader: the same tokens.
    transformers = pytest.importorskip("transformers")
    _check_transformers(transformers, write_gguf(llama_dir, tmp_path / "q8.gguf",
                                                 qtype=Q.Q8_0), PROMPTS)


@pytest.mark.parametrize("arch, tokenizer, qtype", [("qwen2", "bpe", Q.F16),
                                                    ("qwen3", "bpe", Q.Q8_0),
                                                    ("gemma3", "sentencepiece", Q.Q5_0)],
                         ids=["qwen2-F16", "qwen3-Q8_0", "gemma3-Q5_0"])
def test_architectures_equal_transformers(arch, tokenizer, qtype, tmp_path):
    # Qwen's names (q/k norms), Gemma 3's (four norms a layer, stored as 1 + w): through
    # transformers' own GGUF loader, the same tokens.
    transformers = pytest.importorskip("transformers")
    hf_dir = make_hf_checkpoint(tmp_path / "hf", arch, tokenizer, seed=5)
    path = write_gguf(hf_dir, tmp_path / f"{arch}.gguf", qtype=qtype, arch=arch,
                      tokenizer="gpt2" if tokenizer == "bpe" else "llama")
    _check_transformers(transformers, path, PROMPTS[:3])


def _check_transformers(transformers, path, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with LLM(str(path), **OPTIONS) as llm:
        outs = llm.generate(prompts, PARAMS)
        for prompt, out in zip(prompts, outs):
            ids = llm.tokenizer.encode(prompt)
            want = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
            assert out.token_ids == want, prompt


def test_is_gguf(tmp_path):
    (tmp_path / "dir.gguf").mkdir()
    assert is_gguf("m.gguf") and is_gguf("/x/M.GGUF") and not is_gguf(tmp_path / "dir.gguf")
    assert not is_gguf("org/name") and not is_gguf(tmp_path)


# -- a broken file: each error names the file and what is wrong ------------------------

def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ModelLoadError, match=r"model.gguf: not a GGUF file \(it starts "
                       r"with b'PK\\x03\\x04', a GGUF file with b'GGUF'\)"):
        LLM(str(path))
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="model.gguf: cannot read the GGUF file"):
        LLM(str(path))


def test_truncated_file(llama_gguf, tmp_path):
    data = llama_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 100])  # inside the last tensor's data
    last = max(GGUFFile.open(llama_gguf).tensors.values(), key=lambda t: t.offset)
    with pytest.raises(ModelLoadError, match=rf"cut.gguf: truncated: tensor '{last.name}' "
                       rf"ends at byte {len(data)}, past the end of the file "
                       rf"\({len(data) - 100} bytes\); download it again"):
        LLM(str(cut))
    cut.write_bytes(data[:1000])  # inside the vocabulary
    with pytest.raises(ModelLoadError, match=r"cut.gguf: truncated: the GGUF header runs "
                       r"past the end of the file \(1000 bytes\)"):
        LLM(str(cut))


def test_a_shape_whose_size_overflows_is_refused(llama_gguf, tmp_path):
    # 2^32 x 2^32 values: their count wrapped to 0 in int64, so the table passed as whole
    data = bytearray(llama_gguf.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4
    struct.pack_into("<2Q", data, at, 2**32, 2**32)
    path = tmp_path / "huge.gguf"
    path.write_bytes(bytes(data))
    start = GGUFFile.open(llama_gguf).tensors["blk.0.attn_q.weight"].offset
    with pytest.raises(ModelLoadError, match=rf"huge.gguf: truncated: tensor 'blk.0.attn_q."
                       rf"weight' ends at byte {start + 2**64 * 4}, past the end of the file"):
        LLM(str(path))


def _retype(path, tensor: str, type_id: int, out):
    # The type id sits right after the tensor's name and dims in the tensor table.
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    num_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * num_dims, type_id)
    out.write_bytes(bytes(data))
    return out


def test_unknown_and_unsupported_types(llama_gguf, tmp_path):
    path = _retype(llama_gguf, "blk.0.attn_norm.weight", 99, tmp_path / "a.gguf")
    with pytest.raises(ModelLoadError, match="a.gguf: tensor 'blk.0.attn_norm.weight' has "
                       "type id 99, which is no GGML type fusegen knows; supported: F32, "
                       "F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"):
        LLM(str(path))
    path = _retype(llama_gguf, "blk.0.attn_norm.weight", int(Q.I32), tmp_path / "b.gguf")
    with pytest.raises(ModelLoadError, match="b.gguf: tensor 'blk.0.attn_norm.weight' has "
                       "type I32, which fusegen cannot dequantize; supported: F32, F16, "):
        LLM(str(path), **OPTIONS)


def test_missing_metadata_and_unknown_architecture(llama_dir, tmp_path):
    path = write_gguf(llama_dir, tmp_path / "a.gguf", drop=("llama.block_count",))
    with pytest.raises(ModelLoadError, match="a.gguf: GGUF metadata key 'llama.block_count' "
                       "is missing"):
        LLM(str(path))
    path = write_gguf(llama_dir, tmp_path / "f.gguf", arch="falcon")
    with pytest.raises(ModelLoadError, match="f.gguf: GGUF architecture 'falcon' not "
                       "supported; fusegen reads GGUF files of llama, qwen2, qwen3, "
                       "gemma2, gemma3"):
        LLM(str(path))


def test_tensors_not_matching_the_metadata(llama_dir, llama_gguf, tmp_path):
    # The sizes are checked against layer 0's tensors before anything is built
    # (tests/test_checkpoint_metadata.py has the rest)...
    path = write_gguf(llama_dir, tmp_path / "a.gguf", extra={"llama.feed_forward_length": 64})
    with pytest.raises(ModelLoadError, match="a.gguf: GGUF metadata 'llama.feed_forward_length' "
                       "is 64; expected 128, the rows of tensor 'blk.0.ffn_up.weight'"):
        LLM(str(path), **OPTIONS)
    # ...and every tensor's shape at load, against the config it is read with.
    cfg = dataclasses.replace(reader.gguf_model_config(llama_gguf), intermediate_size=64)
    with pytest.raises(ModelLoadError, match=r"tiny.gguf: tensor 'blk.0.ffn_gate.weight' has "
                       r"shape \(128, 64\), but the metadata implies \(64, 64\)"):
        load_gguf_state_dict(llama_gguf, cfg, torch.float32)
