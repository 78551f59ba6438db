"""dmdask.images: decoding against Pillow, shapes and dtypes, per-(seed, epoch, sample)
determinism, resume, and pipelines run by real workers through Spec.transform."""
import io
import os
import pickle

import numpy as np
import pytest
from PIL import Image

import dmdask
from dmdask import images
from dmdask.spec import TransformContext, using_context


def picture(i: int, h: int, w: int) -> np.ndarray:
    """An (h, w, 3) uint8 image with structure (so crops and flips show)."""
    rng = np.random.default_rng(i)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(1, w - 1)), (yy * 255 // max(1, h - 1)), (xx + yy + 7 * i) % 256], -1)
    return np.clip(base + rng.integers(-20, 20, size=(h, w, 3)), 0, 255).astype(np.uint8)


def encode(array: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def as_field(files) -> np.ndarray:
    """What a folder source's "data" field holds: an object array of uint8 arrays."""
    out = np.empty(len(files), dtype=object)
    out[:] = [np.frombuffer(f, dtype=np.uint8) for f in files]
    return out


def batch_of(files, ids=None) -> dict:
    ids = np.arange(len(files), dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    return {"data": as_field(files), "label": ids % 3, "index": ids}


def write_image_folder(root, classes=3, per_class=12, fmt="PNG") -> dict:
    """Class folders of images of varying sizes; returns sample id -> file bytes."""
    files, i = {}, 0
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class-{c:02d}"), exist_ok=True)
        for j in range(per_class):
            data = encode(picture(i, 20 + (i % 5) * 3, 24 + (i % 4) * 5), fmt)
            with open(os.path.join(root, f"class-{c:02d}", f"{j:04d}.{fmt.lower()}"), "wb") as f:
                f.write(data)
            files[i] = data
            i += 1
    return files


# -- decoding --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_decode_png_is_exactly_pillow(mode):
    data = encode(picture(3, 17, 23), "PNG")
    got = images.decode(mode)(np.frombuffer(data, np.uint8))
    want = np.asarray(Image.open(io.BytesIO(data)).convert(mode))
    assert got.dtype == np.uint8 and got.shape == (17, 23, 3 if mode == "RGB" else 1)
    np.testing.assert_array_equal(got.reshape(want.shape), want)


@pytest.mark.parametrize("backend", ["auto", "pillow"])
def test_decode_jpeg_matches_pillow(backend):
    data = encode(picture(5, 32, 48), "JPEG")
    got = images.decode(backend=backend)(np.frombuffer(data, np.uint8))
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert got.shape == want.shape == (32, 48, 3) and got.dtype == np.uint8
    if backend == "pillow":
        np.testing.assert_array_equal(got, want)
    else:  # simplejpeg (libjpeg-turbo) may round a few pixels differently from Pillow's libjpeg
        assert np.abs(got.astype(int) - want).max() <= 3


def test_decode_refuses_decoded_input():
    with pytest.raises(TypeError, match="leave decode"):
        images.decode()(np.zeros((4, 4, 3), np.uint8))


# -- shapes and dtypes -----------------------------------------------------------------
def test_pipeline_shapes_dtypes_and_fields():
    files = [encode(picture(i, 20 + i, 30 - i), "PNG") for i in range(5)]
    batch = batch_of(files)
    chw = images.pipeline(images.decode(), images.random_resized_crop(16), images.flip(),
                          images.normalize(images.IMAGENET_MEAN, images.IMAGENET_STD))(batch)
    assert set(chw) == {"image", "label", "index"}
    assert chw["image"].shape == (5, 3, 16, 16) and chw["image"].dtype == np.float32
    assert chw["image"].flags.c_contiguous
    np.testing.assert_array_equal(chw["label"], batch["label"])
    hwc = images.pipeline(images.decode(), images.resize((12, 10)), layout="HWC")(batch)
    assert hwc["image"].shape == (5, 12, 10, 3) and hwc["image"].dtype == np.uint8
    gray = images.pipeline(images.decode("L"), images.center_crop(8), images.to_float(), out="x")(batch)
    assert gray["x"].shape == (5, 1, 8, 8) and gray["x"].dtype == np.float32
    assert 0 <= gray["x"].min() and gray["x"].max() <= 1


def test_steps_match_their_definitions():
    img = picture(1, 20, 30)
    data = encode(img, "PNG")
    batch = batch_of([data])
    # no augmentation: decode + to_float is the image / 255, CHW
    out = images.pipeline(images.decode(), images.to_float())(batch)["image"][0]
    np.testing.assert_allclose(out, img.transpose(2, 0, 1) / 255, atol=1e-6)
    # normalize = (x / 255 - mean) / std per channel
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)
    out = images.pipeline(images.decode(), images.normalize(mean, std), layout="HWC")(batch)["image"][0]
    np.testing.assert_allclose(out, (img / 255 - np.array(mean)) / np.array(std), atol=1e-5)
    # flip(p=1) mirrors, flip(p=0) does not
    out = images.pipeline(images.decode(), images.flip(1.0), layout="HWC")(batch)["image"][0]
    np.testing.assert_array_equal(out, img[:, ::-1])
    out = images.pipeline(images.decode(), images.flip(0.0), layout="HWC")(batch)["image"][0]
    np.testing.assert_array_equal(out, img)
    # resize(int) sets the shorter side, center_crop takes the middle
    out = images.pipeline(images.decode(), images.resize(10), layout="HWC")(batch)["image"][0]
    assert out.shape == (10, 15, 3)
    out = images.pipeline(images.decode(), images.center_crop((10, 12)), layout="HWC")(batch)["image"][0]
    np.testing.assert_array_equal(out, img[5:15, 9:21])


def test_random_resized_crop_boxes_stay_in_range():
    crop = images.random_resized_crop(8, scale=(0.25, 0.5), ratio=(0.5, 2.0))
    rng = np.random.default_rng(0)
    for _ in range(500):
        top, left, h, w = crop.box(40, 60, rng)
        assert 0 <= top and top + h <= 40 and 0 <= left and left + w <= 60
        assert 0.2 <= h * w / 2400 <= 0.55 and 0.4 <= w / h <= 2.5


def test_varying_output_shapes_are_refused():
    batch = batch_of([encode(picture(i, 10 + i, 10), "PNG") for i in range(2)])
    with pytest.raises(ValueError, match="different shapes"):
        images.pipeline(images.decode())(batch)


def test_presets_and_pickling():
    batch = batch_of([encode(picture(i, 40 + 3 * i, 50), "JPEG") for i in range(4)])
    train = images.train_pipeline(24)
    test = images.eval_pipeline(24)
    assert train(batch)["image"].shape == test(batch)["image"].shape == (4, 3, 24, 24)
    again = pickle.loads(pickle.dumps(train))
    np.testing.assert_array_equal(again(batch, epoch=2)["image"], train(batch, epoch=2)["image"])
    assert "random_resized_crop" in repr(train)


# -- determinism -----------------------------------------------------------------------
AUGMENT = images.pipeline(images.decode(), images.random_resized_crop(12, scale=(0.2, 1.0)), images.flip(),
                          images.to_float())


def test_same_seed_epoch_and_sample_give_the_same_augmentation():
    files = [encode(picture(i, 30, 30), "PNG") for i in range(6)]
    ids = np.array([10, 11, 12, 13, 14, 15])
    a = AUGMENT(batch_of(files, ids), epoch=3)["image"]
    np.testing.assert_array_equal(a, AUGMENT(batch_of(files, ids), epoch=3)["image"])
    # in another batch, at another position: the same sample gets the same crop
    b = AUGMENT(batch_of(files[::-1][:3], ids[::-1][:3]), epoch=3)["image"]
    np.testing.assert_array_equal(b, a[::-1][:3])
    # another epoch, another seed, another sample id: other draws
    assert not np.array_equal(a, AUGMENT(batch_of(files, ids), epoch=4)["image"])
    seeded = images.pipeline(*AUGMENT.steps, seed=9)
    assert not np.array_equal(a, seeded(batch_of(files, ids), epoch=3)["image"])
    assert not np.array_equal(a, AUGMENT(batch_of(files, ids + 100), epoch=3)["image"])


def test_epoch_and_seed_come_from_the_transform_context():
    files = [encode(picture(i, 30, 30), "PNG") for i in range(4)]
    batch = batch_of(files)
    with using_context(TransformContext(epoch=5, seed=2)):
        inside = AUGMENT(batch)["image"]
    np.testing.assert_array_equal(inside, images.pipeline(*AUGMENT.steps, seed=2)(batch, epoch=5)["image"])


# -- on real workers -------------------------------------------------------------------
@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("shared") / "pictures")
    return root, write_image_folder(root)


def test_pipeline_runs_on_the_workers_through_spec_transform(client, image_folder):
    root, files = image_folder
    spec = dmdask.Spec(root, batch_size=8, seed=4, block_size=10, transform=AUGMENT)
    local = images.pipeline(*AUGMENT.steps, seed=4)
    per_epoch = {}
    for epoch in (0, 1):
        got = {}
        for batch in dmdask.batches(client, spec, epoch=epoch):
            assert set(batch) == {"image", "label", "index"}
            assert batch["image"].shape[1:] == (3, 12, 12) and batch["image"].dtype == np.float32
            ids = batch["index"]
            want = local(batch_of([files[int(i)] for i in ids], ids), epoch=epoch)["image"]
            np.testing.assert_array_equal(batch["image"], want)
            got.update({int(i): img for i, img in zip(ids, batch["image"])})
        assert sorted(got) == sorted(files)
        per_epoch[epoch] = got
    changed = sum(not np.array_equal(per_epoch[0][i], per_epoch[1][i]) for i in files)
    assert changed > len(files) // 2  # fresh augmentations every epoch


def test_a_resumed_epoch_sees_the_same_augmentations(client, image_folder):
    root, files = image_folder
    spec = dmdask.Spec(root, batch_size=5, seed=1, block_size=10, transform=AUGMENT, rank=1, world_size=2,
                       prefetch=2)
    full = list(dmdask.batches(client, spec, epoch=2))
    it = dmdask.batches(client, spec, epoch=2)
    first = [next(it) for _ in range(2)]
    state = it.state_dict()
    it.close()
    rest = list(dmdask.batches(client, spec, epoch=2, resume=state))
    assert len(first) + len(rest) == len(full)
    for a, b in zip(first + rest, full):
        np.testing.assert_array_equal(a["index"], b["index"])
        np.testing.assert_array_equal(a["image"], b["image"])


def test_pipeline_failure_is_a_transform_error(client, image_folder):
    root, _ = image_folder
    spec = dmdask.Spec(root, batch_size=8, block_size=10, transform=images.pipeline(images.decode()))
    with pytest.raises(dmdask.TransformError, match="different shapes"):
        list(dmdask.batches(client, spec))
