"""SmolLM3 against transformers on tiny random checkpoints it writes: the Llama block with no
RoPE in every fourth layer (NoPE: `no_rope_layers`, from `no_rope_layer_interval`), and with
sliding windows where its config turns them on (transformers' default then slides the NoPE
layers).

fp32 logits over a 120-token prompt and 32 greedy tokens as transformers gives them; pieces equal
one shot; left-padded rows and rows among others in the scheduler (with the prompt cache on) get
what they get alone; mlx-lm's quantized folders load and give mlx-lm's logits; its chat template's
thinking switch (enable_thinking, /think and /no_think in the system prompt) renders as
transformers renders it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine.scheduler import layer_windows
from mlxcel.errors import MlxcelError
from tests.family_fixtures import (
    BASE_SHAPE,
    GREEDY_TOKENS,
    PROMPT,
    assert_batch_rows_match_alone,
    assert_parity,
    assert_pieces_match_one_shot,
    check_parity,
    check_prefix_adoption,
    measure_parity,
    mlxcel_logits,
    reference_greedy,
    save_widened,
    schedule,
)
from tests.helpers import compose_run, write_tiny_tokenizer

pytest.importorskip("torch")

LONG_PROMPT = PROMPT * 3  # 120 tokens
SHAPE = {"head_dim": 32, "num_hidden_layers": 8, "rope_theta": 10000.0, "tie_word_embeddings": True}
SCHEDULER_PROMPTS = [LONG_PROMPT, PROMPT[5:28], PROMPT[:5], PROMPT * 2 + PROMPT[:13]]


def write_smollm3(folder: Path, seed: int = 0, **overrides) -> Path:
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(folder)
    shape = {**BASE_SHAPE, **SHAPE, "vocab_size": vocab, **overrides}
    config = transformers.SmolLM3Config(**shape, eos_token_id=2, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    save_widened(transformers.SmolLM3ForCausalLM(config), folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_smollm3(tmp_path_factory.mktemp("smollm3"))


@pytest.fixture(scope="module")
def parity(checkpoint) -> dict:
    return measure_parity(checkpoint, LONG_PROMPT)


@pytest.fixture(scope="module")
def model(parity):
    return parity["model"]


def test_matches_transformers(parity, checkpoint):
    """fp32 logits within 1e-3 over 120 tokens, 32 greedy tokens identical; layers 3 and 7 NoPE."""
    check_parity(parity)
    assert json.loads((checkpoint / "config.json").read_text())["no_rope_layers"] == [1, 1, 1, 0, 1, 1, 1, 0]
    ropes = [type(layer.self_attn.rope).__name__ for layer in parity["model"].model.layers]
    assert ropes == ["RoPE", "RoPE", "RoPE", "NoRoPE"] * 2


def test_sliding_nope_layers_match_transformers(tmp_path):
    """use_sliding_window: transformers' default layer_types slide the NoPE layers (16 here)."""
    folder = write_smollm3(tmp_path / "sliding", seed=1, use_sliding_window=True, sliding_window=16)
    result = assert_parity(folder, LONG_PROMPT)
    assert layer_windows(result["model"]) == [None, None, None, 16] * 2


def test_an_explicit_no_rope_layer_list_is_read_as_written(checkpoint, tmp_path):
    """no_rope_layers as the config lists it (here the interval would say otherwise), and refused
    when its length is not the layer count."""
    folder = write_smollm3(tmp_path / "listed", seed=2, no_rope_layers=[0, 1, 1, 1, 1, 0, 1, 1])
    result = assert_parity(folder, LONG_PROMPT)
    ropes = [type(layer.self_attn.rope).__name__ == "NoRoPE" for layer in result["model"].model.layers]
    assert ropes == [True, False, False, False, False, True, False, False]
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "no_rope_layers": [1, 1, 0]}))
    with pytest.raises(MlxcelError, match="no_rope_layers has 3 entries for num_hidden_layers=8"):
        load_model(str(folder), dtype="float32")


@pytest.mark.parametrize("piece,tile", [(1, None), (7, None), (16, 8), (50, 32)])
def test_prefill_in_pieces_equals_one_shot(model, piece, tile):
    assert_pieces_match_one_shot(model, LONG_PROMPT, piece, tile)


def test_left_padded_batch_rows_match_alone(model):
    assert_batch_rows_match_alone(model, [LONG_PROMPT, PROMPT[5:28], PROMPT[:9]])


@pytest.fixture(scope="module")
def scheduler_expected(parity) -> list[list[int]]:
    others = [reference_greedy(parity["reference"], p, GREEDY_TOKENS) for p in SCHEDULER_PROMPTS[1:]]
    return [parity["reference_greedy"], *others]


@pytest.mark.parametrize(
    "options",
    [{}, {"chunk_size": 16}, {"max_rows": 2, "chunk_size": 7}, {"ragged": True, "chunk_size": 16}],
    ids=["whole", "pieces16", "two-slots-pieces7", "ragged"],
)
def test_each_row_among_others_in_the_scheduler_draws_transformers_tokens(model, scheduler_expected, options):
    state = schedule(model, SCHEDULER_PROMPTS, **options)
    assert [r.token_ids for r in state.results] == scheduler_expected


def test_rows_sharing_a_prefix_adopt_it_and_draw_what_they_draw_alone(model):
    check_prefix_adoption(model)


def test_batch_invariant_and_kv_bits_rows_equal_alone(model):
    """runner.batch_invariant (on the CPU) and an 8-bit KV cache: each row's tokens as alone."""
    for options in ({"batch_invariant": True}, {"request": {"kv_bits": 8, "kv_group_size": 32}}):
        together = schedule(model, SCHEDULER_PROMPTS, 12, **options)
        alone = [schedule(model, [p], 12, **options).results[0].token_ids for p in SCHEDULER_PROMPTS]
        assert [r.token_ids for r in together.results] == alone, options


@pytest.mark.parametrize("prompts", [[PROMPT], [PROMPT, PROMPT[5:28], PROMPT[:9]]], ids=["batch1", "left_padded"])
def test_the_segmented_decode_step_gives_the_eager_logits(model, prompts):
    """The GPU's decode step compiled between attentions: the NoPE layers' keys stay unrotated there too."""
    from tests.test_segmented_decode import decode_both_ways

    worst, eager_ids, segmented_ids = decode_both_ways(model, prompts)
    assert worst <= 1e-4 and segmented_ids == eager_ids


def test_mlx_lm_quantized_folder_gives_mlx_lms_logits(checkpoint, tmp_path):
    """mlx_lm.convert -q (mlx-community's layout, 4-bit): our load gives mlx-lm's logits."""
    mlx_lm = pytest.importorskip("mlx_lm")
    source = tmp_path / "src"
    shutil.copytree(checkpoint, source)
    config = json.loads((source / "config.json").read_text())
    config.setdefault("rope_theta", config["rope_parameters"]["rope_theta"])  # mlx-lm 0.32 reads only this
    (source / "config.json").write_text(json.dumps(config))
    out = tmp_path / "q4"
    mlx_lm.convert(str(source), mlx_path=str(out), quantize=True, q_group_size=32, q_bits=4)
    ours, loaded = mlxcel_logits(out, LONG_PROMPT)
    assert loaded.model.model.layers[0].self_attn.qkv_proj.bits == 4
    theirs, _ = mlx_lm.load(str(out))
    np.testing.assert_allclose(ours, np.array(theirs(mx.array([LONG_PROMPT]))[0]), atol=1e-4)


def test_gguf_as_llama_cpp_writes_it_gives_the_safetensors_logits(checkpoint, parity, tmp_path):
    """SmolLM3Model converts as LlamaModel does (Q/K permuted for interleaved RoPE) and writes no
    NoPE key: llama.cpp hard-codes every fourth layer (n_no_rope_layer_step = 4), and so do we.
    transformers reads no smollm3 GGUF: the oracle is our load of the same safetensors."""
    from tests.test_families_olmo import write_converted_gguf

    path = write_converted_gguf(checkpoint, "smollm3", tmp_path / "f32.gguf")
    loaded = load_model(str(path), dtype="float32")
    assert loaded.model.args.rope_traditional and loaded.model.args.rope_layers == [True, True, True, False] * 2
    got = np.array(loaded.model(mx.array([LONG_PROMPT]), loaded.model.make_cache())[0])
    assert np.abs(got - parity["logits"]).max() <= 1e-4
    quantized = write_converted_gguf(checkpoint, "smollm3", tmp_path / "q8.gguf", quant="Q8_0")
    packed = load_model(str(quantized), dtype="float32", gguf_weights="quantized")
    dense = load_model(str(quantized), dtype="float32", gguf_weights="dequantize")
    assert packed.info["weights"] == "quantized"
    logits = [np.array(m.model(mx.array([LONG_PROMPT]), m.model.make_cache())[0]) for m in (packed, dense)]
    assert np.abs(logits[0] - logits[1]).max() <= 1e-3


# --- its chat template: a thinking switch (enable_thinking), /think and /no_think in the system prompt ---

TEMPLATE = Path(__file__).parent / "data" / "templates" / "smollm3.jinja"
XML_TOOL = {"name": "get_weather", "description": "Weather in a city", "parameters": {"city": {"type": "string"}}}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 2+2?"}],
    "no_think system": [
        {"role": "system", "content": "Be terse. /no_think"},
        {"role": "user", "content": "Capital of 日本?"},
    ],
    "think system": [{"role": "system", "content": "/think Explain."}, {"role": "user", "content": "Why?"}],
    "override": [{"role": "system", "content": "Only this. /system_override"}, {"role": "user", "content": "Hi"}],
    "multi": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "\nHi! How can I help?"},
        {"role": "user", "content": "A joke."},
        {"role": "tool", "content": "42"},
    ],
}


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize(
    "switch", [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"xml_tools": [XML_TOOL]}]
)
def test_the_real_chat_template_renders_as_transformers_renders_it(checkpoint, conversation, switch):
    """tests/data/templates/smollm3.jinja, the published template: its date (strftime_now), its
    {% generation %} blocks, namespaces, str methods and the undefined system_message when there is
    no system prompt, with and without the generation prompt, by our renderer and transformers'."""
    from mlxcel.template import TemplateSource
    from tests.helpers import load_hf_pair
    from tests.test_template_real import check_renders_like_transformers

    ours, reference = load_hf_pair(str(checkpoint))
    source = TemplateSource(TEMPLATE.read_text(encoding="utf-8"), TEMPLATE.name)
    rendered, _ = check_renders_like_transformers(ours, reference, source, CONVERSATIONS[conversation], **switch)
    thinking = (
        switch.get("enable_thinking", True) and conversation != "no_think system" or conversation == "think system"
    )
    if conversation != "override":
        assert ("Reasoning Mode: /think\n" in rendered) is thinking
    assert rendered.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n"))


def test_template_kwargs_turn_thinking_off_through_the_pipeline(checkpoint, tmp_path):
    """template.kwargs.enable_thinking=false reaches the template: the prompt says /no_think and
    opens the assistant turn with an empty think block; without it the template thinks."""
    from mlxcel import load_generator

    folder = tmp_path / "smollm3"
    shutil.copytree(checkpoint, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    texts = {}
    for name, extra in (("default", []), ("off", ["+template.kwargs.enable_thinking=false"])):
        generator = load_generator(
            {"model": {"path": str(folder)}}, overrides=["model.dtype=float32", "model.max_context=2048", *extra]
        )
        (prepared,) = generator.prepare(["What is 2+2?"], None, None)
        assert prepared.error is None, prepared.error
        texts[name] = prepared.prompt.text
    assert "Reasoning Mode: /think\n" in texts["default"] and texts["default"].endswith("<|im_start|>assistant\n")
    assert "Reasoning Mode: /no_think\n" in texts["off"]
    assert texts["off"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n")


def test_preset_names_the_family_and_requires_a_path(tmp_path):
    from mlxcel.checkpoints.loader import list_supported_families
    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.path: required"):
        validate_config(compose_run(["model=smollm3"]))
    model = validate_config(compose_run(["model=smollm3", f"model.path={tmp_path}"])).model
    assert model.families == ["smollm3"] and "smollm3" in list_supported_families()
    assert "HuggingFaceTB/SmolLM3-3B" in model.hub_ids
