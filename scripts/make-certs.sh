#!/usr/bin/env bash
# Makes what a psflow job needs for mutual TLS and a job token, with openssl:
#   OUT_DIR/ca.crt                      the job's CA (its key is not kept: run
#                                       this again to make a new set)
#   OUT_DIR/<role>.crt, OUT_DIR/<role>.key   for chief, ps, worker, evaluator:
#                                       CN=<role>, subjectAltName DNS:<role>,
#                                       DNS:localhost, IP:127.0.0.1, usable by
#                                       TLS clients and servers
#   OUT_DIR/token                       a random job token (64 hex digits)
# Peers check the role name, not the pod's host name (docs/deploy.md), so the
# same set serves every pod of a job however it is addressed.
#   usage: scripts/make-certs.sh OUT_DIR        (PSFLOW_CERT_DAYS, default 365)
# Keys and the token are readable by their owner only (0600); certificates by
# all. A Kubernetes Secret made from OUT_DIR sets its own file modes.
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
out=$1
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

for role in chief ps worker evaluator; do
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$work/$role.key" -out "$work/$role.csr" -subj "/O=psflow/CN=$role" \
    2> "$work/log" || { cat "$work/log" >&2; exit 1; }
  cat > "$work/$role.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=DNS:$role,DNS:localhost,IP:127.0.0.1
EOF
  openssl x509 -req -in "$work/$role.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
    -CAcreateserial -out "$work/$role.crt" -days "$days" -sha256 -extfile "$work/$role.ext" \
    2> "$work/log" || { cat "$work/log" >&2; exit 1; }
done
openssl rand -hex 32 > "$work/token"

chmod 0644 "$work"/*.crt
for role in chief ps worker evaluator; do
  mv -f "$work/$role.crt" "$work/$role.key" "$out/"
done
mv -f "$work/ca.crt" "$work/token" "$out/"
echo "made ca.crt, chief/ps/worker/evaluator .crt and .key, token in $out (valid $days days)"
