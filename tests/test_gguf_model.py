"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' GGUF loader."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.sampling import Sampler
from mlxcel.template import build_prompt, load_template_source
from mlxcel.tokenizer import load_tokenizer
from tests.helpers import find_smollm2_gguf, requires_smollm2

pytestmark = [requires_smollm2, pytest.mark.slow]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("embedded:smollm2", dtype="float32", gguf_weights="dequantize")


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    tokenizer = load_tokenizer(smollm2.path, gguf_metadata=smollm2.gguf_metadata)
    return build_prompt(tokenizer, QUESTION, load_template_source(tokenizer)).token_ids


def test_metadata_read_into_llama_args(smollm2):
    args = smollm2.model.args
    assert (args.hidden_size, args.num_hidden_layers, args.num_attention_heads, args.num_key_value_heads) == (
        576,
        30,
        9,
        3,
    )
    assert args.rope_theta == 100000.0 and args.rope_traditional and args.tie_word_embeddings
    assert smollm2.model.eos_token_ids() == [2]
    assert smollm2.info["params"] == pytest.approx(134.5e6, rel=0.01)


def test_logits_match_transformers_gguf_loader(smollm2, prompt_ids):
    """transformers dequantizes the GGUF to fp32 and undoes llama.cpp's Q/K permutation; we keep
    the permutation and use interleaved RoPE instead. Same numbers either way."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    import transformers

    path = find_smollm2_gguf()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        expected = reference(torch.tensor([prompt_ids])).logits[0].numpy()
    got = np.array(smollm2.model(mx.array([prompt_ids]), smollm2.model.make_cache())[0])
    assert np.abs(got - expected).max() <= 1e-3
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_native_quantized_weights_agree_with_dequantized(smollm2, prompt_ids):
    quantized = load_model("embedded:smollm2", dtype="float32", gguf_weights="quantized")
    assert quantized.info["weights"] == "quantized"
    assert type(quantized.model.model.layers[0].self_attn.qkv_proj).__name__ == "QuantizedLinear"  # fused at load
    ids = mx.array([prompt_ids])
    a = np.array(quantized.model(ids, quantized.model.make_cache())[0, -1])
    b = np.array(smollm2.model(ids, smollm2.model.make_cache())[0, -1])
    assert np.abs(a - b).max() < 1e-2
    assert a.argmax() == b.argmax()


def test_greedy_answer_names_paris(smollm2, prompt_ids):
    tokenizer = load_tokenizer(smollm2.path, gguf_metadata=smollm2.gguf_metadata)
    request = GenerationRequest(
        [RowRequest(prompt_ids)], Sampler("greedy"), max_tokens=20, stop_token_ids=frozenset([2])
    )
    state = DirectEngine(smollm2.model, 8192).generate(request)
    assert "Paris" in tokenizer.decode(state.results[0].token_ids)
    assert state.results[0].finish_reason == "stop"
