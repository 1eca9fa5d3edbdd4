#!/usr/bin/env bash
# Makes what a psflow job needs for mutual TLS and a job token, with openssl:
#   OUT_DIR/ca.crt                      the job's CA (its key is not kept: run
#                                       this again to make a new set)
#   OUT_DIR/<role>.crt, OUT_DIR/<role>.key   for chief, ps, worker, evaluator:
#                                       CN=<role> (a per-role certificate)
#   OUT_DIR/<role>-<i>.crt, .key        one per task: worker-0 .. worker-N-1,
#                                       ps-0 .., evaluator-0 ..: CN=<role>-<i>
#                                       (a per-task certificate: its holder may
#                                       act only as task i of its role)
#   OUT_DIR/token                       a random job token (64 hex digits)
# Every certificate has subjectAltName DNS:<role>, DNS:localhost,
# IP:127.0.0.1 and is usable by TLS clients and servers. Peers check the role
# name, not the pod's host name (docs/deploy.md), so one set serves every pod
# of a job however it is addressed.
#   usage: scripts/make-certs.sh [--workers N] [--ps N] [--evaluators N] OUT_DIR
#          (per-task certificates for N tasks of each; defaults 4, 2 and 1;
#          PSFLOW_CERT_DAYS, default 365)
# Keys and the token are readable by their owner only (0600); certificates by
# all. A Kubernetes Secret made from OUT_DIR sets its own file modes.
set -euo pipefail

usage() {
  echo "usage: $0 [--workers N] [--ps N] [--evaluators N] OUT_DIR" >&2
  exit 2
}
workers=4
ps=2
evaluators=1
out=
while [ $# -gt 0 ]; do
  case $1 in
    --workers|--ps|--evaluators)
      [ $# -ge 2 ] || usage
      case $2 in ''|*[!0-9]*) echo "$0: $1 needs a count (0 or more), not '$2'" >&2; exit 2;; esac
      [ "$2" -le 1000 ] || { echo "$0: $1 $2: at most 1000" >&2; exit 2; }
      case $1 in --workers) workers=$2;; --ps) ps=$2;; --evaluators) evaluators=$2;; esac
      shift 2;;
    --workers=*|--ps=*|--evaluators=*) set -- "${1%%=*}" "${1#*=}" "${@:2}";;
    -*) usage;;
    *) [ -z "$out" ] || usage; out=$1; shift;;
  esac
done
[ -n "$out" ] || usage
days=${PSFLOW_CERT_DAYS:-365}
command -v openssl > /dev/null || { echo "$0: openssl is not installed" >&2; exit 1; }
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
umask 077

# The CA: P-256 keys keep handshakes cheap.
openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout "$work/ca.key" -out "$work/ca.crt" -days "$days" -subj "/O=psflow/CN=psflow job CA" \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2> "$work/log" || { cat "$work/log" >&2; exit 1; }

# issue NAME ROLE: NAME.crt and NAME.key with CN=NAME, valid for DNS:ROLE.
names=()
issue() {
  local name=$1 role=$2
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$work/$name.key" -out "$work/$name.csr" -subj "/O=psflow/CN=$name" \
    2> "$work/log" || { cat "$work/log" >&2; exit 1; }
  cat > "$work/$name.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=DNS:$role,DNS:localhost,IP:127.0.0.1
EOF
  openssl x509 -req -in "$work/$name.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
    -CAcreateserial -out "$work/$name.crt" -days "$days" -sha256 -extfile "$work/$name.ext" \
    2> "$work/log" || { cat "$work/log" >&2; exit 1; }
  names+=("$name")
}

for role in chief ps worker evaluator; do issue "$role" "$role"; done
for ((i = 0; i < workers; i++)); do issue "worker-$i" worker; done
for ((i = 0; i < ps; i++)); do issue "ps-$i" ps; done
for ((i = 0; i < evaluators; i++)); do issue "evaluator-$i" evaluator; done
openssl rand -hex 32 > "$work/token"

chmod 0644 "$work"/*.crt
for name in "${names[@]}"; do
  mv -f "$work/$name.crt" "$work/$name.key" "$out/"
done
mv -f "$work/ca.crt" "$work/token" "$out/"
echo "made ca.crt, chief/ps/worker/evaluator .crt and .key, per-task certificates for" \
  "$workers workers, $ps ps and $evaluators evaluators (worker-0.crt ...), token in $out" \
  "(valid $days days)"
