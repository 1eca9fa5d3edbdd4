#!/usr/bin/env bash
# scripts/get-movielens.sh DIR: MovieLens-100k (100,000 ratings of 1,682 movies by 943 users)
# as train.tsv and test.tsv in DIR, from the copy PyPI's recbole wheel carries
# (recbole/dataset_example/ml-100k). GroupLens' licence forbids redistributing the data, so
# nothing of it is in this repository: the wheel is downloaded (pinned, checked by its SHA-256)
# into a cache, ${PSFLOW_CACHE:-~/.cache/psflow}, and only that folder is extracted, to
# DIR/ml-100k.
#
# Both files are tab-separated with the header "user_id item_id rating" (ratings 1 to 5). The
# split is fixed and independent of row order: a rating goes to test.tsv when the CRC-32 of
# "<user_id>:<item_id>" is 0 mod 5, about 20% (19,966 of the 100,000), else to train.tsv; rows
# keep the file's order. The CSV reader takes them with
#   --csv_delimiter=tab --csv_columns=user_id:categorical,item_id:categorical,rating:label
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: scripts/get-movielens.sh DIR" >&2
  exit 2
fi
DIR=$1
VERSION=1.2.0
WHEEL_SHA256=075820e2ea8f182ec4d30c4ec9067d5ac7b07c2f5e3ae1adeb8a5fbee2d4204d
CACHE=${PSFLOW_CACHE:-$HOME/.cache/psflow}/recbole-$VERSION
WHEEL=$CACHE/recbole-$VERSION-py3-none-any.whl

if [ ! -f "$WHEEL" ]; then
  mkdir -p "$CACHE"
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$CACHE" "recbole==$VERSION"
fi
if ! echo "$WHEEL_SHA256  $WHEEL" | sha256sum --check --status; then
  echo "get-movielens.sh: $WHEEL is not the recbole $VERSION wheel (SHA-256 differs); remove it and retry" >&2
  exit 1
fi

mkdir -p "$DIR"
python3 - "$WHEEL" "$DIR" <<'PY'
import os, sys, zipfile, zlib

wheel, out = sys.argv[1], sys.argv[2]
folder = "recbole/dataset_example/ml-100k/"
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(folder) and not n.endswith("/")]
    if folder + "ml-100k.inter" not in names:
        sys.exit(f"get-movielens.sh: {wheel} holds no {folder}ml-100k.inter")
    os.makedirs(os.path.join(out, "ml-100k"), exist_ok=True)
    for n in names:
        with open(os.path.join(out, "ml-100k", os.path.basename(n)), "wb") as f:
            f.write(z.read(n))

# ml-100k.inter: "user_id:token item_id:token rating:float timestamp:float", tab-separated.
with open(os.path.join(out, "ml-100k", "ml-100k.inter")) as f:
    header = f.readline().rstrip("\n").split("\t")
    if header[:3] != ["user_id:token", "item_id:token", "rating:float"]:
        sys.exit(f"get-movielens.sh: ml-100k.inter starts {header}, not user_id, item_id, rating")
    rows = [line.rstrip("\n").split("\t")[:3] for line in f if line.strip()]

counts = {"train": 0, "test": 0}
files = {s: open(os.path.join(out, s + ".tmp"), "w") for s in counts}
for f in files.values():
    f.write("user_id\titem_id\trating\n")
for user, item, rating in rows:
    split = "test" if zlib.crc32(f"{user}:{item}".encode()) % 5 == 0 else "train"
    files[split].write(f"{user}\t{item}\t{int(float(rating))}\n")
    counts[split] += 1
for s, f in files.items():
    f.close()
    os.replace(os.path.join(out, s + ".tmp"), os.path.join(out, s + ".tsv"))
print(f"wrote {counts['train']} train and {counts['test']} test ratings to {out}")
PY
