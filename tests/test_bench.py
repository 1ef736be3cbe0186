"""The side-by-side benchmark (python -m mlxcel.bench) on a tiny checkpoint.

The tests that run mlx-lm skip without it: it is the `bench` extra, which CI does not install
(`.[cpu,test]`), so on CI only the tests that need no mlx-lm run.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.bench import __main__ as bench_cli
from mlxcel.bench.checkpoints import (
    HYBRID_TYPES,
    RANDOM_SHAPES,
    build_random_checkpoint,
    list_gemma4_layer_types,
    list_hybrid_layer_types,
    list_weight_shapes,
    prepare_checkpoint,
    unpermute_from_llama_cpp,
)
from mlxcel.bench.harness import (
    METRICS,
    bench_model,
    compare_token_ids,
    format_agreement,
    format_table,
    make_table_rows,
)
from tests.helpers import requires_smollm2

requires_mlx_lm = pytest.mark.skipif(
    importlib.util.find_spec("mlx_lm") is None,
    reason="needs mlx-lm, the bench extra (not installed on CI): pip install -e '.[bench]'",
)
HYBRID_SHAPES = [name for name, shape in RANDOM_SHAPES.items() if shape["model_type"] in HYBRID_TYPES]
TRANSFORMERS_CLASSES = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "gpt_oss": "GptOssForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
}
ATTENTION_SHAPES = ["gpt-oss-small", "gemma4-e2b-small"]  # issue 41's: sinks, windows, MXFP4 experts, PLE, shared KV
MLA_SHAPE = "deepseek-v2-lite-small"  # issue 42's: multi-head latent attention, DeepSeek's MoE


def shrink_hybrid_shape(name: str) -> dict:
    """A Qwen 3.5 bench shape at a test's scale: its layout, layer order and options, a few dims wide
    (two groups of three Gated DeltaNet layers and an attention layer; 8 experts, 2 per token)."""
    shape = copy.deepcopy(RANDOM_SHAPES[name])
    text = shape["text_config"]
    text.update(
        hidden_size=64,
        num_hidden_layers=8,
        layer_types=list_hybrid_layer_types(8),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        vocab_size=512,
        max_position_embeddings=4096,
    )
    if text.get("num_experts"):
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    else:
        text.update(intermediate_size=128)
    return shape


def build_tiny_hybrid(name: str, folder, dtype=mx.float32):
    """The shape's folder at a test's scale, for mlxcel to load."""
    family = RANDOM_SHAPES[name]["model_type"]  # the module mlxcel loads it with
    if importlib.util.find_spec(f"mlxcel.models.{family}") is None:
        pytest.skip(f"mlxcel has no {family} family yet (mlxcel/models/{family}.py)")
    return build_random_checkpoint(folder, shrink_hybrid_shape(name), dtype)


def shrink_attention_shape(name: str) -> dict:
    """An issue-41 bench shape at a test's scale: its layout, layer order and options, a few dims wide
    (windows of 8 under the tests' longer prompts; gpt-oss 4 experts, 2 per token, still MXFP4)."""
    shape = copy.deepcopy(RANDOM_SHAPES[name])
    if shape["model_type"] == "gpt_oss":
        shape.update(
            hidden_size=64,
            intermediate_size=64,  # MXFP4 blocks are 32 wide
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_per_token=2,
            sliding_window=8,
            vocab_size=512,
            max_position_embeddings=4096,
            eos_token_id=2,
            pad_token_id=0,
        )
        return shape
    shape["text_config"].update(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=32,
        sliding_window=8,
        vocab_size=512,
        vocab_size_per_layer_input=512,
        hidden_size_per_layer_input=8,
        max_position_embeddings=4096,
    )
    shape["vocab_size"] = 512  # mlx-lm's gemma4 takes the top-level one (262144 when absent, the real value)
    return shape


def build_tiny_attention(name: str, folder, dtype=mx.float32):
    return build_random_checkpoint(folder, shrink_attention_shape(name), dtype)


def count_parameters(shape: dict) -> int:
    """MXFP4 blocks hold two weights a byte; their scales are not parameters."""
    return sum(
        math.prod(dims) * (2 if name.endswith("_blocks") else 1)
        for name, dims in list_weight_shapes(shape).items()
        if not name.endswith("_scales")
    )


@requires_mlx_lm
def test_bench_runs_both_engines_and_they_agree(tiny_llama, tmp_path):
    folder = prepare_checkpoint(str(tiny_llama), tmp_path, mx.float32)
    assert json.loads((folder / "config.json").read_text())["rope_theta"] == 10000.0  # mlx-lm reads only this key
    results = bench_model("tiny", folder, [12], [1, 2], gen=4, reps=1, dtype=mx.float32, warm_each_case=False)

    rows = make_table_rows(results)
    assert [(r["batch"], r["prompt"], r["metric"]) for r in rows] == [
        (batch, 12, label) for batch in (1, 2) for label, _ in METRICS.values()
    ]
    for row in rows:
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0, row
        assert row["mlxcel"] > 0 and row["mlx-lm"] > 0, row
    for case in results:
        assert case.agreement() == "agree"  # fp32, same weights: the same greedy tokens
        assert all(len(ids) == 4 for run in case.runs.values() for ids in run[0].token_ids)
        assert len(case.runs["mlx-lm"][0].token_ids) == case.batch
    table = format_table(results)
    assert table.splitlines()[0].split() == ["model", "batch", "prompt", "metric", "mlxcel", "mlx-lm", "ratio"]
    assert "tiny batch 2 prompt 12: agree" in format_agreement(results)
    json.dumps([case.to_dict() for case in results])  # what --json writes


def test_without_mlx_lm_the_bench_says_how_to_install_it(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlx_lm" else real_find_spec(name, *a)
    )
    assert bench_cli.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install -e '.[bench]'" in err


def test_cli_defaults_and_explicit_flags():
    args = bench_cli.parse_args(["--quick", "--batch-sizes", "1,4"])
    assert (args.models, args.prompt_lengths, args.batch_sizes, args.gen, args.reps) == (
        ["smollm2"],
        [64],
        [1, 4],
        8,
        1,
    )
    args = bench_cli.parse_args(["--models", "smollm2, qwen2.5-0.5b", "--gen", "32"])
    assert args.models == ["smollm2", "qwen2.5-0.5b"] and args.gen == 32
    with pytest.raises(SystemExit):
        bench_cli.parse_args(["--prompt-lengths", "0"])


def test_first_token_mismatch_is_located():
    assert compare_token_ids([[1, 2, 3]], [[1, 2, 3]]) == "agree"
    assert (
        compare_token_ids([[1, 2], [5, 6, 7]], [[1, 2], [5, 9, 7]]) == "row 1 differs at token 1 (mlxcel 6, mlx-lm 9)"
    )


def test_unpermute_undoes_llama_cpp_permutation():
    heads, head_dim, hidden = 3, 8, 5
    w = np.arange(heads * head_dim * hidden, dtype=np.float32).reshape(heads * head_dim, hidden)
    # convert_hf_to_gguf.py's LlamaModel.permute (as tests/test_gguf_families.py writes it)
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(np.array(unpermute_from_llama_cpp(mx.array(permuted), heads)), w)


def test_random_shapes_have_the_published_parameter_counts():
    counts = {
        name: sum(math.prod(s) for s in list_weight_shapes(shape).values()) for name, shape in RANDOM_SHAPES.items()
    }
    assert round(counts["qwen2.5-0.5b"] / 1e6) == 494  # Qwen2.5-0.5B: 0.49B
    assert round(counts["llama-3.2-1b"] / 1e6) == 1236  # Llama-3.2-1B: 1.24B


@pytest.mark.parametrize("name", HYBRID_SHAPES)
def test_hybrid_shapes_are_the_tensors_transformers_builds(name):
    """The full-size config is one transformers reads, and the folder's tensors are its model's,
    names and shapes, less the vision tower (built on the meta device: no memory)."""
    import torch
    import transformers

    shape = RANDOM_SHAPES[name]
    config = transformers.AutoConfig.for_model(**shape)
    with torch.device("meta"):
        model = getattr(transformers, TRANSFORMERS_CLASSES[shape["model_type"]])(config)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith("model.visual.")}
    if config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert list_weight_shapes(shape) == theirs


def test_hybrid_folders_are_in_transformers_layout(tmp_path):
    """conv1d [C, 1, K], unit norms zero-centred (stored as 0) but the gated one, A_log in float32
    in a bf16 folder (both engines compute the decay with it in float32)."""
    folder = build_random_checkpoint(tmp_path / "dense", shrink_hybrid_shape("qwen3.5-0.8b"), mx.bfloat16)
    weights = mx.load(str(folder / "model.safetensors"))
    base = "model.language_model."
    linear, attention = base + "layers.0.", base + "layers.3."
    assert weights[linear + "linear_attn.conv1d.weight"].shape == (2 * 32 + 64, 1, 4)
    assert weights[linear + "linear_attn.A_log"].dtype == mx.float32
    assert weights[linear + "linear_attn.in_proj_qkv.weight"].dtype == mx.bfloat16
    for key in (linear + "input_layernorm.weight", attention + "self_attn.q_norm.weight", base + "norm.weight"):
        assert not weights[key].any().item(), key
    assert weights[linear + "linear_attn.norm.weight"].all().item()
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["torch_dtype"] == "bfloat16"
    assert config["text_config"]["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("name", HYBRID_SHAPES)
def test_hybrid_checkpoints_load_in_mlxcel_as_transformers_reads_them(name, tmp_path):
    """The folder means to mlxcel what it means to transformers: the same fp32 logits."""
    import torch
    import transformers

    from mlxcel.checkpoints.loader import load_model

    folder = build_tiny_hybrid(name, tmp_path / name)
    tokens = [(37 * i + 11) % 400 + 100 for i in range(40)]
    model = load_model(str(folder), dtype="float32").model
    ours = np.array(model(mx.array([tokens]), model.make_cache()))
    oracle = getattr(transformers, TRANSFORMERS_CLASSES[RANDOM_SHAPES[name]["model_type"]]).from_pretrained(
        folder, dtype=torch.float32
    )
    with torch.no_grad():
        theirs = oracle(torch.tensor([tokens])).logits.numpy()
    assert ours.shape == theirs.shape == (1, 40, 512)
    assert np.abs(ours - theirs).max() <= 1e-4


@requires_mlx_lm
@pytest.mark.parametrize("name", HYBRID_SHAPES)
def test_bench_runs_both_engines_on_the_hybrid_shapes_and_they_agree(name, tmp_path):
    from mlx.utils import tree_flatten

    from mlxcel.bench.peers import load_peer

    folder = prepare_checkpoint(str(build_tiny_hybrid(name, tmp_path / name)), tmp_path, mx.float32)
    results = bench_model(name, folder, [12], [1, 2], gen=4, reps=1, dtype=mx.float32, warm_each_case=False)
    assert [case.agreement() for case in results] == ["agree", "agree"]  # fp32, same weights
    # mlx-lm cast to the bench dtype as mlx_lm.convert casts: its A_log stays float32, as mlxcel's
    params = dict(tree_flatten(load_peer("mlx-lm", folder, mx.bfloat16).model.parameters()))
    assert {v.dtype for k, v in params.items() if k.endswith(".A_log")} == {mx.float32}
    assert {v.dtype for k, v in params.items() if not k.endswith(".A_log")} == {mx.bfloat16}


def test_attention_shapes_are_the_released_models_cut():
    """The cut shapes' counts, and the same listing at the released depth and expert count gives the
    released models' (gpt-oss-20b: 20.91B; Gemma 4 E2B's language model: 4.63B of its 5.1B, the
    rest its vision and audio towers)."""
    gpt_oss, gemma4 = (copy.deepcopy(RANDOM_SHAPES[name]) for name in ATTENTION_SHAPES)
    assert round(count_parameters(gpt_oss) / 1e7) == 206
    assert round(count_parameters(gemma4) / 1e7) == 159
    gpt_oss.update(num_hidden_layers=24, layer_types=["sliding_attention", "full_attention"] * 12, num_local_experts=32)
    gemma4["text_config"].update(num_hidden_layers=35, layer_types=list_gemma4_layer_types(35), num_kv_shared_layers=20)
    assert round(count_parameters(gpt_oss) / 1e7) == 2091
    assert round(count_parameters(gemma4) / 1e7) == 463


@pytest.mark.parametrize("name", ATTENTION_SHAPES)
def test_attention_shapes_are_the_tensors_transformers_builds(name):
    """The full-size config is one transformers reads, and the folder's tensors are its model's
    (built on the meta device: no memory). gpt-oss's experts as the released folders store them:
    transformers' dense [E, in, out] as MXFP4 blocks [E, out, in/32, 16] and scales [E, out, in/32]."""
    import torch
    import transformers

    shape = RANDOM_SHAPES[name]
    config = transformers.AutoConfig.for_model(**shape)
    with torch.device("meta"):
        model = getattr(transformers, TRANSFORMERS_CLASSES[shape["model_type"]])(config)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    for key in [k for k in theirs if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, columns, rows = theirs.pop(key)
        theirs.update(
            {f"{key}_blocks": (experts, rows, columns // 32, 16), f"{key}_scales": (experts, rows, columns // 32)}
        )
    assert list_weight_shapes(shape) == theirs


def test_gpt_oss_folder_keeps_the_experts_in_mxfp4(tmp_path):
    """As released: E2M1 codes and E8M0 scales in uint8, the rest in the folder's dtype, a
    quantization_config that says mxfp4; mlxcel keeps them packed (MLX's mxfp4 mode), not upcast."""
    from mlxcel.checkpoints.loader import load_model
    from mlxcel.models import gpt_oss

    folder = build_tiny_attention("gpt-oss-small", tmp_path / "gpt-oss", mx.bfloat16)
    weights = mx.load(str(folder / "model.safetensors"))
    experts = "model.layers.0.mlp.experts."
    assert weights[experts + "gate_up_proj_blocks"].shape == (4, 128, 2, 16)
    assert weights[experts + "gate_up_proj_blocks"].dtype == weights[experts + "down_proj_scales"].dtype == mx.uint8
    assert (
        weights[experts + "gate_up_proj_bias"].dtype == weights["model.layers.0.self_attn.sinks"].dtype == mx.bfloat16
    )
    assert set(np.unique(np.array(weights[experts + "down_proj_scales"]))) == {119, 120}  # 2^-8, 2^-7
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    model = load_model(str(folder), dtype="bfloat16").model
    proj = model.model.layers[0].mlp.experts.down_proj
    assert isinstance(proj, gpt_oss.QuantizedBiasedSwitchLinear) and proj.mode == "mxfp4"
    assert proj.weight.dtype == mx.uint32


@pytest.mark.parametrize("name", ATTENTION_SHAPES)
def test_attention_checkpoints_load_in_mlxcel_as_transformers_reads_them(name, tmp_path):
    """The folder means to mlxcel what it means to transformers (every tensor read, none left over):
    the same fp32 logits over a prompt five windows long (transformers dequantizes the MXFP4
    experts on the CPU: their values are exact in fp32)."""
    import torch
    import transformers

    from mlxcel.checkpoints.loader import load_model

    folder = build_tiny_attention(name, tmp_path / name)
    tokens = [(37 * i + 11) % 400 + 100 for i in range(40)]
    model = load_model(str(folder), dtype="float32").model
    ours = np.array(model(mx.array([tokens]), model.make_cache()))
    oracle, info = getattr(transformers, TRANSFORMERS_CLASSES[RANDOM_SHAPES[name]["model_type"]]).from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        theirs = oracle(torch.tensor([tokens])).logits.numpy()
    assert ours.shape == theirs.shape == (1, 40, 512)
    assert np.abs(ours - theirs).max() <= 1e-4


@requires_mlx_lm
@pytest.mark.parametrize("name", ATTENTION_SHAPES)
def test_bench_runs_both_engines_on_the_attention_shapes_and_they_agree(name, tmp_path):
    """mlx-lm 0.32 has both families (mlx_lm/models/gpt_oss.py, gemma4.py): the same greedy ids; for
    gpt-oss both keep the experts MXFP4 (MLX's mxfp4 mode), so their weights weigh the same."""
    from mlxcel.bench.peers import load_peer

    folder = prepare_checkpoint(str(build_tiny_attention(name, tmp_path / name)), tmp_path, mx.float32)
    results = bench_model(name, folder, [12], [1, 2], gen=4, reps=1, dtype=mx.float32, warm_each_case=False)
    assert [case.agreement() for case in results] == ["agree", "agree"]  # fp32, same weights
    if name == "gpt-oss-small":
        peers = [load_peer(engine, folder, mx.bfloat16) for engine in ("mlxcel", "mlx-lm")]
        assert peers[0].weight_bytes == peers[1].weight_bytes
        assert peers[1].model.model.layers[0].mlp.experts.down_proj.mode == "mxfp4"


def test_mlx_lm_experts_in_half_precision_on_the_cpu_are_refused_in_one_line():
    from mlxcel.bench.peers import check_peer_dtype

    if mx.default_device() != mx.cpu:
        pytest.skip("a CPU-only limit of MLX (its gather_mm)")
    moe = RANDOM_SHAPES["qwen3.5-moe-small"]["text_config"]
    with pytest.raises(ValueError, match="--dtype float32"):
        check_peer_dtype(moe, mx.bfloat16)
    check_peer_dtype(moe, mx.float32)
    check_peer_dtype(RANDOM_SHAPES["qwen3.5-0.8b"]["text_config"], mx.bfloat16)


@pytest.mark.slow
@requires_smollm2
def test_smollm2_export_matches_the_gguf(tmp_path):
    """The exported folder (dequantized, Q/K un-permuted, standard RoPE) computes what mlxcel
    computes from the GGUF file itself (dequantized, interleaved RoPE)."""
    from mlxcel.checkpoints.loader import load_model

    folder = prepare_checkpoint("smollm2", tmp_path, mx.float32)
    tokens = mx.array([[(17 * i + 3) % 30000 + 100 for i in range(24)]])
    logits = []
    for path, weights in ((str(folder), "auto"), ("embedded:smollm2", "dequantize")):
        model = load_model(path, dtype="float32", gguf_weights=weights).model
        logits.append(np.array(model(tokens, model.make_cache())))
    assert np.abs(logits[0] - logits[1]).max() <= 1e-3


def test_policy_bench_tables_every_dtype_and_chunk(tiny_llama, tmp_path):
    from mlxcel.bench import policy

    args = policy.parse_args(
        [
            "--model",
            str(tiny_llama),
            "--dtypes",
            "float32,bfloat16",
            "--dtype-prompt-len",
            "12",
            "--chunks",
            "4,16",
            "--chunk-prompt-len",
            "16",
            "--gen",
            "3",
            "--reps",
            "1",
            "--work-dir",
            str(tmp_path),
        ]
    )
    dtype_table, chunk_table = (
        policy.measure_dtypes(str(tiny_llama), args),
        policy.measure_chunks(str(tiny_llama), args),
    )
    assert [row.split("|")[1].strip() for row in dtype_table[3:]] == ["float32 (auto)", "bfloat16"]
    chunk_rows = [[cell.strip() for cell in row.split("|")[1:-1]] for row in chunk_table[3:]]
    assert [(row[0], row[1]) for row in chunk_rows] == [("4", "4"), ("16", "1")]
    assert all(float(value) > 0 for row in chunk_rows for value in row[2:])
    with pytest.raises(SystemExit):
        policy.parse_args(["--dtypes", "fp8"])


# --- issue 42: the DeepSeek-V2-Lite shape (multi-head latent attention) ---------------------------------


def shrink_mla_shape() -> dict:
    """The DeepSeek-V2-Lite bench shape at a test's scale: its layout and options (a dense first layer, then
    softmax-routed experts and the shared ones; YaRN x40), a few dims wide, each cached width its own (latent
    32, RoPE key 8, no-RoPE key 16, value 16) so a width swapped somewhere shows; 8 experts, 3 per token."""
    shape = copy.deepcopy(RANDOM_SHAPES[MLA_SHAPE])
    shape.update(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=3,
        vocab_size=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    return shape


def build_tiny_mla(folder, dtype=mx.float32):
    return build_random_checkpoint(folder, shrink_mla_shape(), dtype)


# the tiny shape's KV bytes a position in fp32, 3 layers: mlxcel's pool keeps the latent and the RoPE key
# (32 + 8); mlx-lm's cache 4 heads' keys (16 + 8) and values (16)
TINY_MLA_KV_BYTES = {"mlxcel": 3 * (32 + 8) * 4, "mlx-lm": 3 * 4 * ((16 + 8) + 16) * 4}


def test_mla_shape_is_deepseek_v2_lite_cut():
    """8 of DeepSeek-V2-Lite's 27 layers: 4.59B parameters; at the released depth the listing gives the
    released folder's 15,706,484,224 exactly. Only this shape is an MLA one (the KV-bytes figure's switch)."""
    from mlxcel.bench.peers import uses_latent_attention

    shape = copy.deepcopy(RANDOM_SHAPES[MLA_SHAPE])
    assert round(count_parameters(shape) / 1e7) == 459
    shape["num_hidden_layers"] = 27
    assert count_parameters(shape) == 15_706_484_224
    assert [name for name, shape in RANDOM_SHAPES.items() if uses_latent_attention(shape)] == [MLA_SHAPE]


def test_mla_shape_is_the_tensors_transformers_builds():
    """The full-size config reads in transformers 5 as DeepSeek-V2-Lite's (YaRN x40 from `rope_scaling`),
    and the folder's tensors are its DeepseekV2ForCausalLM's (built on the meta device: no memory), the
    experts one by one as save_pretrained writes them (transformers fuses them only in memory)."""
    import torch
    import transformers

    shape = RANDOM_SHAPES[MLA_SHAPE]
    config = transformers.AutoConfig.for_model(**shape)
    rope = config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"], rope["mscale_all_dim"]) == ("yarn", 40, 10000, 0.707)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim) == (None, 512, 192)
    assert (config.topk_method, config.num_experts_per_tok, config.n_shared_experts) == ("greedy", 6, 2)
    with torch.device("meta"):
        model = transformers.DeepseekV2ForCausalLM(config)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for key in [k for k in theirs if k.endswith("mlp.experts.gate_up_proj")]:
        experts, rows, columns = theirs.pop(key)
        _, _, inter = theirs.pop(key.replace("gate_up_proj", "down_proj"))
        prefix = key.removesuffix("gate_up_proj")
        for e in range(experts):
            theirs.update(
                {
                    f"{prefix}{e}.gate_proj.weight": (rows // 2, columns),
                    f"{prefix}{e}.up_proj.weight": (rows // 2, columns),
                    f"{prefix}{e}.down_proj.weight": (columns, inter),
                }
            )
    assert list_weight_shapes(shape) == theirs


def test_mla_checkpoint_reads_the_same_in_mlxcel_transformers_and_mlx_lm(tmp_path):
    """The folder means one model to all three: transformers reads every tensor (none missing or left
    over) and writes back the same names and shapes (save_pretrained: the released layout); mlxcel's fp32
    logits over 40 tokens are transformers' and, with mlx-lm installed, mlx-lm's (its deepseek_v2 sanitize
    stacks the per-expert tensors)."""
    import torch
    import transformers
    from safetensors import safe_open

    from mlxcel.checkpoints.loader import load_model

    folder = build_tiny_mla(tmp_path / "mla")
    tokens = [(37 * i + 11) % 400 + 100 for i in range(40)]
    model = load_model(str(folder), dtype="float32").model
    ours = np.array(model(mx.array([tokens]), model.make_cache()))
    oracle, info = transformers.DeepseekV2ForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        theirs = oracle(torch.tensor([tokens])).logits.numpy()
    assert ours.shape == theirs.shape == (1, 40, 512)
    assert np.abs(ours - theirs).max() <= 1e-4
    oracle.save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "np") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == list_weight_shapes(shrink_mla_shape())
    if importlib.util.find_spec("mlx_lm") is not None:
        from mlxcel.bench.peers import load_peer

        peer = load_peer("mlx-lm", folder, mx.float32)
        assert np.abs(ours - np.array(peer.model(mx.array([tokens])))).max() <= 1e-4


@requires_mlx_lm
def test_bench_runs_both_engines_on_the_mla_shape_and_prints_the_kv_bytes(tmp_path, capsys):
    """python -m mlxcel.bench on the tiny shape: the same greedy ids, and the KV bytes a position printed and
    in --json: mlxcel's pool (the latent and the RoPE key a layer) against mlx-lm's cache as measured on it
    (decompressed keys and values per head)."""
    folder = build_tiny_mla(tmp_path / "mla")
    out = tmp_path / "bench.json"
    argv = ["--models", str(folder), "--prompt-lengths", "12", "--batch-sizes", "1,2", "--gen", "4", "--reps", "1"]
    assert bench_cli.main([*argv, "--dtype", "float32", "--work-dir", str(tmp_path), "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    report = json.loads(out.read_text())
    assert [case["token_ids_agree"] for case in report["cases"]] == ["agree", "agree"]  # fp32, same weights
    (figure,) = report["kv_bytes_per_position"].values()
    assert figure == {**TINY_MLA_KV_BYTES, "ratio": 0.25}
    assert all(case["kv_bytes_per_position"] == figure for case in report["cases"])
    expected = "KV bytes per position (every layer, the bench dtype): mlxcel 480, mlx-lm 1,920: ratio 0.250 (1/4.0)"
    assert f"{folder} {expected}" in lines  # (the bench labels a folder by its path)


@requires_mlx_lm
def test_bench_jobs_runs_both_engines_on_the_mla_shape_and_prints_the_kv_bytes(tmp_path, capsys):
    """python -m mlxcel.bench.jobs on the tiny shape: the scheduler runs the rows, every row's ids are mlx-lm's,
    and the KV bytes a position is printed and in --json; with mlxcel alone, mlxcel's figure only."""
    from mlxcel.bench import jobs

    folder = build_tiny_mla(tmp_path / "mla")
    job = ["--rows", "5", "--prompt-tokens", "3,12", "--output-tokens", "1,6", "--max-rows", "2", "--dtype", "float32"]
    for engines, figure in (("mlxcel,mlx-lm", {**TINY_MLA_KV_BYTES, "ratio": 0.25}), ("mlxcel", {"mlxcel": 480})):
        out = tmp_path / "jobs.json"
        argv = ["--models", str(folder), *job, "--engines", engines, "--work-dir", str(tmp_path), "--json", str(out)]
        assert jobs.main(argv) == 0
        lines = capsys.readouterr().out.splitlines()
        (model,) = json.loads(out.read_text())["models"]
        assert model["scheduler"]["occupancy"] > 0 and model["kv_bytes_per_position"] == figure
        assert any(line.startswith(f"{folder.name} KV bytes per position") for line in lines)
    assert model["ratio"] is None
    assert lines[-1] == f"{folder.name} KV bytes per position (every layer, the bench dtype): mlxcel 480"


def test_mlx_lm_deepseek_experts_in_half_precision_on_the_cpu_are_refused_in_one_line():
    """DeepSeek names its expert count n_routed_experts: mlx-lm's SwitchGLU there too."""
    from mlxcel.bench.peers import check_peer_dtype

    if mx.default_device() != mx.cpu:
        pytest.skip("a CPU-only limit of MLX (its gather_mm)")
    with pytest.raises(ValueError, match="--dtype float32"):
        check_peer_dtype(RANDOM_SHAPES[MLA_SHAPE], mx.bfloat16)
    check_peer_dtype(RANDOM_SHAPES[MLA_SHAPE], mx.float32)
