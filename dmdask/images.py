"""Ready batch transforms for images: decode, crop, flip and normalise on the workers.

A pipeline is a `Spec.transform`: it takes a batch whose field "data" holds the file
bytes of each sample (a folder source: an object array of uint8 arrays) and returns
the batch with one fixed-size array in field "image" instead, the other fields
("label", "index") unchanged::

    from dmdask import images

    train = images.pipeline(images.decode(), images.random_resized_crop(224), images.flip(),
                            images.normalize(images.IMAGENET_MEAN, images.IMAGENET_STD))
    spec = dmdask.Spec("/data/train", batch_size=256, transform=train)
    # batch: {"image": float32 (n, 3, 224, 224), "label": int64 (n,), "index": int64 (n,)}

    # the same two recipes as torchvision's ImageNet references, in one call each:
    train = images.train_pipeline(224)   # decode, RandomResizedCrop, RandomHorizontalFlip, Normalize
    test = images.eval_pipeline(224)     # decode, Resize(256), CenterCrop(224), Normalize

The steps, applied in order to each sample:

- `decode(mode="RGB")`: JPEG, PNG (anything Pillow opens) -> an (H, W, 3) uint8 array,
  (H, W, 1) with `mode="L"`. JPEGs go through simplejpeg (libjpeg-turbo) when it is
  installed, else Pillow; `backend="pillow"` forces Pillow.
- `resize(size)`: an int resizes the shorter side to `size`, keeping the aspect ratio
  (torchvision's `Resize(int)`); `(h, w)` resizes to exactly that.
- `center_crop(size)`, `random_resized_crop(size, scale=(0.08, 1.0), ratio=(3/4, 4/3))`
  (torchvision's algorithm), `flip(p=0.5)` (horizontal).
- `to_float()`: uint8 -> float32 in [0, 1] (torchvision's `ToTensor` scaling).
- `normalize(mean, std)`: float32 `(x - mean) / std` per channel, in the [0, 1] units of
  `to_float` (a uint8 image is scaled by 1/255 first, as `ToTensor` + `Normalize` do).

The geometric steps (resize, crops) work on uint8 images (before `to_float` and
`normalize`); every sample must come out with the same shape, so a pipeline whose
input sizes vary needs a resize or a crop. The result is uint8 without `to_float` and
`normalize`, float32 with them, laid out `layout="CHW"` (n, C, H, W), what PyTorch
expects, or `"HWC"` (n, H, W, C), what TensorFlow and JAX expect. Without a `decode`
step the input field must hold decoded uint8 images, (n, H, W) or (n, H, W, C).

**Randomness.** Each sample's random draws come from a generator seeded with
(seed, epoch, sample id): `seed` is the pipeline's `seed=` or, by default, the spec's
seed, and the epoch is the one of the batch (`dmdask.transform_context()`). So the
augmentations are fresh every epoch, yet identical for a sample of a given epoch
whatever the number of ranks and workers, the batch it lands in, or a resume
mid-epoch. Called outside dmdask (say on a batch of your own), a pipeline uses epoch
0 unless given `pipe(batch, epoch=e)`.

A pipeline is picklable and holds no state between calls; the workers need Pillow
(the `images` extra: `pip install "dmdask[images]"`, which adds simplejpeg).
"""
from __future__ import annotations

import io
import math
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from .spec import transform_context

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LAYOUTS = ("CHW", "HWC")
Size = Union[int, Tuple[int, int]]


# -- steps ------------------------------------------------------------------------------
class Step:
    """One step of a pipeline, applied to one sample: an (H, W, C) array in, one out.

    random: the step draws from the sample's generator. batched: the step may instead
    run once on the stacked (n, H, W, C) batch (pointwise, no randomness)."""

    name = "step"  # the function that makes it, for repr
    random = False
    batched = False

    def __call__(self, image: np.ndarray, rng: Optional[np.random.Generator]) -> np.ndarray:
        raise NotImplementedError

    def on_batch(self, images: np.ndarray) -> np.ndarray:
        return self(images, None)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{self.name}({args})"


class Decode(Step):
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
            image = _simplejpeg(data, self.mode)
            if image is not None:
                return image
        return _pillow_decode(data, self.mode)


def _simplejpeg(data: np.ndarray, mode: str) -> Optional[np.ndarray]:
    try:
        import simplejpeg
    except ImportError:
        return None
    try:
        return simplejpeg.decode_jpeg(data, colorspace="GRAY" if mode == "L" else "RGB")
    except ValueError:  # what libjpeg-turbo cannot do (CMYK, ...): Pillow tries
        return None


def _pillow_decode(data: np.ndarray, mode: str) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data.tobytes())) as img:
        out = np.asarray(img.convert(mode))
    return out[:, :, None] if out.ndim == 2 else out


class Resize(Step):
    name = "resize"
    def __init__(self, size: Size, interpolation: str = "bilinear"):
        self.size, self.interpolation = _size(size, "resize", allow_int=True), interpolation
        _resample(interpolation)

    def __call__(self, image, rng=None):
        h, w = image.shape[:2]
        if isinstance(self.size, int):  # the shorter side becomes `size`
            if h <= w:
                out = (self.size, int(self.size * w / h))
            else:
                out = (int(self.size * h / w), self.size)
        else:
            out = self.size
        return _resized(image, out, (0, 0, w, h), self.interpolation)


class CenterCrop(Step):
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
    name = "random_resized_crop"
    random = True

    def __init__(self, size: Size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), interpolation: str = "bilinear"):
        self.size = _size(size, "random_resized_crop")
        self.scale, self.ratio = tuple(float(s) for s in scale), tuple(float(r) for r in ratio)
        if not (0 < self.scale[0] <= self.scale[1] and 0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"random_resized_crop: scale and ratio must be increasing positive pairs, got "
                             f"{self.scale}, {self.ratio}")
        self.interpolation = interpolation
        _resample(interpolation)

    def box(self, height: int, width: int, rng: np.random.Generator) -> Tuple[int, int, int, int]:
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
        return _resized(image, self.size, (left, top, left + w, top + h), self.interpolation)


class Flip(Step):
    name = "flip"
    random = True

    def __init__(self, p: float = 0.5):
        if not 0 <= p <= 1:
            raise ValueError(f"flip(p=...) is a probability in [0, 1], not {p!r}")
        self.p = float(p)

    def __call__(self, image, rng):
        return image[:, ::-1] if rng.random() < self.p else image


class ToFloat(Step):
    name = "to_float"
    batched = True

    def __call__(self, image, rng=None):
        if image.dtype == np.uint8:
            return image.astype(np.float32) * np.float32(1 / 255)
        return image.astype(np.float32, copy=False)


class Normalize(Step):
    name = "normalize"
    batched = True

    def __init__(self, mean: Union[float, Sequence[float]] = IMAGENET_MEAN,
                 std: Union[float, Sequence[float]] = IMAGENET_STD):
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


def decode(mode: str = "RGB", backend: str = "auto") -> Decode:
    """Image file bytes -> (H, W, 3) uint8 ("RGB") or (H, W, 1) ("L"); JPEGs through
    simplejpeg when installed (`backend="auto"`), everything else through Pillow."""
    return Decode(mode, backend)


def resize(size: Size, interpolation: str = "bilinear") -> Resize:
    """int: the shorter side to `size`, keeping the aspect ratio; (h, w): exactly that."""
    return Resize(size, interpolation)


def center_crop(size: Size) -> CenterCrop:
    """The central (h, w) (or size x size) region, zero-padded if the image is smaller."""
    return CenterCrop(size)


def random_resized_crop(size: Size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                        interpolation: str = "bilinear") -> RandomResizedCrop:
    """A random region of `scale` of the area and `ratio` of aspect, resized to `size`
    (torchvision's `RandomResizedCrop`)."""
    return RandomResizedCrop(size, scale, ratio, interpolation)


def flip(p: float = 0.5) -> Flip:
    """Mirror left-right with probability `p`."""
    return Flip(p)


def to_float() -> ToFloat:
    """uint8 -> float32 in [0, 1]."""
    return ToFloat()


def normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD) -> Normalize:
    """float32 (x - mean) / std per channel, mean and std in [0, 1] units (one value or
    one per channel)."""
    return Normalize(mean, std)


# -- the batch transform --------------------------------------------------------------
class Pipeline:
    """A batch transform applying `steps` to each sample of `batch[field]` and putting
    the stacked result in `batch[out]` (see the module docstring)."""

    def __init__(self, *steps: Step, field: str = "data", out: str = "image", layout: str = "CHW",
                 seed: Optional[int] = None):
        if not steps or not all(isinstance(s, Step) for s in steps):
            raise TypeError("pipeline() takes steps such as images.decode(), images.flip() (at least one)")
        if any(isinstance(s, Decode) for s in steps[1:]):
            raise ValueError("decode() must be the first step of a pipeline")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None (the spec's seed), not {seed!r}")
        self.steps, self.field, self.out, self.layout = tuple(steps), field, out, layout
        self.seed = None if seed is None else int(seed)
        # the trailing pointwise steps run once on the stacked batch
        tail = len(self.steps)
        while tail > 0 and self.steps[tail - 1].batched:
            tail -= 1
        self._per_sample, self._on_batch = self.steps[:tail], self.steps[tail:]
        self._random = any(s.random for s in self._per_sample)

    def __call__(self, batch: dict, epoch: Optional[int] = None) -> dict:
        context = transform_context()
        if epoch is None:
            epoch = context.epoch if context is not None else 0
        seed = self.seed if self.seed is not None else context.seed if context is not None else 0
        if self.field not in batch:
            raise KeyError(f"the batch has no field {self.field!r} (fields: {sorted(batch)}); "
                           "pass pipeline(..., field=NAME)")
        values, ids = batch[self.field], np.asarray(batch["index"])
        samples = []
        for i in range(len(ids)):
            rng = np.random.default_rng([seed, int(epoch), int(ids[i])]) if self._random else None
            image = values[i]
            if not isinstance(self.steps[0], Decode):
                image = _as_image(image)
            for step in self._per_sample:
                image = step(image, rng)
            samples.append(image)
        shapes = {s.shape for s in samples}
        if len(shapes) > 1:
            raise ValueError(f"the samples of a batch came out of the pipeline with different shapes "
                             f"{sorted(shapes)[:4]}: end it with a resize((h, w)), center_crop or "
                             "random_resized_crop to give them one size")
        if samples:
            images = np.stack(samples)
        else:
            images = np.zeros((0, 0, 0, 0), dtype=np.uint8)
        for step in self._on_batch:
            images = step.on_batch(images)
        if self.layout == "CHW":
            images = images.transpose(0, 3, 1, 2)
        out = {k: v for k, v in batch.items() if k != self.field}
        out[self.out] = np.ascontiguousarray(images)
        return out

    def __repr__(self) -> str:
        return (f"pipeline({', '.join(map(repr, self.steps))}, field={self.field!r}, out={self.out!r}, "
                f"layout={self.layout!r}, seed={self.seed!r})")


def pipeline(*steps: Step, field: str = "data", out: str = "image", layout: str = "CHW",
             seed: Optional[int] = None) -> Pipeline:
    """A batch transform for `Spec.transform`: `steps` applied to each sample of
    `batch[field]`, the results stacked into `batch[out]` ((n, C, H, W) for
    layout="CHW", (n, H, W, C) for "HWC"), `field` dropped, the other fields kept.
    seed: of the augmentations (None: the spec's seed)."""
    return Pipeline(*steps, field=field, out=out, layout=layout, seed=seed)


def train_pipeline(size: Size, mean=IMAGENET_MEAN, std=IMAGENET_STD, scale=(0.08, 1.0), hflip: bool = True,
                   mode: str = "RGB", **kwargs) -> Pipeline:
    """torchvision's ImageNet training recipe: decode, random_resized_crop(size, scale),
    flip() (if hflip), normalize(mean, std) (to_float() only with mean=None).
    kwargs: field, out, layout, seed of `pipeline`."""
    steps = [decode(mode), random_resized_crop(size, scale=scale)] + ([flip()] if hflip else [])
    return pipeline(*steps, _finish(mean, std), **kwargs)


def eval_pipeline(size: Size, resize_to: Optional[Size] = None, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                  mode: str = "RGB", **kwargs) -> Pipeline:
    """torchvision's ImageNet evaluation recipe: decode, resize(resize_to; default
    size * 256 / 224 on the shorter side), center_crop(size), normalize(mean, std)."""
    if resize_to is None:
        short = size if isinstance(size, int) else min(size)
        resize_to = int(round(short * 256 / 224))
    return pipeline(decode(mode), resize(resize_to), center_crop(size), _finish(mean, std), **kwargs)


def _finish(mean, std) -> Step:
    return to_float() if mean is None else normalize(mean, IMAGENET_STD if std is None else std)


# -- helpers ----------------------------------------------------------------------------
def _size(size, what: str, allow_int: bool = False):
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool) and size > 0:
        return int(size) if allow_int else (int(size), int(size))
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(
            isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s > 0 for s in size):
        return (int(size[0]), int(size[1]))
    raise ValueError(f"{what}: size is a positive int or a (height, width) pair, not {size!r}")


_RESAMPLE = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")


def _resample(name: str):
    if name not in _RESAMPLE:
        raise ValueError(f"interpolation must be one of {_RESAMPLE}, not {name!r}")
    from PIL import Image

    return getattr(Image.Resampling, name.upper())


def _resized(image: np.ndarray, size: Tuple[int, int], box, interpolation: str) -> np.ndarray:
    """The `box` (left, top, right, bottom) of an (H, W, C) uint8 image resized to (h, w)."""
    from PIL import Image

    if image.dtype != np.uint8:
        raise TypeError(f"resize and crop steps work on uint8 images, got {image.dtype}: put them before "
                        "to_float() and normalize()")
    h, w = size
    resample = _resample(interpolation)
    channels = image.shape[2]
    if channels in (1, 3, 4):
        src = Image.fromarray(np.ascontiguousarray(image[:, :, 0] if channels == 1 else image))
        out = np.asarray(src.resize((w, h), resample=resample, box=box))
        return out[:, :, None] if out.ndim == 2 else out
    planes = [np.asarray(Image.fromarray(np.ascontiguousarray(image[:, :, c])).resize((w, h), resample, box))
              for c in range(channels)]
    return np.stack(planes, axis=-1)


def _as_image(value) -> np.ndarray:
    """A decoded sample as (H, W, C)."""
    image = np.asarray(value)
    if image.ndim == 2:
        return image[:, :, None]
    if image.ndim == 3:
        return image
    raise TypeError(f"a pipeline without decode() takes decoded images of shape (H, W) or (H, W, C), got "
                    f"{image.dtype} of shape {image.shape}; for the bytes of image files start with decode()")
