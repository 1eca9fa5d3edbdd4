#!/usr/bin/env bash
# The training rate of a job under a flood of silent streams against its
# rate just before, round after round: AttackTest.SilentStreamFloodLeavesTheJobItsRate
# (2 ps, 2 workers, the mlp on loopback; 5,000 Push streams that never send
# a header, from 20 connections, held on ps 0) run ROUNDS times. Prints each
# round's steps/s before and during the flood and their ratio, then the
# mean ratio and the rounds at 0.8 or more (the rate within 20% of the
# rate before). Run it on a machine that is otherwise quiet.
# Usage: bench/stream_flood.sh ROUNDS   (ATTACK_TEST: the test binary,
#   default build/tests/attack_test)
set -euo pipefail
[ $# -eq 1 ] || { sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 1; }
rounds=$1
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer, not '$rounds'" >&2; exit 1; }
test_bin=${ATTACK_TEST:-build/tests/attack_test}
[ -x "$test_bin" ] || { echo "no $test_bin (build the attack_test target)" >&2; exit 1; }
tmp=$(mktemp)
trap 'rm -f "$tmp" "$tmp.ratios"' EXIT
for ((r = 1; r <= rounds; ++r)); do
  "$test_bin" --gtest_filter=AttackTest.SilentStreamFloodLeavesTheJobItsRate > "$tmp" 2>&1 \
    || { echo "round $r failed:" >&2; tail -30 "$tmp" >&2; exit 1; }
  line=$(grep -m1 '^steps/s before the flood' "$tmp")
  echo "round $r: $line"
  echo "$line" | sed -n 's/.*ratio \([0-9.e+-]*\).*/\1/p' >> "$tmp.ratios"
done
awk '{s += $1; if ($1 >= 0.8) ok++} END {printf "mean ratio %.3f; %d of %d rounds within 20%%\n", s / NR, ok, NR}' \
  "$tmp.ratios"
