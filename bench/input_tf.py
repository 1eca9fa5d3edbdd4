"""The tf.data side of bench/input_pipeline.sh, and the shards it reads.

  make  --output=DIR --images=N --shards=S
      N distinct JPEGs of 500x375 (or 375x500, one in four) cut from
      scikit-image's bundled color photographs: a random crop of 35-100% of
      the photo's shorter side, aspect ratio of the output, flipped half the
      time, resized with PIL (bicubic) and encoded at quality 90 (4:2:0);
      written by tf.io.TFRecordWriter as tf.Examples with image/encoded,
      image/class/label (the source photo), image/height, image/width,
      image/format, into DIR/train-SSSSS-of-NNNNN.
  run   --files=GLOB --recipe=fused|fused_tv|naive|center --batches=K
      images/s (and CPU ms of the process per image) of tf.data over the shards, batches of 64 of 224x224x3 floats
      in [0, 1], after one warm-up batch:
        fused:  sample_distorted_bounding_box (area 0.08-1, ratio 3/4-4/3,
                as the usual ImageNet recipe) + decode_and_crop_jpeg;
        fused_tv: the window drawn as psflow's augment draws it (torchvision's
                RandomResizedCrop: area uniform in 0.08-1, log-uniform ratio),
                whose windows are larger on average, + decode_and_crop_jpeg;
        naive:  decode_jpeg of the whole image, then the crop of fused;
        center: decode_jpeg, shorter side to 256 (bilinear), central 224.
      fused and naive then resize to 224 (bilinear) and flip half the
      images. Records go through shuffle(1000) and repeat() first, as psflow's
      shuffle buffer and epochs; map runs with num_parallel_calls=AUTOTUNE,
      then batch(64) and prefetch(AUTOTUNE).
  profile --files=GLOB
      ms per image of parse, decode_and_crop_jpeg (INTEGER_ACCURATE, as
      psflow decodes, and TF's default) and resize + flip + scale, on one
      thread, eager, with psflow's window draw.
"""

import argparse
import glob
import io
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SIDE = 224
PHOTOS = ["astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry",
          "stereo_motorcycle", "hubble_deep_field", "retina"]


def photos():
    """The color photographs scikit-image ships (a name missing here is skipped)."""
    import skimage.data
    out = []
    for name in PHOTOS:
        try:
            a = getattr(skimage.data, name)()
        except Exception as e:  # a photo another version lacks or fetches
            print(f"skipping skimage.data.{name}: {e}", file=sys.stderr)
            continue
        a = a[0] if isinstance(a, tuple) else a
        if a.ndim == 3 and a.shape[2] >= 3:
            out.append((name, a[:, :, :3]))
    return out


def make(args):
    import numpy as np
    import tensorflow as tf
    from PIL import Image
    srcs = photos()
    rng = np.random.default_rng(args.seed)
    os.makedirs(args.output, exist_ok=True)
    per_shard = -(-args.images // args.shards)
    total_bytes = 0
    for s in range(args.shards):
        path = os.path.join(args.output, f"train-{s:05d}-of-{args.shards:05d}")
        with tf.io.TFRecordWriter(path) as w:
            for i in range(s * per_shard, min(args.images, (s + 1) * per_shard)):
                label = i % len(srcs)
                src = srcs[label][1]
                h, w_ = src.shape[:2]
                out_w, out_h = (375, 500) if rng.random() < 0.25 else (500, 375)
                # The crop: its height a random part of what fits at the output's ratio.
                fit_h = min(h, w_ * out_h / out_w)
                ch = fit_h * rng.uniform(0.35, 1.0)
                cw = ch * out_w / out_h
                y, x = rng.uniform(0, h - ch), rng.uniform(0, w_ - cw)
                im = Image.fromarray(src).crop((x, y, x + cw, y + ch)).resize(
                    (out_w, out_h), Image.BICUBIC)
                if rng.random() < 0.5:
                    im = im.transpose(Image.FLIP_LEFT_RIGHT)
                buf = io.BytesIO()
                im.save(buf, format="JPEG", quality=90)
                data = buf.getvalue()
                total_bytes += len(data)
                f = tf.train.Feature
                ex = tf.train.Example(features=tf.train.Features(feature={
                    "image/encoded": f(bytes_list=tf.train.BytesList(value=[data])),
                    "image/format": f(bytes_list=tf.train.BytesList(value=[b"JPEG"])),
                    "image/class/label": f(int64_list=tf.train.Int64List(value=[label])),
                    "image/height": f(int64_list=tf.train.Int64List(value=[out_h])),
                    "image/width": f(int64_list=tf.train.Int64List(value=[out_w])),
                }))
                w.write(ex.SerializeToString())
    print(f"{args.images} JPEGs from {len(srcs)} photos ({', '.join(n for n, _ in srcs)}), "
          f"{args.shards} shards, {total_bytes / args.images / 1024:.1f} KiB per image")


def torchvision_window(data):
    import numpy as np
    import tensorflow as tf
    # torchvision's RandomResizedCrop.get_params, as psflow draws it: 10
    # tries of an area uniform in [0.08, 1] and a log-uniform ratio, the
    # first that fits; else the whole image's central crop, its ratio
    # clamped to [3/4, 4/3].
    shape = tf.cast(tf.io.extract_jpeg_shape(data)[:2], tf.float32)
    h, w = shape[0], shape[1]
    area = h * w * tf.random.uniform([10], 0.08, 1.0)
    ratio = tf.exp(tf.random.uniform([10], np.log(3 / 4), np.log(4 / 3)))
    cw, ch = tf.round(tf.sqrt(area * ratio)), tf.round(tf.sqrt(area / ratio))
    fits = (cw > 0) & (ch > 0) & (cw <= w) & (ch <= h)
    first = tf.argmax(tf.cast(fits, tf.int32))
    r = tf.clip_by_value(w / h, 3 / 4, 4 / 3)
    fw = tf.where(w / h > 4 / 3, tf.round(h * r), w)
    fh = tf.where(w / h < 3 / 4, tf.round(w / r), h)
    cw = tf.where(tf.reduce_any(fits), cw[first], fw)
    ch = tf.where(tf.reduce_any(fits), ch[first], fh)
    y = tf.floor(tf.random.uniform([]) * (h - ch + 1))
    x = tf.floor(tf.random.uniform([]) * (w - cw + 1))
    return tf.cast(tf.stack([y, x, ch, cw]), tf.int32)


def dataset(files, recipe, batch):
    import tensorflow as tf
    spec = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
            "image/class/label": tf.io.FixedLenFeature([], tf.int64)}

    def crop_window(data):
        shape = tf.io.extract_jpeg_shape(data)
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            shape, bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
            min_object_covered=0.1, aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0),
            max_attempts=10, use_image_if_no_bounding_boxes=True)
        return begin, size

    def augment_tail(image):
        image = tf.image.resize(image, [SIDE, SIDE], method="bilinear")
        return tf.image.random_flip_left_right(image) / 255.0

    def fused(record):
        ex = tf.io.parse_single_example(record, spec)
        begin, size = crop_window(ex["image/encoded"])
        window = tf.stack([begin[0], begin[1], size[0], size[1]])
        image = tf.image.decode_and_crop_jpeg(ex["image/encoded"], window, channels=3)
        return augment_tail(image), ex["image/class/label"]

    def fused_tv(record):
        ex = tf.io.parse_single_example(record, spec)
        window = torchvision_window(ex["image/encoded"])
        image = tf.image.decode_and_crop_jpeg(ex["image/encoded"], window, channels=3)
        return augment_tail(image), ex["image/class/label"]

    def naive(record):
        ex = tf.io.parse_single_example(record, spec)
        image = tf.io.decode_jpeg(ex["image/encoded"], channels=3)
        begin, size = crop_window(ex["image/encoded"])
        return augment_tail(tf.slice(image, begin, size)), ex["image/class/label"]

    def center(record):
        ex = tf.io.parse_single_example(record, spec)
        image = tf.io.decode_jpeg(ex["image/encoded"], channels=3)
        hw = tf.cast(tf.shape(image)[:2], tf.float32)
        scale = 256.0 / tf.reduce_min(hw)
        image = tf.image.resize(image, tf.cast(tf.round(hw * scale), tf.int32), method="bilinear")
        image = tf.image.resize_with_crop_or_pad(image, SIDE, SIDE)
        return image / 255.0, ex["image/class/label"]

    fn = {"fused": fused, "fused_tv": fused_tv, "naive": naive, "center": center}[recipe]
    return (tf.data.TFRecordDataset(files).shuffle(1000, seed=1).repeat()
            .map(fn, num_parallel_calls=tf.data.AUTOTUNE).batch(batch)
            .prefetch(tf.data.AUTOTUNE))


def run(args):
    import tensorflow as tf
    files = sorted(glob.glob(args.files))
    it = iter(dataset(files, args.recipe, args.batch))
    images, _ = next(it)  # warm-up: fills the shuffle buffer, starts the threads
    assert images.shape == (args.batch, SIDE, SIDE, 3), images.shape
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.batches):
        images, _ = next(it)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(f"tf.data recipe={args.recipe} batch={args.batch} batches={args.batches} "
          f"images_per_s={args.batches * args.batch / seconds:.1f} "
          f"cpu_ms_per_image={cpu * 1e3 / (args.batches * args.batch):.3f} (TensorFlow {tf.__version__}, "
          f"{tf.config.threading.get_inter_op_parallelism_threads() or 'default'} inter-op threads)")


def profile(args):
    """One thread: ms per image of each stage, on the same window draw as psflow."""
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    files = sorted(glob.glob(args.files))
    spec = {"image/encoded": tf.io.FixedLenFeature([], tf.string)}
    records = [r for r in tf.data.TFRecordDataset(files[:1]).take(args.images)]
    # process_time: with one intra- and one inter-op thread, the CPU of this
    # image's ops, which holds when other work shares the cores.
    t = time.process_time()
    data = [tf.io.parse_single_example(r, spec)["image/encoded"] for r in records]
    parse = time.process_time() - t
    windows = [torchvision_window(d) for d in data]
    line = f"tf profile images={len(data)} cpu_ms_per_image: parse={parse * 1e3 / len(data):.3f}"
    for dct in ("INTEGER_ACCURATE", ""):
        t = time.process_time()
        crops = [tf.image.decode_and_crop_jpeg(d, w, channels=3, dct_method=dct)
                 for d, w in zip(data, windows)]
        line += f" decode({dct or 'default'})={(time.process_time() - t) * 1e3 / len(data):.3f}"
    t = time.process_time()
    for c in crops:
        tf.image.random_flip_left_right(tf.image.resize(c, [SIDE, SIDE])) / 255.0
    line += f" resize+flip+scale={(time.process_time() - t) * 1e3 / len(data):.3f}"
    area = np.mean([int(w[2]) * int(w[3]) for w in windows])
    print(line + f" (eager, each op's dispatch included; window {area:.0f} pixels on average)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("--output", required=True)
    m.add_argument("--images", type=int, default=2000)
    m.add_argument("--shards", type=int, default=8)
    m.add_argument("--seed", type=int, default=1)
    r = sub.add_parser("run")
    r.add_argument("--files", required=True, help="a glob of the shards")
    r.add_argument("--recipe", choices=["fused", "fused_tv", "naive", "center"], default="fused")
    r.add_argument("--batch", type=int, default=64)
    r.add_argument("--batches", type=int, default=40)
    f = sub.add_parser("profile")
    f.add_argument("--files", required=True, help="a glob of the shards")
    f.add_argument("--images", type=int, default=300)
    args = p.parse_args()
    {"make": make, "run": run, "profile": profile}[args.command](args)


if __name__ == "__main__":
    main()
