"""Reading image files the way transformers' `load_image` does: Pillow, EXIF orientation
applied, converted to RGB (alpha dropped, grayscale expanded). Every failure is one
VisionInputError naming the file."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from mlxcel.errors import MlxcelError

# Larger inputs are refused before decoding (Pillow's own bomb guard starts at ~179M pixels);
# every family resizes far below this anyway.
MAX_IMAGE_PIXELS = 64_000_000


class VisionInputError(MlxcelError):
    """A bad image input: the message names the file and what is wrong with it."""


def load_image(path: str | Path) -> Image.Image:
    """The RGB image in `path`, upright as its EXIF orientation says."""
    path = Path(path).expanduser()
    if not path.exists():
        raise VisionInputError(f"image {path}: no such file")
    if not path.is_file():
        raise VisionInputError(f"image {path}: not a file")
    try:
        with Image.open(path) as opened:
            width, height = opened.size
            if width * height > MAX_IMAGE_PIXELS:
                raise VisionInputError(
                    f"image {path}: {width}x{height} is {width * height / 1e6:.0f} megapixels, over the limit of "
                    f"{MAX_IMAGE_PIXELS / 1e6:.0f} (downscale it first)"
                )
            image = ImageOps.exif_transpose(opened)
            image.load()
            return image.convert("RGB")
    except UnidentifiedImageError:
        raise VisionInputError(
            f"image {path}: not an image Pillow can read (expected JPEG, PNG, WebP, GIF, BMP, TIFF, ...)"
        ) from None
    except Image.DecompressionBombError as exc:
        raise VisionInputError(f"image {path}: too large to decode safely ({exc})") from None
    except OSError as exc:  # truncated or corrupt data, unreadable file
        raise VisionInputError(f"image {path}: cannot be read ({exc})") from None
