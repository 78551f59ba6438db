"""`Pipeline` (`pipeline`): image steps as a batch transform for `Spec.transform`, and the two ImageNet recipes."""
from __future__ import annotations

import numpy as np

from ..spec import transform_context
from .steps import (IMAGENET_MEAN, IMAGENET_STD, Decode, Size, Step, center_crop, decode, flip, normalize,
                    random_resized_crop, resize, to_float)

LAYOUTS = ("CHW", "HWC")


class Pipeline:
    """A batch transform for `Spec.transform`: `steps` applied to each sample of
    `batch[field]`, the results stacked into `batch[out]` ((n, C, H, W) for
    layout="CHW", (n, H, W, C) for "HWC"), `field` dropped, the other fields kept.
    seed: of the augmentations (None: the spec's seed)."""

    def __init__(self, *steps: Step, field: str = "data", out: str = "image", layout: str = "CHW",
                 seed: int | None = None):
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

    def __call__(self, batch: dict, epoch: int | None = None) -> dict:
        """epoch: of the random draws (None: the batch's, `dmdask.transform_context()`; 0 outside dmdask)."""
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
        images = np.stack(samples) if samples else np.zeros((0, 0, 0, 0), dtype=np.uint8)
        for step in self._on_batch:
            images = step(images, None)
        if self.layout == "CHW":
            images = images.transpose(0, 3, 1, 2)
        out = {k: v for k, v in batch.items() if k != self.field}
        out[self.out] = np.ascontiguousarray(images)
        return out

    def __repr__(self) -> str:
        return (f"pipeline({', '.join(map(repr, self.steps))}, field={self.field!r}, out={self.out!r}, "
                f"layout={self.layout!r}, seed={self.seed!r})")


def _as_image(value) -> np.ndarray:
    """A decoded sample as (H, W, C)."""
    image = np.asarray(value)
    if image.ndim == 2:
        return image[:, :, None]
    if image.ndim == 3:
        return image
    raise TypeError(f"a pipeline without decode() takes decoded images of shape (H, W) or (H, W, C), got "
                    f"{image.dtype} of shape {image.shape}; for the bytes of image files start with decode()")


pipeline = Pipeline  # the documented name


def train_pipeline(size: Size, mean=IMAGENET_MEAN, std=IMAGENET_STD, scale=(0.08, 1.0), hflip: bool = True,
                   mode: str = "RGB", **kwargs) -> Pipeline:
    """torchvision's ImageNet training recipe: decode, random_resized_crop(size, scale),
    flip() (if hflip), normalize(mean, std) (to_float() only with mean=None).
    kwargs: field, out, layout, seed of `pipeline`."""
    steps = [decode(mode), random_resized_crop(size, scale=scale)] + ([flip()] if hflip else [])
    return pipeline(*steps, _finish(mean, std), **kwargs)


def eval_pipeline(size: Size, resize_to: Size | None = None, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                  mode: str = "RGB", **kwargs) -> Pipeline:
    """torchvision's ImageNet evaluation recipe: decode, resize(resize_to; default
    size * 256 / 224 on the shorter side), center_crop(size), normalize(mean, std)."""
    if resize_to is None:
        short = size if isinstance(size, int) else min(size)
        resize_to = int(round(short * 256 / 224))
    return pipeline(decode(mode), resize(resize_to), center_crop(size), _finish(mean, std), **kwargs)


def _finish(mean, std) -> Step:
    return to_float() if mean is None else normalize(mean, IMAGENET_STD if std is None else std)
