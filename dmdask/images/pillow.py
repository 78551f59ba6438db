"""Decoding and resampling of one image: Pillow, and simplejpeg (libjpeg-turbo) for JPEGs."""
from __future__ import annotations

import io

import numpy as np

INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")


def decode_jpeg(data: np.ndarray, mode: str) -> np.ndarray | None:
    """JPEG bytes -> (H, W, C) uint8 through simplejpeg; None without simplejpeg or for what
    libjpeg-turbo cannot decode (CMYK, ...), which Pillow then tries."""
    try:
        import simplejpeg
    except ImportError:
        return None
    try:
        return simplejpeg.decode_jpeg(data, colorspace="GRAY" if mode == "L" else "RGB")
    except ValueError:
        return None


def decode_with_pillow(data: np.ndarray, mode: str) -> np.ndarray:
    """Image file bytes -> (H, W, C) uint8 in Pillow's `mode`."""
    from PIL import Image

    with Image.open(io.BytesIO(data.tobytes())) as img:
        out = np.asarray(img.convert(mode))
    return out[:, :, None] if out.ndim == 2 else out


def resample_filter(name: str):
    """Pillow's resampling filter called `name` (ValueError for another name)."""
    if name not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, not {name!r}")
    from PIL import Image

    return getattr(Image.Resampling, name.upper())


def resized(image: np.ndarray, size: tuple[int, int], box, interpolation: str) -> np.ndarray:
    """The `box` (left, top, right, bottom) of an (H, W, C) uint8 image resized to (h, w)."""
    from PIL import Image

    if image.dtype != np.uint8:
        raise TypeError(f"resize and crop steps work on uint8 images, got {image.dtype}: put them before "
                        "to_float() and normalize()")
    h, w = size
    resample = resample_filter(interpolation)
    channels = image.shape[2]
    if channels in (1, 3, 4):
        src = Image.fromarray(np.ascontiguousarray(image[:, :, 0] if channels == 1 else image))
        out = np.asarray(src.resize((w, h), resample=resample, box=box))
        return out[:, :, None] if out.ndim == 2 else out
    planes = [np.asarray(Image.fromarray(np.ascontiguousarray(image[:, :, c])).resize((w, h), resample, box))
              for c in range(channels)]
    return np.stack(planes, axis=-1)
