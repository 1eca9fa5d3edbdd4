"""TFRecord compatibility between psflow and TensorFlow, both ways.

Run by scripts/check-tfrecord-tf.sh in a venv with tensorflow-cpu:
  a. TensorFlow writes tf.Example records (plain and GZIP) with PNG and JPEG
     images, int64, float and bytes features; psflow-data inspect and
     psflow-check-tfrecord read them, and every value must come back exactly:
     PNG pixels equal to the arrays encoded, JPEG pixels equal to TensorFlow's
     own decode with dct_method=INTEGER_ACCURATE (the max difference to its
     default, INTEGER_FAST, is reported).
  b. psflow-data converts the Fashion-MNIST test split (plain and gzip);
     tf.data.TFRecordDataset + parse_single_example + decode_png must give
     every record's pixels and label as the IDX files hold them.
Prints one line per check and a PASS/FAIL summary; exits 1 on any failure.
"""

import argparse
import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

RESULTS = []


def check(name, ok, detail=""):
    RESULTS.append((name, bool(ok)))
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


# ---- a. TensorFlow writes, psflow reads ----------------------------------


def make_records(n):
    """n records as dicts of the values written, with images of known pixels."""
    rng = np.random.default_rng(20261207)
    records = []
    for i in range(n):
        h, w = 17 + 5 * i, 23 + 7 * i
        rgb = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        gray = rng.integers(0, 256, size=(h, w, 1), dtype=np.uint8)
        rgba = rng.integers(0, 256, size=(h, w, 4), dtype=np.uint8)
        # A smooth photo-like picture: JPEG's artefacts stay small, so both
        # decoders are compared on something like real data.
        yy, xx = np.mgrid[0:h * 3, 0:w * 3]
        smooth = np.stack([(xx * 255 // (w * 3)), (yy * 255 // (h * 3)),
                           (xx + yy) * 240 // (h * 3 + w * 3) + 2 * i], axis=-1).astype(np.uint8)
        records.append({
            "rgb": rgb, "gray": gray, "rgba": rgba, "smooth": smooth,
            "png_rgb": tf.io.encode_png(rgb).numpy(),
            "png_gray": tf.io.encode_png(gray).numpy(),
            "png_rgba": tf.io.encode_png(rgba).numpy(),
            "jpeg": tf.io.encode_jpeg(smooth, quality=90).numpy(),
            "label": [i, -7 * i - 1, 2**62 + i, -(2**63)],
            "score": [np.float32(v) for v in (0.1 * i, -3.5e-7, 1e30, 65504.0 + i, -0.0)],
            "text": [f"record {i}".encode(), b"", bytes(range(256))],
            "empty": [],
        })
    return records


def to_example(r):
    f = tf.train.Feature
    feature = {
        "image/png": f(bytes_list=tf.train.BytesList(value=[r["png_rgb"], r["png_gray"]])),
        "image/rgba": f(bytes_list=tf.train.BytesList(value=[r["png_rgba"]])),
        "image/jpeg": f(bytes_list=tf.train.BytesList(value=[r["jpeg"]])),
        "label": f(int64_list=tf.train.Int64List(value=r["label"])),
        "score": f(float_list=tf.train.FloatList(value=r["score"])),
        "text": f(bytes_list=tf.train.BytesList(value=r["text"])),
        "empty": f(int64_list=tf.train.Int64List(value=r["empty"])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature))


def write_tf(path, records, compression):
    options = tf.io.TFRecordOptions(compression_type=compression)
    with tf.io.TFRecordWriter(path, options=options) as w:
        for r in records:
            w.write(to_example(r).SerializeToString())


def check_inspect(bin_dir, path, records, compression):
    out = subprocess.run([os.path.join(bin_dir, "psflow-data"), "inspect", path,
                          f"--records={len(records)}"], capture_output=True, text=True)
    name = f"inspect {os.path.basename(path)}"
    if out.returncode != 0:
        check(name, False, out.stderr.strip())
        return
    text = out.stdout

    def lengths(values):
        return ", ".join(str(len(v)) for v in values)

    def value_s(n):
        return f"{n} value{'' if n == 1 else 's'}"

    missing = []
    for i, r in enumerate(records):
        # inspect sorts by key and shows the lengths of up to 4 bytes values.
        block = "\n".join([
            "  empty: int64_list, 0 values",
            f"  image/jpeg: bytes_list, 1 value ({len(r['jpeg'])} bytes)",
            f"  image/png: bytes_list, 2 values ({lengths([r['png_rgb'], r['png_gray']])} bytes)",
            f"  image/rgba: bytes_list, 1 value ({len(r['png_rgba'])} bytes)",
            f"  label: int64_list, {value_s(len(r['label']))}",
            f"  score: float_list, {value_s(len(r['score']))}",
            f"  text: bytes_list, {value_s(len(r['text']))} ({lengths(r['text'])} bytes)",
        ])
        if not re.search(rf"^record {i} at offset \d+: \d+ bytes\n{re.escape(block)}$", text,
                         re.MULTILINE):
            missing.append(f"record {i}")
    counted = re.search(rf"^records: {len(records)}$", text, re.MULTILINE) is not None
    said = re.search(r"compression (\w+)", text)
    said = said.group(1) if said else "?"
    want = "gzip" if compression == "GZIP" else "none"
    check(name, not missing and counted and said == want,
          f"features of {', '.join(missing)} not as written" if missing else
          f"{'' if counted else 'NOT '}'records: {len(records)}', compression {said} "
          f"(want {want}), every record's keys, types, counts and bytes lengths")
    return text


def pixels(image_json):
    a = np.frombuffer(bytes.fromhex(image_json["pixels"]), dtype=np.uint8)
    return a.reshape(image_json["height"], image_json["width"], image_json["channels"])


def compare_record(got, r):
    """The differences between psflow's reading of a record and what was written."""
    bad = []
    feats = got["features"]
    if feats["label"] != {"type": "int64", "values": r["label"]}:
        bad.append(f"label {feats['label']}")
    floats = [np.float32(s) for s in feats["score"]["values"]]
    if feats["score"]["type"] != "float" or len(floats) != len(r["score"]) or any(
            a.tobytes() != b.tobytes() for a, b in zip(floats, r["score"])):
        bad.append(f"score {feats['score']}")
    if [bytes.fromhex(v) for v in feats["text"]["values"]] != r["text"]:
        bad.append("text")
    if feats["empty"] != {"type": "int64", "values": []}:
        bad.append(f"empty {feats['empty']}")
    stored = {k: [bytes.fromhex(v) for v in feats[k]["values"]]
              for k in ("image/png", "image/rgba", "image/jpeg")}
    if stored != {"image/png": [r["png_rgb"], r["png_gray"]], "image/rgba": [r["png_rgba"]],
                  "image/jpeg": [r["jpeg"]]}:
        bad.append("image bytes")
    png = [pixels(j) for j in got["images"]["image/png"]]
    if not np.array_equal(png[0], r["rgb"]):
        bad.append("RGB PNG pixels")
    if not np.array_equal(png[1], np.repeat(r["gray"], 3, axis=2)):
        bad.append("gray PNG pixels (as RGB)")
    if not np.array_equal(pixels(got["images"]["image/rgba"][0]), r["rgba"][:, :, :3]):
        bad.append("RGBA PNG pixels (alpha dropped)")
    return bad


def jpeg_diffs(got, r):
    """psflow's JPEG pixels minus TensorFlow's, INTEGER_ACCURATE and default."""
    ours = pixels(got["images"]["image/jpeg"][0]).astype(int)
    accurate = tf.io.decode_jpeg(r["jpeg"], channels=3, dct_method="INTEGER_ACCURATE")
    default = tf.io.decode_jpeg(r["jpeg"], channels=3)
    return (np.abs(ours - accurate.numpy().astype(int)).max(),
            np.abs(ours - default.numpy().astype(int)).max(),
            np.abs(ours - r["smooth"].astype(int)).max())


def part_a(bin_dir, work):
    records = make_records(8)
    for compression in ("", "GZIP"):
        path = os.path.join(work, f"tf-written{'-gzip' if compression else ''}.tfrecord")
        write_tf(path, records, compression)
        check_inspect(bin_dir, path, records, compression)
        out = subprocess.run([os.path.join(bin_dir, "psflow-check-tfrecord"), path],
                             capture_output=True, text=True)
        name = f"psflow reads {os.path.basename(path)}"
        if out.returncode != 0:
            check(name, False, out.stderr.strip())
            continue
        got = [json.loads(line) for line in out.stdout.splitlines()]
        want_comp = "gzip" if compression else "none"
        bad = [] if len(got) == len(records) else [f"{len(got)} records, not {len(records)}"]
        for g, r in zip(got, records):
            if g["compression"] != want_comp:
                bad.append(f"record {g['index']}: compression {g['compression']}")
            bad += [f"record {g['index']}: {b}" for b in compare_record(g, r)]
        check(name, not bad, "; ".join(bad[:5]) if bad else
              f"{len(got)} records: int64s, floats (bit for bit), bytes, and PNG pixels "
              "(RGB, gray as RGB, RGBA less alpha) exactly as written")
        diffs = [jpeg_diffs(g, r) for g, r in zip(got, records)] if len(got) == len(records) else []
        if diffs:
            acc, dflt, orig = (max(d[i] for d in diffs) for i in range(3))
            check(f"JPEG pixels of {os.path.basename(path)} vs tf.io.decode_jpeg", acc == 0,
                  f"max |psflow - tf INTEGER_ACCURATE| = {acc}; "
                  f"vs tf default (INTEGER_FAST) = {dflt}; vs the encoded array = {orig}")


# ---- b. psflow writes, TensorFlow reads ----------------------------------


def read_idx(path):
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def find_idx(folder, name):
    for candidate in (name, name + ".gz"):
        if os.path.exists(os.path.join(folder, candidate)):
            return os.path.join(folder, candidate)
    raise FileNotFoundError(os.path.join(folder, name))


def part_b(bin_dir, work, idx_dir):
    images = read_idx(find_idx(idx_dir, "t10k-images-idx3-ubyte"))
    labels = read_idx(find_idx(idx_dir, "t10k-labels-idx1-ubyte"))
    spec = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
            "image/class/label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        ex = tf.io.parse_single_example(record, spec)
        return tf.io.decode_png(ex["image/encoded"], channels=1), ex["image/class/label"]

    for compression in ("none", "gzip"):
        out_dir = os.path.join(work, f"psflow-{compression}")
        run = subprocess.run([os.path.join(bin_dir, "psflow-data"), "convert", "--from=idx",
                              f"--input={idx_dir}", "--split=test", f"--output={out_dir}",
                              "--shards=3", f"--compression={compression}"],
                             capture_output=True, text=True)
        name = f"tf.data reads psflow's {compression} shards"
        if run.returncode != 0:
            check(name, False, run.stderr.strip())
            continue
        files = sorted(os.path.join(out_dir, f) for f in os.listdir(out_dir))
        ds = tf.data.TFRecordDataset(files, compression_type="GZIP" if compression == "gzip" else "")
        got_images, got_labels = [], []
        for im, lab in ds.map(parse).batch(1000):
            got_images.append(im.numpy()[..., 0])
            got_labels.append(lab.numpy())
        got_images = np.concatenate(got_images)
        got_labels = np.concatenate(got_labels)
        same = got_images.shape == images.shape and np.array_equal(got_images, images) \
            and np.array_equal(got_labels, labels.astype(np.int64))
        check(name, same, f"{len(files)} shards, {len(got_labels)} records: "
              + ("every pixel and label equals the IDX bytes" if same else
                 f"shape {got_images.shape} vs {images.shape}, differing records "
                 f"{np.count_nonzero((got_images != images).any(axis=(1, 2))) if got_images.shape == images.shape else 'n/a'}"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", required=True, help="psflow's build/bin")
    p.add_argument("--work", required=True, help="an empty folder for the files")
    p.add_argument("--idx", default="/usr/share/datasets/fashion-mnist")
    args = p.parse_args()
    print(f"TensorFlow {tf.__version__}, numpy {np.__version__}", flush=True)
    part_a(args.bin, args.work)
    part_b(args.bin, args.work, args.idx)
    failed = [n for n, ok in RESULTS if not ok]
    print(f"{'PASS' if not failed else 'FAIL'}: {len(RESULTS) - len(failed)} passed, "
          f"{len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
