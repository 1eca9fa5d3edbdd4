#!/usr/bin/env python3
"""Parses a Prometheus text exposition (format 0.0.4) with the Prometheus
project's own Python parser (prometheus_client.parser, Debian's
python3-prometheus-client) and prints what it read, one line each, for the
process tests to compare:
  TYPE <family> <type>
  SAMPLE <name> <label=value,... sorted> <value>
(tab-separated). The parser's family name of a counter drops "_total".

usage: parse_metrics.py FILE
Exit code 0 when the file parses, 1 when it does not (the parser's error on
stderr), 77 when prometheus_client is not installed.
"""
import sys

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    print("SKIPPED: python3-prometheus-client is not installed", file=sys.stderr)
    sys.exit(77)


def main(path):
    with open(path) as f:
        text = f.read()
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError and others on bad input
        print(f"{path}: does not parse: {e!r}", file=sys.stderr)
        return 1
    for family in families:
        print(f"TYPE\t{family.name}\t{family.type}")
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            print(f"SAMPLE\t{sample.name}\t{labels}\t{sample.value!r}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-4], file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
