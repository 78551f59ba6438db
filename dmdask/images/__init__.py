"""Ready batch transforms for images: decode, crop, flip and normalise on the workers
(docs/quickstart.md, "Images", describes each step and option).

A pipeline is a `Spec.transform`: it replaces the file bytes of each sample (field "data")
by one fixed-size array in field "image"; the other fields pass through. Each sample's
random draws come from a generator seeded with (seed, epoch, sample id): fresh every
epoch, yet the same for a sample of a given epoch whatever the number of ranks and
workers, the batch it lands in, or a resume mid-epoch. A pipeline is picklable and
holds no state between calls; the workers need Pillow (`pip install "dmdask[images]"`).
"""
from .transform import LAYOUTS, Pipeline, eval_pipeline, pipeline, train_pipeline
from .steps import (IMAGENET_MEAN, IMAGENET_STD, CenterCrop, Decode, Flip, Normalize, RandomResizedCrop, Resize,
                    Size, Step, ToFloat, center_crop, decode, flip, normalize, random_resized_crop, resize, to_float)

__all__ = [
    "IMAGENET_MEAN", "IMAGENET_STD", "LAYOUTS", "CenterCrop", "Decode", "Flip", "Normalize", "Pipeline",
    "RandomResizedCrop", "Resize", "Size", "Step", "ToFloat", "center_crop", "decode", "eval_pipeline", "flip",
    "normalize", "pipeline", "random_resized_crop", "resize", "to_float", "train_pipeline",
]
