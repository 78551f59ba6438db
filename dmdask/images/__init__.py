"""Ready batch transforms for images: decode, crop, flip and normalise on the workers
(docs/quickstart.md, "Images", describes each step, the pipeline and its randomness).

A pipeline's random draws depend on (seed, epoch, sample id) only, not on the ranks, the
workers, the batch or a resume; it is picklable and holds no state between calls.
"""
from .transform import LAYOUTS, Pipeline, eval_pipeline, pipeline, train_pipeline
from .steps import (IMAGENET_MEAN, IMAGENET_STD, CenterCrop, Decode, Flip, Normalize, RandomResizedCrop, Resize,
                    Size, Step, ToFloat, center_crop, decode, flip, normalize, random_resized_crop, resize, to_float)

__all__ = [
    "IMAGENET_MEAN", "IMAGENET_STD", "LAYOUTS", "CenterCrop", "Decode", "Flip", "Normalize", "Pipeline",
    "RandomResizedCrop", "Resize", "Size", "Step", "ToFloat", "center_crop", "decode", "eval_pipeline", "flip",
    "normalize", "pipeline", "random_resized_crop", "resize", "to_float", "train_pipeline",
]
