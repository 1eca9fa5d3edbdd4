#!/usr/bin/env bash
# Formats every tracked C++/CUDA source (.h, .cc, .cu) with clang-format-14 and
# the repository's .clang-format.
#   scripts/format.sh           rewrite the files in place
#   scripts/format.sh --check   change nothing; list the files that are not
#                               formatted and exit 1 if there are any (for CI)
# CLANG_FORMAT overrides the binary (default clang-format-14).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=fix
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  -h | --help)
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  *)
    echo "format.sh: unknown argument '$1' (use --check or nothing)" >&2
    exit 2
    ;;
esac

clang_format=${CLANG_FORMAT:-clang-format-14}
if ! command -v "$clang_format" >/dev/null; then
  echo "format.sh: $clang_format not found (apt-get install clang-format-14)" >&2
  exit 2
fi

mapfile -d '' files < <(git ls-files -z -- '*.h' '*.cc' '*.cu')
if [ ${#files[@]} -eq 0 ]; then
  echo "format.sh: no tracked sources found" >&2
  exit 2
fi

if [ "$mode" = fix ]; then
  printf '%s\0' "${files[@]}" | xargs -0 -n 50 "$clang_format" -i --style=file
  echo "format.sh: formatted ${#files[@]} files"
  exit 0
fi

# --check: compare each file with its formatted output.
unformatted=()
for f in "${files[@]}"; do
  if ! "$clang_format" --style=file --assume-filename="$f" <"$f" | cmp -s - "$f"; then
    unformatted+=("$f")
  fi
done
if [ ${#unformatted[@]} -ne 0 ]; then
  printf 'not formatted: %s\n' "${unformatted[@]}" >&2
  echo "format.sh: ${#unformatted[@]} of ${#files[@]} files need formatting; run scripts/format.sh" >&2
  exit 1
fi
echo "format.sh: all ${#files[@]} files formatted"
