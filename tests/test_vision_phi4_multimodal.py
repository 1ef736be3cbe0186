"""Phi-4-multimodal's image processor (mlxcel.vision.processors.phi4_multimodal) against transformers 5.24's
`Phi4MultimodalImageProcessor`.

The oracle: transformers' processor needs torchvision, whose PyPI wheel does not work with the CPU
torch installed here, so `reference_preprocess` below is a line-by-line transcription of its
`_preprocess` / `dynamic_preprocess` (and of the TorchvisionBackend steps they call) into torch ops,
with each torchvision function replaced by what torchvision's source does for these inputs:
- `tvF.resize(uint8 [3, H, W], [h, w])` (BILINEAR, antialias=True) -> `resize_image`: returns the
  image unchanged when the size is the same; otherwise, on a CPU whose capability is AVX2/AVX512
  (`_do_native_uint8_resize_on_cpu`), `interpolate(x[None], mode="bilinear", align_corners=False,
  antialias=True)` directly on uint8 (torch's native uint8 antialiased kernel); on other CPUs and on
  GPUs it casts to float32, interpolates, rounds and casts back (`native_uint8=False` here).
- `tvF.pad(x, [0, 0, pw, ph], fill=[255, 255, 255])` -> `_pad_with_vector_fill`: zero constant pad on
  the right / bottom, then the padded columns / rows set to the fill.
- `rescale_and_normalize` -> mean and std (torch.tensor of the lists, float32) multiplied by
  1 / rescale_factor, then `tvF.normalize` on x.to(float32): (x - mean) / std.
- `tvF.resize(float32, [448, 448], BICUBIC, antialias=False)` -> unchanged when already that size,
  else `interpolate(x[None], mode="bicubic", align_corners=False, antialias=False)`; float inputs
  are neither clamped nor rounded (the clamp is only for uint8 on the cast path).
- convert_to_rgb: transformers' own `image_transforms.convert_to_rgb` (runs without torchvision).

mlxcel resizes the HD image with Pillow's BILINEAR instead of torch's kernel; the measured
difference (asserted below, on the cases and on the photo at several scales) is at most 2 uint8
levels, with up to 22.5% of the resized values off by one at some scales, so the crops agree to
2 / 127.5 in normalized units and the bicubic global view (whose 4-tap weights at A = -0.75 sum in
absolute value to at most 1.375 per axis) to 2 / 127.5 * 1.375**2. Every stage after the resize is
checked on its own to float32 rounding."""

from __future__ import annotations

import math
import os

import matplotlib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from mlxcel.errors import ConfigError, MlxcelError
from mlxcel.vision.processors import phi4_multimodal
from mlxcel.vision.processors.phi4_multimodal import (
    Phi4ImageConfig,
    apply_bicubic_resize,
    apply_rescale_normalize,
    make_hd_image,
    plan_hd,
    preprocess_image,
)

MAX_LEVELS = 2  # measured Pillow vs torch uint8 antialiased bilinear difference
MAX_DIFF_FRACTION = 0.25  # measured: up to 22.5% of the resized values differ (by 1) at some scales
CUBIC_GAIN = 1.375**2


# --- the oracle: transformers' Phi4MultimodalImageProcessor in torch ops ---


def tv_resize_uint8_bilinear(image: torch.Tensor, size: tuple[int, int], native_uint8: bool) -> torch.Tensor:
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    if native_uint8:
        return F.interpolate(image[None], size=list(size), mode="bilinear", align_corners=False, antialias=True)[0]
    out = F.interpolate(
        image[None].to(torch.float32), size=list(size), mode="bilinear", align_corners=False, antialias=True
    )
    return out.round_().to(torch.uint8)[0]


def tv_resize_float_bicubic(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    return F.interpolate(image[None], size=list(size), mode="bicubic", align_corners=False, antialias=False)[0]


def tv_pad_white(image: torch.Tensor, pad_width: int, pad_height: int) -> torch.Tensor:
    out = F.pad(image, [0, pad_width, 0, pad_height], mode="constant", value=0.0)
    fill = torch.tensor([255, 255, 255]).to(dtype=image.dtype).reshape(-1, 1, 1)
    if pad_height > 0:
        out[..., -pad_height:, :] = fill
    if pad_width > 0:
        out[..., :, -pad_width:] = fill
    return out


def find_closest_aspect_ratio(aspect_ratio, target_ratios, width, height, image_size):
    best_ratio_diff = float("inf")
    best_ratio = (1, 1)
    area = width * height
    for ratio in target_ratios:
        target_aspect_ratio = ratio[0] / ratio[1]
        ratio_diff = abs(aspect_ratio - target_aspect_ratio)
        if ratio_diff < best_ratio_diff:
            best_ratio_diff = ratio_diff
            best_ratio = ratio
        elif ratio_diff == best_ratio_diff:  # noqa: SIM102 (transformers' code as written)
            if area > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
                best_ratio = ratio
    return best_ratio


def dynamic_preprocess(image, image_size, patch_size, mask_size, max_num, native_uint8, min_num=1):
    orig_height, orig_width = image.shape[-2:]
    w_crop_num = math.ceil(orig_width / float(image_size))
    h_crop_num = math.ceil(orig_height / float(image_size))
    if w_crop_num * h_crop_num > max_num:
        aspect_ratio = orig_width / orig_height
        target_ratios = {
            (i, j)
            for n in range(min_num, max_num + 1)
            for i in range(1, n + 1)
            for j in range(1, n + 1)
            if i * j <= max_num and i * j >= min_num
        }
        target_ratios = sorted(target_ratios, key=lambda x: x[0] * x[1])
        target_aspect_ratio = find_closest_aspect_ratio(
            aspect_ratio, target_ratios, orig_width, orig_height, image_size
        )
        target_width = image_size * target_aspect_ratio[0]
        target_height = image_size * target_aspect_ratio[1]
    else:
        target_width = image_size * w_crop_num
        target_height = image_size * h_crop_num
        target_aspect_ratio = (w_crop_num, h_crop_num)
    ratio_width = target_width / orig_width
    ratio_height = target_height / orig_height
    if ratio_width < ratio_height:
        new_size = (target_width, int(orig_height * ratio_width))
        padding_width = 0
        padding_height = target_height - int(orig_height * ratio_width)
    else:
        new_size = (int(orig_width * ratio_height), target_height)
        padding_width = target_width - int(orig_width * ratio_height)
        padding_height = 0
    attention_mask = torch.ones((int(mask_size * target_aspect_ratio[1]), int(mask_size * target_aspect_ratio[0])))
    if padding_width >= patch_size:
        attention_mask[:, -math.floor(padding_width / patch_size) :] = 0
    if padding_height >= patch_size:
        attention_mask[-math.floor(padding_height / patch_size) :, :] = 0
    if min(new_size[1], target_height) < 10 or min(new_size[0], target_width) < 10:
        raise ValueError(f"the aspect ratio is very extreme {new_size}")
    image = tv_resize_uint8_bilinear(image, (new_size[1], new_size[0]), native_uint8)
    resized_img = tv_pad_white(image, padding_width, padding_height)
    return resized_img, attention_mask


def rescale_and_normalize(images, rescale_factor, image_mean, image_std):
    mean = torch.tensor(image_mean) * (1.0 / rescale_factor)
    std = torch.tensor(image_std) * (1.0 / rescale_factor)
    return (images.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)


def reference_preprocess(
    pil_image,
    size=448,
    patch_size=14,
    dynamic_hd=36,
    rescale_factor=1 / 255,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    native_uint8=True,
):
    """One image through transformers' _preprocess (batch of one, so no crop padding). Also returns the
    intermediate uint8 HD image and the normalized HD image for stage-wise checks."""
    image = torch.from_numpy(convert_to_rgb(pil_image, return_numpy=True)).permute(2, 0, 1).contiguous()
    mask_size = size // patch_size
    resized_image, attention_mask = dynamic_preprocess(image, size, patch_size, mask_size, dynamic_hd, native_uint8)
    processed_image = rescale_and_normalize(resized_image, rescale_factor, image_mean, image_std)
    global_image = tv_resize_float_bicubic(processed_image, (size, size))
    height, width = processed_image.shape[-2:]
    mask_height, mask_width = attention_mask.shape[-2:]
    global_attention_mask = torch.ones((1, mask_size, mask_size))
    hd_image_reshape = processed_image.reshape(1, 3, height // size, size, width // size, size)
    hd_image_reshape = hd_image_reshape.permute(0, 2, 4, 1, 3, 5).reshape(-1, 3, size, size).contiguous()
    attention_mask_reshape = attention_mask.reshape(
        mask_height // mask_size, mask_size, mask_width // mask_size, mask_size
    )
    attention_mask_reshape = attention_mask_reshape.transpose(1, 2).reshape(-1, mask_size, mask_size).contiguous()
    downsample_attention_mask = attention_mask_reshape[:, 0::2, 0::2]
    downsample_attention_mask = downsample_attention_mask.reshape(
        mask_height // mask_size,
        mask_width // mask_size,
        mask_size // 2 + mask_size % 2,
        mask_size // 2 + mask_size % 2,
    )
    downsample_attention_mask = downsample_attention_mask.transpose(1, 2)
    downsample_attention_mask = downsample_attention_mask.reshape(
        downsample_attention_mask.size(0) * downsample_attention_mask.size(1),
        downsample_attention_mask.size(2) * downsample_attention_mask.size(3),
    )
    num_img_tokens = (
        256 + 1 + int(downsample_attention_mask.sum().item()) + int(downsample_attention_mask[:, 0].sum().item()) + 16
    )
    return {
        "pixel_values": torch.cat([global_image.unsqueeze(0), hd_image_reshape], dim=0).numpy(),
        "attention_mask": torch.cat([global_attention_mask, attention_mask_reshape], dim=0).numpy(),
        "image_size": (height, width),
        "num_img_tokens": num_img_tokens,
        "hd_uint8": resized_image.numpy(),
        "hd_normalized": processed_image.numpy(),
        "downsampled_mask": downsample_attention_mask.numpy(),
    }


# --- test images ---


def photo() -> Image.Image:
    with Image.open(os.path.join(matplotlib.get_data_path(), "sample_data", "grace_hopper.jpg")) as image:
        return image.convert("RGB")


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(array[..., 0] if mode == "L" else array, mode)


def smooth(width: int, height: int, seed: int = 1) -> Image.Image:
    """A smooth gradient with some texture: closer to a photo than noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    rng = np.random.default_rng(seed)
    channels = [127 + 120 * np.sin(x / (17 + 5 * c) + y / (23 + 3 * c)) + rng.normal(0, 6, x.shape) for c in range(3)]
    return Image.fromarray(np.clip(np.stack(channels, -1), 0, 255).astype(np.uint8))


def rgba_with_transparency() -> Image.Image:
    array = np.asarray(smooth(300, 500)).copy()
    alpha = np.full(array.shape[:2], 255, dtype=np.uint8)
    alpha[:, :100] = 0
    alpha[200:260] = 128
    return Image.fromarray(np.dstack([array, alpha]), "RGBA")


CASES = {
    "photo": (photo, {}),
    "tiny": (lambda: noise(20, 30), {}),
    "wide": (lambda: smooth(3000, 200), {}),
    "wide_closest_aspect": (lambda: smooth(3000, 200), {"dynamic_hd": 4}),
    "tall_closest_aspect": (lambda: smooth(150, 1900), {"dynamic_hd": 3}),
    "tall": (lambda: noise(300, 1000, seed=2), {}),
    "rgba": (rgba_with_transparency, {}),
    "gray": (lambda: noise(500, 700, "L", seed=3), {}),
    "multiple_of_448": (lambda: smooth(896, 448), {}),
    "one_crop_downscale": (lambda: smooth(460, 100), {"dynamic_hd": 1}),
    "square_tie_to_larger_grid": (lambda: smooth(1400, 1400), {"dynamic_hd": 4}),  # (1, 1) ties (2, 2): 2x2 wins
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    make, overrides = CASES[request.param]
    image = make()
    config = Phi4ImageConfig.from_dict(overrides)
    reference = reference_preprocess(image, dynamic_hd=config.dynamic_hd)
    return request.param, image, config, reference


def test_matches_transformers(case):
    name, image, config, ref = case
    ours = preprocess_image(image, config, source=name)
    assert ours.pixel_values.dtype == np.float32 and ours.patch_mask.dtype == bool
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    assert (ours.hd_height, ours.hd_width) == ref["image_size"]
    assert ours.n_frames == 1 + ours.rows * ours.cols
    assert (ours.rows * config.size, ours.cols * config.size) == ref["image_size"]
    np.testing.assert_array_equal(ours.patch_mask, ref["attention_mask"].astype(bool))
    assert ours.num_tokens == ref["num_img_tokens"]
    ds = ref["downsampled_mask"]
    assert (ours.useful_rows, ours.useful_cols) == (int(ds[:, 0].sum()), int(ds[0, :].sum()))
    # The model's layout: useful_rows x (useful_cols + 1) sub-image tokens + 1 + base x (base + 1) global.
    assert ours.num_tokens == ours.useful_rows * (ours.useful_cols + 1) + 1 + 16 * 17
    crops_diff = np.abs(ours.pixel_values[1:] - ref["pixel_values"][1:]).max()
    global_diff = np.abs(ours.pixel_values[0] - ref["pixel_values"][0]).max()
    assert crops_diff <= MAX_LEVELS / 127.5 + 1e-5, (name, crops_diff * 127.5)
    assert global_diff <= MAX_LEVELS / 127.5 * CUBIC_GAIN + 1e-5, (name, global_diff * 127.5)


def test_hd_resize_within_measured_levels(case):
    """Pillow's bilinear vs torch's uint8 antialiased bilinear (and its float path on non-AVX2 CPUs)."""
    name, image, config, ref = case
    array = np.array(convert_to_rgb(image, return_numpy=True))
    hd = make_hd_image(array, plan_hd(*array.shape[:2], config), config).transpose(2, 0, 1).astype(np.int32)
    plan = plan_hd(*array.shape[:2], config)
    region = (slice(None), slice(0, plan.resized_height), slice(0, plan.resized_width))  # the padding is exact
    diff = np.abs(hd - ref["hd_uint8"])[region]
    np.testing.assert_array_equal(hd[:, plan.resized_height :], ref["hd_uint8"][:, plan.resized_height :])
    np.testing.assert_array_equal(hd[:, :, plan.resized_width :], ref["hd_uint8"][:, :, plan.resized_width :])
    assert diff.max() <= MAX_LEVELS and (diff > 0).mean() <= MAX_DIFF_FRACTION, (name, diff.max(), (diff > 0).mean())
    float_path = reference_preprocess(image, dynamic_hd=config.dynamic_hd, native_uint8=False)["hd_uint8"]
    assert np.abs(hd - float_path).max() <= 1, name


@pytest.mark.parametrize("width,height", [(896, 1045), (448, 300), (100, 60), (2688, 1045), (764, 896)])
def test_pillow_bilinear_vs_torch_uint8_kernel(width, height):
    """The measurement behind MAX_LEVELS: the photo (512x600) at sizes where the kernels differ most
    (896x1045 reaches 2 levels; 448x300 has the most values off by 1)."""
    array = np.array(photo())
    ours = np.array(Image.fromarray(array).resize((width, height), Image.BILINEAR)).transpose(2, 0, 1).astype(np.int32)
    torch_u8 = tv_resize_uint8_bilinear(torch.from_numpy(array).permute(2, 0, 1).contiguous(), (height, width), True)
    diff = np.abs(ours - torch_u8.numpy())
    assert diff.max() <= MAX_LEVELS and (diff > 0).mean() <= MAX_DIFF_FRACTION


def test_stages_after_resize_match_to_float32_rounding(case):
    """Given torch's HD image, normalize and the bicubic global view agree to float32 rounding."""
    _name, _image, config, ref = case
    normalized = apply_rescale_normalize(ref["hd_uint8"].transpose(1, 2, 0), config)
    np.testing.assert_array_equal(normalized, ref["hd_normalized"])
    global_view = apply_bicubic_resize(ref["hd_normalized"], config.size, config.size)
    np.testing.assert_allclose(global_view, ref["pixel_values"][0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("in_size,out_size", [(448, 448), (896, 448), (3136, 448), (100, 448), (17, 5), (1, 4)])
def test_bicubic_matches_torch(in_size, out_size):
    rng = np.random.default_rng(in_size)
    image = rng.uniform(-1, 1, (3, in_size, min(in_size, 40))).astype(np.float32)
    expected = tv_resize_float_bicubic(torch.from_numpy(image), (out_size, out_size)).numpy()
    np.testing.assert_allclose(apply_bicubic_resize(image, out_size, out_size), expected, rtol=0, atol=1e-5)


def test_grid_choice_matches_transformers():
    """The closest-aspect search (with its tie rule) over many sizes and crop limits, no pixels."""
    for max_crops in (1, 2, 3, 4, 6, 9, 12, 36):
        targets = sorted(
            {
                (i, j)
                for n in range(1, max_crops + 1)
                for i in range(1, n + 1)
                for j in range(1, n + 1)
                if i * j <= max_crops
            },
            key=lambda x: x[0] * x[1],
        )
        for width in (10, 224, 448, 633, 700, 896, 1400, 2000, 5000):
            for height in (10, 224, 448, 633, 700, 896, 1400, 2000, 5000):
                expected = find_closest_aspect_ratio(width / height, targets, width, height, 448)
                assert phi4_multimodal.find_closest_aspect_ratio(width, height, max_crops, 448) == expected, (
                    width,
                    height,
                    max_crops,
                )


def test_other_mean_std_and_rescale_only():
    array = np.array(smooth(64, 48))
    clip = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
    ours = apply_rescale_normalize(array, Phi4ImageConfig.from_dict(clip))
    expected = rescale_and_normalize(
        torch.from_numpy(array).permute(2, 0, 1), 1 / 255, clip["image_mean"], clip["image_std"]
    )
    np.testing.assert_array_equal(ours, expected.numpy())
    ours = apply_rescale_normalize(array, Phi4ImageConfig.from_dict({"do_normalize": False}))
    np.testing.assert_array_equal(ours, (torch.from_numpy(array).permute(2, 0, 1) * (1 / 255)).numpy())


def test_token_count_general_form_for_other_grids():
    """An odd patch grid (size 42, patch 6: 7 patches, 4 pooled cells per side) follows the same layout."""
    config = Phi4ImageConfig.from_dict({"size": 42, "patch_size": 6})
    ours = preprocess_image(smooth(100, 50), config)
    assert config.base_size == 4 and ours.patch_mask.shape[1:] == (7, 7)
    assert ours.num_tokens == ours.useful_rows * (ours.useful_cols + 1) + 1 + 4 * 5


def test_config_errors_reported_together():
    with pytest.raises(ConfigError) as error:
        Phi4ImageConfig.from_dict(
            {
                "size": {"height": 448, "width": 336},
                "dynamic_hd": 0,
                "patch_size": -1,
                "resample": 2,
                "image_std": [0.5, 0, 0.5],
                "do_convert_rgb": "yes",
            }
        )
    text = str(error.value)
    for key in ("size", "dynamic_hd", "patch_size", "resample", "image_std", "do_convert_rgb"):
        assert f"preprocessor_config.{key}" in text
    with pytest.raises(ConfigError) as error:
        Phi4ImageConfig.from_dict({"size": 448, "patch_size": 15})
    assert "preprocessor_config.patch_size" in str(error.value) and "divide" in str(error.value)
    with pytest.raises(ConfigError) as error:
        Phi4ImageConfig.from_dict({"do_rescale": False, "do_normalize": False})
    assert "preprocessor_config.do_normalize" in str(error.value)


def test_config_file_and_defaults(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        '{"image_processor_type": "Phi4MultimodalImageProcessor", "dynamic_hd": 16,'
        ' "size": {"height": 448, "width": 448}, "audio_compression_rate": 8, "do_resize": null}'
    )
    config = Phi4ImageConfig.load(tmp_path)
    assert config == Phi4ImageConfig(dynamic_hd=16)
    assert (config.mask_size, config.base_size) == (32, 16)


def test_extreme_aspect_ratio_names_the_source():
    image = smooth(4000, 5)
    with pytest.raises(ValueError):
        reference_preprocess(image)
    with pytest.raises(MlxcelError) as error:
        preprocess_image(image, Phi4ImageConfig(), source="banner.png")
    assert "banner.png" in str(error.value) and "aspect ratio" in str(error.value)
