#!/usr/bin/env bash
# Checks the container deployment on this machine, without any registry:
#   1. makes Debian 12 base images locally with debootstrap (debian:bookworm
#      and debian:bookworm-slim, both minbase) unless they exist;
#   2. builds docker/Dockerfile with buildah (chroot isolation, vfs storage);
#   3. runs a cluster of containers (podman, runc) on loopback — 1 chief,
#      2 ps, 2 workers, 1 evaluator, host network, free ports — trains the mlp
#      for a few hundred steps, requires every container to serve /metrics
#      (--metrics_port) while it runs and to exit 0 and the chief to log the
#      evaluator's final evaluation, and evaluates the saved
#      model in a container;
#   4. validates the TFJob and PyTorchJob manifests against the Kubeflow CRD
#      schemas ($PSFLOW_TFJOB_CRD, by default ../shared/schemas/kubeflow.org_tfjobs.yaml;
#      $PSFLOW_PYTORCHJOB_CRD, by default ../shared/schemas/kubeflow.org_pytorchjobs.yaml)
#      and checks the kustomize base (rendering it where kubectl is installed).
# Run as root; installs buildah, podman, debootstrap and runc when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for p in buildah podman debootstrap runc python3-yaml python3-jsonschema; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

storage=(--storage-driver vfs)
podman=(podman "${storage[@]}" --runtime runc)
limits=(--ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
image=localhost/psflow:latest

# 1. Base images.
if ! "${podman[@]}" image exists localhost/debian:bookworm-slim; then
  rootfs=$(mktemp -d /var/tmp/psflow-rootfs.XXXXXX)
  chmod 755 "$rootfs"  # it becomes the image's /: mktemp's 0700 would lock out non-root users
  echo "check-deploy: debootstrap bookworm (minbase) into $rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian > "$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log"; exit 1; }
  tar -C "$rootfs" -c . | "${podman[@]}" import - localhost/debian:bookworm-slim
  "${podman[@]}" tag localhost/debian:bookworm-slim localhost/debian:bookworm
  rm -rf "$rootfs" "$rootfs.log"
fi

# 2. The image.
echo "check-deploy: building $image"
buildah "${storage[@]}" bud --layers --isolation chroot "${limits[@]}" -f docker/Dockerfile \
  --build-arg BUILD_IMAGE=localhost/debian:bookworm \
  --build-arg RUNTIME_IMAGE=localhost/debian:bookworm-slim -t "$image" .

# 3. A cluster of containers.
ports=($(python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(12)]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
))
chief=127.0.0.1:${ports[0]}
ps_hosts=127.0.0.1:${ports[1]},127.0.0.1:${ports[2]}
worker_hosts=127.0.0.1:${ports[3]},127.0.0.1:${ports[4]}
evaluator_hosts=127.0.0.1:${ports[5]}
cluster=(--chief_hosts="$chief" --ps_hosts="$ps_hosts" --worker_hosts="$worker_hosts"
         --evaluator_hosts="$evaluator_hosts")
data=$(mktemp -d /var/tmp/psflow-data.XXXXXX)
chmod 0777 "$data"
names=(psflow-check-chief psflow-check-ps0 psflow-check-ps1 psflow-check-worker0 psflow-check-worker1
       psflow-check-evaluator0)
cleanup_containers() { "${podman[@]}" rm -f "${names[@]}" > /dev/null 2>&1 || true; }
cleanup() { cleanup_containers; rm -rf "$data"; }
trap cleanup EXIT
cleanup_containers
run() {  # name, then the command
  local name=$1; shift
  "${podman[@]}" run -d --name "$name" --network host "${limits[@]}" "$@" > /dev/null
}
# Metrics ports: the chief, ps0, ps1, worker0, worker1, evaluator0 (ports
# 6..11). A scraper in the background notes each one that answers /metrics
# while the cluster runs.
metrics=("${ports[@]:6:6}")
scraped=$data/scraped
python3 - "$scraped" "${metrics[@]}" <<'PY' &
import sys, time, urllib.request
out, ports = sys.argv[1], sys.argv[2:]
seen = set()
deadline = time.time() + 600
while len(seen) < len(ports) and time.time() < deadline:
    for port in ports:
        if port in seen:
            continue
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                if r.status == 200 and b"# TYPE psflow_" in r.read():
                    seen.add(port)
                    with open(out, "a") as f:
                        f.write(port + "\n")
        except OSError:
            pass
    time.sleep(0.2)
PY
scraper=$!
echo "check-deploy: running a cluster of containers (chief $chief, metrics on ports ${metrics[*]})"
run psflow-check-worker0 "$image" psflow-worker --job_name=worker --task_id=0 "${cluster[@]}" \
  --metrics_port="${metrics[3]}"
run psflow-check-worker1 "$image" psflow-worker --job_name=worker --task_id=1 "${cluster[@]}" \
  --metrics_port="${metrics[4]}"
run psflow-check-evaluator0 "$image" psflow-evaluator --job_name=evaluator --task_id=0 "${cluster[@]}" \
  --metrics_port="${metrics[5]}"
run psflow-check-ps0 "$image" psflow-ps --job_name=ps --task_id=0 "${cluster[@]}" \
  --metrics_port="${metrics[1]}"
run psflow-check-ps1 "$image" psflow-ps --job_name=ps --task_id=1 "${cluster[@]}" \
  --metrics_port="${metrics[2]}"
run psflow-check-chief -v "$data:/data" "$image" psflow-chief --job_name=chief --task_id=0 "${cluster[@]}" \
  --metrics_port="${metrics[0]}" \
  --model=mlp --train_steps=300 --log_every_steps=100 --optimizer=adam --learning_rate=0.001 \
  --model_dir=/data/run
failed=0
for name in "${names[@]}"; do
  code=$(timeout 600 "${podman[@]}" wait "$name" || echo timeout)
  echo "check-deploy: $name exited with $code"
  [ "$code" = 0 ] || failed=1
done
chief_log=$("${podman[@]}" logs psflow-check-chief 2>&1)
grep -E "step [0-9]+/|eval:|done|saved model" <<<"$chief_log" || true
# (grep -q on a pipe would stop reading at the match: with pipefail the
# writer's SIGPIPE would fail the check.)
if ! grep -q "eval: step 300/300" <<<"$chief_log"; then
  echo "check-deploy: the chief logged no evaluation of the final model"
  failed=1
fi
kill "$scraper" 2>/dev/null || true  # done already, unless a port never answered
wait "$scraper" 2>/dev/null || true
for port in "${metrics[@]}"; do
  if ! grep -qx "$port" "$scraped" 2>/dev/null; then
    echo "check-deploy: nothing answered /metrics on port $port while the cluster ran"
    failed=1
  fi
done
if [ "$failed" != 0 ]; then
  for name in "${names[@]}"; do echo "--- $name"; "${podman[@]}" logs "$name" 2>&1 | tail -20; done
  exit 1
fi
"${podman[@]}" run --rm --network none "${limits[@]}" -v "$data:/data" "$image" \
  psflow-eval --saved_model=/data/run/saved_model

# 4. Manifests (the kustomize test also renders the base where kubectl is installed).
/usr/bin/python3 deploy/validate_tfjob.py "${PSFLOW_TFJOB_CRD:-../shared/schemas/kubeflow.org_tfjobs.yaml}" \
  deploy/tfjob/*.yaml
/usr/bin/python3 deploy/validate_pytorchjob.py \
  "${PSFLOW_PYTORCHJOB_CRD:-../shared/schemas/kubeflow.org_pytorchjobs.yaml}" deploy/pytorchjob/*.yaml
/usr/bin/python3 tests/deploy/kustomize_test.py
echo "check-deploy: all checks passed"
