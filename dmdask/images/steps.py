"""The steps of an image pipeline, each applied to one sample: an (H, W, C) array in, one out."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .pillow import decode_jpeg, decode_with_pillow, resample_filter, resized

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Size = int | tuple[int, int]


class Step:
    """One step of a pipeline. random: the step draws from the sample's generator.
    batched: the step may instead run once on the stacked (n, H, W, C) batch (pointwise,
    no randomness)."""

    name = "step"  # the function that makes it, for repr
    random = False
    batched = False

    def __call__(self, image: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{self.name}({args})"


class Decode(Step):
    """Image file bytes -> (H, W, 3) uint8 ("RGB") or (H, W, 1) ("L"); JPEGs through
    simplejpeg when installed (`backend="auto"`), everything else through Pillow."""

    name = "decode"

    def __init__(self, mode: str = "RGB", backend: str = "auto"):
        if mode not in ("RGB", "L"):
            raise ValueError(f"decode(mode=...) takes 'RGB' or 'L', not {mode!r}")
        if backend not in ("auto", "pillow"):
            raise ValueError(f"decode(backend=...) takes 'auto' or 'pillow', not {backend!r}")
        self.mode, self.backend = mode, backend

    def __call__(self, data, rng=None) -> np.ndarray:
        data = np.asarray(data)
        if data.dtype != np.uint8 or data.ndim != 1:
            raise TypeError(f"decode() takes the bytes of an image file (a 1-d uint8 array), got {data.dtype} of "
                            f"shape {data.shape}: is the field already decoded? then leave decode() out")
        if self.backend == "auto" and data[:3].tobytes() == b"\xff\xd8\xff":
            image = decode_jpeg(data, self.mode)
            if image is not None:
                return image
        return decode_with_pillow(data, self.mode)


class Resize(Step):
    """int: the shorter side to `size`, keeping the aspect ratio; (h, w): exactly that."""

    name = "resize"

    def __init__(self, size: Size, interpolation: str = "bilinear"):
        self.size, self.interpolation = _size(size, "resize", allow_int=True), interpolation
        resample_filter(interpolation)

    def __call__(self, image, rng=None):
        h, w = image.shape[:2]
        if isinstance(self.size, int):  # the shorter side becomes `size`
            if h <= w:
                out = (self.size, int(self.size * w / h))
            else:
                out = (int(self.size * h / w), self.size)
        else:
            out = self.size
        return resized(image, out, (0, 0, w, h), self.interpolation)


class CenterCrop(Step):
    """The central (h, w) (or size x size) region, zero-padded if the image is smaller."""

    name = "center_crop"

    def __init__(self, size: Size):
        self.size = _size(size, "center_crop")

    def __call__(self, image, rng=None):
        ch, cw = self.size
        h, w = image.shape[:2]
        if h < ch or w < cw:  # padded with zeros around, as torchvision does
            ph, pw = max(0, ch - h), max(0, cw - w)
            image = np.pad(image, ((ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
            h, w = image.shape[:2]
        top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
        return image[top:top + ch, left:left + cw]


class RandomResizedCrop(Step):
    """A random region of `scale` of the area and `ratio` of aspect, resized to `size`
    (torchvision's `RandomResizedCrop`)."""

    name = "random_resized_crop"
    random = True

    def __init__(self, size: Size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), interpolation: str = "bilinear"):
        self.size = _size(size, "random_resized_crop")
        self.scale, self.ratio = tuple(float(s) for s in scale), tuple(float(r) for r in ratio)
        if not (0 < self.scale[0] <= self.scale[1] and 0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"random_resized_crop: scale and ratio must be increasing positive pairs, got "
                             f"{self.scale}, {self.ratio}")
        self.interpolation = interpolation
        resample_filter(interpolation)

    def box(self, height: int, width: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        """(top, left, h, w) of the crop: torchvision's `RandomResizedCrop.get_params`."""
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
        in_ratio = width / height  # fallback: the central crop of the allowed ratio
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            h, w = height, int(round(height * self.ratio[1]))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, image, rng):
        top, left, h, w = self.box(image.shape[0], image.shape[1], rng)
        return resized(image, self.size, (left, top, left + w, top + h), self.interpolation)


class Flip(Step):
    """Mirror left-right with probability `p`."""

    name = "flip"
    random = True

    def __init__(self, p: float = 0.5):
        if not 0 <= p <= 1:
            raise ValueError(f"flip(p=...) is a probability in [0, 1], not {p!r}")
        self.p = float(p)

    def __call__(self, image, rng):
        return image[:, ::-1] if rng.random() < self.p else image


class ToFloat(Step):
    """uint8 -> float32 in [0, 1]."""

    name = "to_float"
    batched = True

    def __call__(self, image, rng=None):
        if image.dtype == np.uint8:
            return image.astype(np.float32) * np.float32(1 / 255)
        return image.astype(np.float32, copy=False)


class Normalize(Step):
    """float32 (x - mean) / std per channel, mean and std in [0, 1] units (one value or
    one per channel; a uint8 image is scaled to [0, 1] first)."""

    name = "normalize"
    batched = True

    def __init__(self, mean: float | Sequence[float] = IMAGENET_MEAN,
                 std: float | Sequence[float] = IMAGENET_STD):
        self.mean = np.asarray(mean, dtype=np.float32).reshape(-1)
        self.std = np.asarray(std, dtype=np.float32).reshape(-1)
        if (self.std <= 0).any():
            raise ValueError(f"normalize(std=...) must be positive, got {self.std.tolist()}")

    def __call__(self, image, rng=None):
        channels = image.shape[-1]
        for name, v in (("mean", self.mean), ("std", self.std)):
            if len(v) not in (1, channels):
                raise ValueError(f"normalize: {len(v)} values of {name} for images of {channels} channel(s)")
        return (ToFloat()(image) - self.mean) / self.std

    def __repr__(self) -> str:
        return (f"normalize(mean={[round(float(v), 6) for v in self.mean]}, "
                f"std={[round(float(v), 6) for v in self.std]})")


def _size(size, what: str, allow_int: bool = False):
    def positive(n) -> bool:
        return isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n > 0

    if positive(size):
        return int(size) if allow_int else (int(size), int(size))
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(positive(s) for s in size):
        return (int(size[0]), int(size[1]))
    raise ValueError(f"{what}: size is a positive int or a (height, width) pair, not {size!r}")


# the documented names of the steps (docs/quickstart.md, "Images")
decode = Decode
resize = Resize
center_crop = CenterCrop
random_resized_crop = RandomResizedCrop
flip = Flip
to_float = ToFloat
normalize = Normalize
