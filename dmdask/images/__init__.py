"""Ready batch transforms for images: decode, crop, flip and normalise on the workers.

A pipeline is a `Spec.transform`: it takes a batch whose field "data" holds the file
bytes of each sample (a folder source) and returns the batch with one fixed-size array
in field "image" instead, the other fields ("label", "index") unchanged::

    from dmdask import images

    train = images.pipeline(images.decode(), images.random_resized_crop(224), images.flip(),
                            images.normalize(images.IMAGENET_MEAN, images.IMAGENET_STD))
    spec = dmdask.Spec("/data/train", batch_size=256, transform=train)
    # batch: {"image": float32 (n, 3, 224, 224), "label": int64 (n,), "index": int64 (n,)}

    train = images.train_pipeline(224)   # torchvision's ImageNet training recipe
    test = images.eval_pipeline(224)     # and its evaluation recipe

Each step and option is described in docs/quickstart.md ("Images"). Each sample's
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
