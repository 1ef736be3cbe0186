"""GGUF files of each supported architecture, written the way llama.cpp's converter writes them
(tensor names, metadata, Q/K permutation for llama only), from tiny HF checkpoints. Oracles:
transformers on the original checkpoint, and transformers' own GGUF loader on the written file."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.tokenizer import load_tokenizer
from tests.gguf_fixtures import PROMPT, gguf_name, permute_for_llama_cpp
from tests.helpers import load_reference

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")


def write_gguf_from_hf(folder: Path, arch: str, out: Path, quant: str = "F32") -> Path:
    config = json.loads((folder / "config.json").read_text())
    state = load_reference(folder).state_dict()
    tok = json.loads((folder / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]

    writer = gguf.GGUFWriter(str(out), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        data = tensor.numpy().astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = permute_for_llama_cpp(data, heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            data = permute_for_llama_cpp(data, kv_heads)
        if quant == "Q8_0" and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def mlxcel_logits(path: Path, gguf_weights: str) -> tuple[np.ndarray, object]:
    loaded = load_model(str(path), dtype="float32", gguf_weights=gguf_weights)
    return np.array(loaded.model(mx.array([PROMPT]), loaded.model.make_cache())[0]), loaded


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_gguf_matches_the_hf_checkpoint(arch, tiny_llama, tiny_qwen2, tmp_path):
    folder = tiny_llama if arch == "llama" else tiny_qwen2
    path = write_gguf_from_hf(folder, arch, tmp_path / f"{arch}.gguf")
    with torch.no_grad():
        expected = load_reference(folder)(torch.tensor([PROMPT])).logits[0].numpy()
    got, loaded = mlxcel_logits(path, "auto")
    assert loaded.model.args.rope_traditional is (arch == "llama")
    assert np.abs(got - expected).max() <= 1e-3
    # transformers' own GGUF reader agrees that the file says what the checkpoint says
    import transformers

    ref_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        assert np.abs(ref_gguf(torch.tensor([PROMPT])).logits[0].numpy() - expected).max() <= 1e-3
    tokenizer = load_tokenizer(path)
    assert tokenizer.eos_token_ids == [2] and tokenizer.vocab_size == loaded.model.args.vocab_size


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q8_0_gguf_loads_natively_and_matches_transformers(arch, tiny_llama, tiny_qwen2, tmp_path):
    folder = tiny_llama if arch == "llama" else tiny_qwen2
    path = write_gguf_from_hf(folder, arch, tmp_path / f"{arch}-q8.gguf", quant="Q8_0")
    quantized, loaded = mlxcel_logits(path, "quantized")
    assert type(loaded.model.model.layers[0].mlp.gate_up_proj).__name__ == "QuantizedLinear"
    dequantized, _ = mlxcel_logits(path, "dequantize")
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(dequantized - expected).max() <= 1e-3
    assert np.abs(quantized - expected).max() <= 1e-3
