#!/usr/bin/env python3
"""Validates psflow's TFJob manifests offline.

Each TFJob document is checked against the openAPIV3Schema of the Kubeflow
TFJob CustomResourceDefinition, with unknown fields refused (as a structural
schema would prune them), and against what psflow needs of it: the container
named "tensorflow" (the only one the operator gives TF_CONFIG), the ExitCode
restart policy, one chief, storage mounted on the chief alone (a Secret is not
storage), GPUs (nvidia.com/gpu) requested by workers and evaluators alone,
which then run --device=cuda:N (a worker given several drives them all:
--device=cuda:all, with the chief's --replicas_per_worker equal to the count), the security flags (--tls_cert, --tls_key,
--tls_ca, --auth_token_file) the same on every replica, naming files of a
Secret mounted read-only, probes that can pass (HTTP on the --metrics_port,
GET /readyz and /healthz, where the security flags keep the kubelet's gRPC
probes out, and none of gRPC on the evaluator, which the operator leaves out
of TF_CONFIG's cluster), no readiness probe on the ps, and Prometheus scrape
annotations that name the --metrics_port the container serves.

usage: validate_tfjob.py CRD.yaml MANIFEST.yaml...
Exit code 0 when every manifest passes, 1 otherwise (each problem on a line).
"""
import copy
import sys

import jsonschema
import yaml


def closed(schema):
    """Returns the schema with additionalProperties: false on every object
    that lists its properties and does not opt out of pruning."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def tfjob_schema(crd_path):
    with open(crd_path) as f:
        crd = yaml.safe_load(f)
    for version in crd["spec"]["versions"]:
        if version["name"] == "v1":
            return closed(version["schema"]["openAPIV3Schema"])
    raise SystemExit(f"{crd_path}: no v1 schema")


# Volumes that hold no data of the job: what pods are given, not where they write.
NOT_STORAGE = ("secret", "configMap", "projected", "downwardAPI")
SECURITY_FLAGS = ("--tls_cert", "--tls_key", "--tls_ca", "--auth_token_file")
TLS_FLAGS = SECURITY_FLAGS[:3]


def flag_value(args, name):
    """The value of --name=value in args, or None."""
    for a in args:
        if str(a).startswith(name + "="):
            return str(a)[len(name) + 1:]
    return None


def security_problems(role, pod, container):
    """The security flags of one container: all TLS flags or none, each file
    on a Secret mounted read-only. Returns (flags given, problems)."""
    args = container.get("args", []) or []
    given = {f: flag_value(args, f) for f in SECURITY_FLAGS if flag_value(args, f)}
    problems = []
    tls = [f for f in TLS_FLAGS if f in given]
    if tls and len(tls) != len(TLS_FLAGS):
        problems.append(f"{role}: mutual TLS needs all of --tls_cert, --tls_key and --tls_ca")
    volumes = {v.get("name"): v for v in pod.get("volumes", []) or []}
    for flag, path in given.items():
        mounts = [m for m in container.get("volumeMounts", []) or []
                  if path.startswith(m.get("mountPath", "").rstrip("/") + "/")]
        if not mounts:
            problems.append(f"{role}: {flag}={path} is on no volume (mount the Secret)")
            continue
        mount = max(mounts, key=lambda m: len(m.get("mountPath", "")))
        volume = volumes.get(mount.get("name"), {})
        if "secret" not in volume and "projected" not in volume:
            problems.append(f"{role}: {flag}={path} should come from a Secret")
        if not mount.get("readOnly"):
            problems.append(f"{role}: mount {mount.get('mountPath')} (certificates, keys, token) read-only")
    return frozenset(given), problems


def psflow_problems(job):
    """What psflow itself needs of a TFJob, beyond the schema."""
    problems = []
    specs = job.get("spec", {}).get("tfReplicaSpecs", {})
    # Without a Chief, worker 0 runs the chief's duties (and writes the
    # checkpoints and the saved model).
    chief = "Chief" if "Chief" in specs else "Worker"
    if chief == "Chief" and specs["Chief"].get("replicas") != 1:
        problems.append("needs exactly one Chief replica (or none: worker 0 is then the chief)")
    for role in ("PS", "Worker"):
        if role not in specs:
            problems.append(f"has no {role} replicas")
    security = {}
    worker_gpus = set()
    for role, spec in specs.items():
        if spec.get("restartPolicy") != "ExitCode":
            problems.append(f"{role}: restartPolicy should be ExitCode (psflow's exit codes say what to retry)")
        pod = spec.get("template", {}).get("spec", {})
        names = [c.get("name") for c in pod.get("containers", [])]
        if "tensorflow" not in names:
            problems.append(f"{role}: no container named 'tensorflow' (the operator writes TF_CONFIG only there)")
        storage = [v for v in pod.get("volumes", []) or [] if not any(k in v for k in NOT_STORAGE)]
        if role != chief and storage:
            problems.append(f"{role}: only the chief needs storage" +
                            (" (worker 0 here)" if chief == "Worker" else ""))
        for c in pod.get("containers", []):
            res = c.get("resources", {})
            gpus = any("nvidia.com/gpu" in (res.get(k) or {}) for k in ("limits", "requests"))
            if gpus and role not in ("Worker", "Evaluator"):
                problems.append(f"{role}: only workers and evaluators compute on GPUs (nvidia.com/gpu)")
            args = c.get("args", []) or []
            if gpus and not any(str(a).startswith("--device=cuda") for a in args):
                problems.append(f"{role}: a GPU is requested but the container has no --device=cuda:N")
            if role == "Worker" and c.get("name") == "tensorflow":
                worker_gpus.add(gpu_count(res))
                problems += device_problems(role, gpu_count(res), args)
            if c.get("name") == "tensorflow":
                security[role], found = security_problems(role, pod, c)
                problems += found
            problems += probe_problems(role, c)
            problems += scrape_problems(role, spec.get("template", {}).get("metadata", {}), c)
    # Every worker pod drives all the GPUs it is given: the chief (worker 0
    # without one) must run as many replicas per worker.
    replicas = flag_value(chief_args(specs, chief), "--replicas_per_worker") or "1"
    if not replicas.isdigit():
        problems.append(f"--replicas_per_worker={replicas} is not a count")
        replicas = "1"
    for n in worker_gpus:
        if max(n, 1) != int(replicas):
            problems.append(f"workers have {n} GPUs each but the chief runs --replicas_per_worker={replicas}"
                            " (one model replica per GPU: give it the GPU count)")
    if len(set(security.values())) > 1:
        problems.append("every replica needs the same security flags (" + "; ".join(
            f"{role}: {' '.join(sorted(flags)) or 'none'}" for role, flags in sorted(security.items())) + ")")
    return problems


def gpu_count(resources):
    """The GPUs a container asks for (nvidia.com/gpu: limits, else requests)."""
    for k in ("limits", "requests"):
        n = (resources.get(k) or {}).get("nvidia.com/gpu")
        if n is not None:
            return int(n) if str(n).isdigit() else 0
    return 0


def chief_args(specs, chief):
    """The args of the chief's container (worker 0's without a Chief)."""
    pod = specs.get(chief, {}).get("template", {}).get("spec", {})
    for c in pod.get("containers", []):
        if c.get("name") == "tensorflow":
            return c.get("args", []) or []
    return []


def device_problems(role, gpus, args):
    """A worker with several GPUs must drive them all (--device=cuda:all or a
    list of as many)."""
    if gpus <= 1:
        return []
    device = flag_value(args, "--device") or "cpu"
    if device == "cuda:all" or len(device.split(",")) == gpus:
        return []
    return [f"{role}: {gpus} GPUs are requested but --device={device} drives "
            f"{len(device.split(','))} (use --device=cuda:all)"]


def probe_problems(role, container):
    """Probes. The kubelet's gRPC probe presents no client certificate and no
    job token, so a secured role is probed over HTTP on its metrics port:
    readiness GET /readyz, liveness GET /healthz (a role waiting for its peers
    is alive but not ready). A gRPC liveness probe, where one can work, must
    ask the "liveness" health service for the same reason."""
    problems = []
    args = [str(a) for a in container.get("args", []) or []]
    secured = any(a.startswith(("--tls_ca=", "--auth_token_file=")) for a in args)
    metrics_port = next((a.split("=", 1)[1] for a in args if a.startswith("--metrics_port=")), None)
    for kind, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        probe = container.get(kind) or {}
        grpc = probe.get("grpc")
        if grpc is not None:
            if secured:
                problems.append(f"{role}: a gRPC {kind} cannot pass mutual TLS or the job token (the kubelet "
                                f"has neither): GET {path} on the --metrics_port instead")
            if role == "Evaluator":
                problems.append(f"Evaluator: no gRPC {kind}: the operator leaves the evaluator out of "
                                "TF_CONFIG's cluster, so psflow-evaluator serves no gRPC port")
            if kind == "livenessProbe" and grpc.get("service") != "liveness":
                problems.append(f"{role}: the gRPC livenessProbe must ask service 'liveness' (the server as a "
                                "whole is not ready while the role waits for its peers: the kubelet would "
                                "restart it)")
        http = probe.get("httpGet")
        if http is not None:
            if http.get("path") != path:
                problems.append(f"{role}: the httpGet {kind} must GET {path}, not {http.get('path')}")
            if metrics_port is None or str(http.get("port")) != metrics_port:
                problems.append(f"{role}: the httpGet {kind} asks port {http.get('port')}, but the container "
                                f"serves its probes on --metrics_port ({metrics_port or 'none'})")
    if role == "PS" and container.get("readinessProbe") is not None:
        problems.append("PS: no readinessProbe: the operator's headless Services publish a pod's name only "
                        "once it is ready, and a ps is ready only after the chief reached it")
    return problems


def scrape_problems(role, metadata, container):
    """prometheus.io/port must be the --metrics_port the container serves."""
    annotations = metadata.get("annotations") or {}
    if annotations.get("prometheus.io/scrape") != "true":
        return []
    port = str(annotations.get("prometheus.io/port", ""))
    args = [str(a) for a in container.get("args", []) or []]
    if f"--metrics_port={port}" not in args:
        return [f"{role}: prometheus.io/port is '{port}' but the container has no --metrics_port={port}"]
    return []


def validate(schema, path):
    """Returns the problems of every TFJob in the file at `path`."""
    with open(path) as f:
        documents = [d for d in yaml.safe_load_all(f) if d]
    problems = []
    jobs = [d for d in documents if d.get("kind") == "TFJob"]
    if not jobs:
        problems.append(f"{path}: no TFJob")
    for job in jobs:
        name = job.get("metadata", {}).get("name", "?")
        validator = jsonschema.Draft7Validator(schema)
        for error in sorted(validator.iter_errors(job), key=lambda e: list(e.path)):
            where = ".".join(str(p) for p in error.path) or "(top)"
            problems.append(f"{path}: TFJob {name}: {where}: {error.message}")
        problems += [f"{path}: TFJob {name}: {p}" for p in psflow_problems(job)]
    return problems


def main(argv):
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    try:
        schema = tfjob_schema(argv[1])
    except OSError as e:
        print(f"validate_tfjob: cannot read the TFJob CRD {argv[1]}: {e.strerror}", file=sys.stderr)
        return 2
    problems = []
    for path in argv[2:]:
        found = validate(schema, path)
        problems += found
        if not found:
            print(f"ok: {path}")
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
