"""Vision towers in MLX against transformers (fp32, random weights): CLIP as LLaVA uses it, and the
Qwen2-VL / Qwen2.5-VL ViTs with two images of different grid sizes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.vision import clip_vit, qwen2_vl_vit

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
CLIP = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=42, patch_size=14
)
TEXT = dict(
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
)
QWEN2_VL = dict(
    depth=2,
    embed_dim=64,
    hidden_size=48,
    num_heads=4,
    mlp_ratio=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
# window 56 px = 2 x 2 merge units; block 1 attends over whole images, blocks 0 and 2 within windows
QWEN25_VL = dict(
    depth=3,
    hidden_size=64,
    intermediate_size=96,
    out_hidden_size=48,
    num_heads=4,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=56,
    fullatt_block_indexes=[1],
)
# 6x8 and 4x6 patches (the second image has a partial window and an empty padded one); a 2-frame
# clip beside an image exercises per-frame attention
GRIDS = {"two_images": [[1, 6, 8], [1, 4, 6]], "clip_and_image": [[2, 4, 4], [1, 6, 4]]}


def randomize(model) -> None:
    """Norm weights of one and zero biases would hide a swapped or missing tensor."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))


def to_mlx(state_dict: dict, prefix: str = "") -> dict[str, mx.array]:
    return {k.removeprefix(prefix): mx.array(v.detach().numpy()) for k, v in state_dict.items() if k.startswith(prefix)}


def load(model, weights: dict[str, mx.array]):
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def max_diff(ours: mx.array, theirs) -> float:
    return float(np.abs(np.array(ours) - theirs.detach().numpy()).max())


# ---- CLIP / LLaVA -------------------------------------------------------------------------------


def make_llava(feature_layer, strategy: str, hidden_act: str = "quick_gelu"):
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**CLIP, hidden_act=hidden_act),
        text_config=transformers.LlamaConfig(**TEXT),
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy,
    )
    model = transformers.LlavaForConditionalGeneration(config).eval()
    randomize(model)
    return model


def make_clip_tower(llava, rename=lambda k: k) -> clip_vit.ClipVisionModel:
    tower = clip_vit.make_clip_vision_model(llava.config.vision_config.to_dict())
    weights = to_mlx(llava.state_dict(), "model.vision_tower.")
    return load(tower, {rename(k): v for k, v in weights.items()})


def pixels(shape) -> np.ndarray:
    return np.random.default_rng(1).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("hidden_act", ["quick_gelu", "gelu"])
def test_clip_hidden_states_match_transformers(hidden_act):
    llava = make_llava(-2, "default", hidden_act)
    x = pixels((2, 3, 42, 42))
    with torch.no_grad():
        theirs = llava.model.vision_tower(torch.from_numpy(x), output_hidden_states=True).hidden_states
    ours = make_clip_tower(llava)(mx.array(x))
    assert len(ours) == len(theirs) == CLIP["num_hidden_layers"] + 1
    diffs = [max_diff(a, b) for a, b in zip(ours, theirs)]
    print(f"clip {hidden_act} per-layer max abs diff: {[f'{d:.2e}' for d in diffs]}")
    assert max(diffs) <= TOLERANCE


@pytest.mark.parametrize(
    "feature_layer, strategy",
    [(-2, "default"), (-1, "full"), (0, "default"), ([-2, 1], "default"), ([-3, -1], "full")],
)
def test_llava_feature_selection_matches_transformers(feature_layer, strategy):
    llava = make_llava(feature_layer, strategy)
    x = pixels((2, 3, 42, 42))
    captured = {}
    hook = llava.model.multi_modal_projector.register_forward_pre_hook(
        lambda m, args: captured.setdefault("x", args[0])
    )
    # transformers 5.24 passes the layer index on as `output_hidden_states`, so layer 0 reads as
    # "none captured" and fails; asking for all hidden states sidesteps that.
    everything = {"output_hidden_states": True} if feature_layer == 0 else {}
    with torch.no_grad():
        llava.model.get_image_features(
            torch.from_numpy(x),
            vision_feature_layer=feature_layer,
            vision_feature_select_strategy=strategy,
            **everything,
        )
    hook.remove()
    ours = make_clip_tower(llava).image_features(mx.array(x), feature_layer, strategy)
    n_layers = 1 if isinstance(feature_layer, int) else len(feature_layer)
    assert ours.shape == (2, 9 + (strategy == "full"), 32 * n_layers) == tuple(captured["x"].shape)
    diff = max_diff(ours, captured["x"])
    print(f"llava layer={feature_layer} {strategy}: max abs diff {diff:.2e}")
    assert diff <= TOLERANCE


def test_clip_sanitize_accepts_the_vision_model_level():
    """llava-hf and transformers 4 checkpoints name the tower `vision_tower.vision_model.*`."""
    llava = make_llava(-2, "default")
    x = pixels((1, 3, 42, 42))
    new, old = make_clip_tower(llava), make_clip_tower(llava, rename=lambda k: "vision_model." + k)
    assert np.array_equal(np.array(new(mx.array(x))[-1]), np.array(old(mx.array(x))[-1]))
    with pytest.raises(ValueError, match="42x42"):
        new(mx.array(pixels((1, 3, 28, 28))))
    with pytest.raises(ValueError, match="out of range"):
        new.image_features(mx.array(x), -5)


# ---- Qwen2-VL / Qwen2.5-VL ----------------------------------------------------------------------


def make_qwen(variant: str):
    if variant == "qwen2_vl":
        config = transformers.Qwen2VLConfig(
            vision_config=QWEN2_VL, text_config=dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})
        )
        model = transformers.Qwen2VLForConditionalGeneration(config)
    else:
        config = transformers.Qwen2_5_VLConfig(
            vision_config=QWEN25_VL, text_config=dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})
        )
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    model.eval()
    randomize(model)
    return model


def qwen_pixels(grid: list[list[int]]) -> np.ndarray:
    n = sum(t * h * w for t, h, w in grid)
    return pixels((n, 3 * 2 * 14 * 14))


@pytest.mark.parametrize("grid_name", list(GRIDS))
@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vision_matches_transformers(variant, grid_name):
    grid = GRIDS[grid_name]
    model = make_qwen(variant)
    x = qwen_pixels(grid)
    with torch.no_grad():
        theirs = model.model.visual(torch.from_numpy(x), grid_thw=torch.tensor(grid)).pooler_output
    tower = qwen2_vl_vit.make_qwen_vision_model(model.config.vision_config.to_dict())
    assert tower.args.variant == variant
    ours = load(tower, to_mlx(model.state_dict(), "model.visual."))(mx.array(x), grid)
    assert ours.shape == tuple(theirs.shape) == (sum(t * h * w for t, h, w in grid) // 4, 48)
    diff = max_diff(ours, theirs)
    print(f"{variant} {grid_name}: max abs diff {diff:.2e}")
    assert diff <= TOLERANCE


def test_qwen25_windows_change_the_output():
    """The windowed blocks are not full attention in disguise: the window index matters."""
    model = make_qwen("qwen2_5_vl")
    grid = GRIDS["two_images"]
    x = mx.array(qwen_pixels(grid))
    weights = to_mlx(model.state_dict(), "model.visual.")
    windowed = load(qwen2_vl_vit.make_qwen_vision_model(model.config.vision_config.to_dict()), weights)
    full = load(
        qwen2_vl_vit.make_qwen_vision_model(
            {**model.config.vision_config.to_dict(), "fullatt_block_indexes": [0, 1, 2]}
        ),
        weights,
    )
    assert float(mx.abs(windowed(x, grid) - full(x, grid)).max()) > 1e-3


def test_window_index_matches_transformers():
    from transformers.vision_utils import get_vision_window_index

    grid = [[1, 6, 8], [1, 4, 6], [2, 10, 4]]
    theirs_index, theirs_cu = get_vision_window_index(
        torch.tensor(grid), spatial_merge_size=2, window_size=56, patch_size=14
    )
    index, cu = qwen2_vl_vit.make_window_index(np.array(grid), 2, 56, 14)
    assert index.tolist() == theirs_index.tolist() and cu.tolist() == theirs_cu.tolist()


def test_hub_style_configs():
    """Hub config.json files carry no vision model_type and spell in_chans; sizes differ per family."""
    qwen2 = qwen2_vl_vit.VisionArgs.from_config(
        {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 3584}
    )
    assert (qwen2.variant, qwen2.embed_dim, qwen2.out_hidden_size, qwen2.intermediate_size, qwen2.hidden_act) == (
        "qwen2_vl",
        1280,
        3584,
        5120,
        "quick_gelu",
    )
    qwen25 = qwen2_vl_vit.VisionArgs.from_config(
        {
            "depth": 32,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": 3584,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
        }
    )
    assert (qwen25.variant, qwen25.embed_dim, qwen25.out_hidden_size, qwen25.fullatt_block_indexes) == (
        "qwen2_5_vl",
        1280,
        3584,
        [7, 15, 23, 31],
    )
    clip = clip_vit.VisionArgs.from_config(
        {
            "hidden_size": 1024,
            "image_size": 336,
            "intermediate_size": 4096,
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "projection_dim": 768,
            "model_type": "clip_vision_model",
        }
    )
    assert (clip.hidden_act, clip.num_channels, clip.layer_norm_eps) == ("quick_gelu", 3, 1e-5)


# ---- Names on disk ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, prefix", [("llava", "vision_tower."), ("qwen2_vl", "visual."), ("qwen2_5_vl", "visual.")]
)
def test_saved_checkpoint_names_load_after_the_prefix(tmp_path, family, prefix):
    """What save_pretrained writes in this transformers version, minus the tower prefix, loads strictly."""
    from safetensors.numpy import load_file

    if family == "llava":
        model, make = make_llava(-2, "default"), clip_vit.make_clip_vision_model
    else:
        model, make = make_qwen(family), qwen2_vl_vit.make_qwen_vision_model
    model.save_pretrained(tmp_path)
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    tower = make(model.config.vision_config.to_dict())
    load(tower, {k.removeprefix(prefix): mx.array(v) for k, v in saved.items() if k.startswith(prefix)})
