#!/usr/bin/env python3
"""What psflow's Kubeflow manifest validators share (validate_tfjob.py,
validate_pytorchjob.py): the CRD's openAPIV3Schema with unknown fields
refused, as a structural schema would prune them, and the checks that do not
depend on the kind of job: the security flags, HTTP probes and Prometheus
annotations of one container, GPUs, the chief's --model_dir on a volume that
outlives the pod, claims that several pods of one template mount, and the
job flags that a cluster without ps cannot run.

Not a command: import it.
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


def crd_schema(crd_path, version="v1"):
    """The closed openAPIV3Schema of one version of the CRD at crd_path."""
    with open(crd_path) as f:
        crd = yaml.safe_load(f)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return closed(v["schema"]["openAPIV3Schema"])
    raise SystemExit(f"{crd_path}: no {version} schema")


# Volumes that hold no data of the job: what pods are given, not where they write.
NOT_STORAGE = ("secret", "configMap", "projected", "downwardAPI")
# Storage that goes with the pod: a pod recreated after a failure starts empty.
POD_STORAGE = ("emptyDir", "ephemeral")
SECURITY_FLAGS = ("--tls_cert", "--tls_key", "--tls_ca", "--auth_token_file")
TLS_FLAGS = SECURITY_FLAGS[:3]
# Flags that say where a process sits in the cluster: they win over the
# environment the operator writes, field by field.
CLUSTER_FLAGS = ("--job_name", "--task_id", "--task_index", "--chief_hosts", "--ps_hosts",
                 "--worker_hosts", "--evaluator_hosts")


def flag_value(args, name):
    """The value of --name=value in args, or None."""
    for a in args:
        if str(a).startswith(name + "="):
            return str(a)[len(name) + 1:]
    return None


def args_of(container):
    return [str(a) for a in container.get("args", []) or []]


def storage_volumes(pod):
    """The pod's volumes that hold data (not Secrets, ConfigMaps, ...)."""
    return [v for v in pod.get("volumes", []) or [] if not any(k in v for k in NOT_STORAGE)]


def volume_at(pod, container, path):
    """The volume mounted deepest above `path` in the container, with its
    mount, or (None, None)."""
    mounts = [m for m in container.get("volumeMounts", []) or []
              if path.startswith(m.get("mountPath", "").rstrip("/") + "/")
              or path == m.get("mountPath", "").rstrip("/")]
    if not mounts:
        return None, None
    mount = max(mounts, key=lambda m: len(m.get("mountPath", "")))
    volumes = {v.get("name"): v for v in pod.get("volumes", []) or []}
    return volumes.get(mount.get("name"), {}), mount


def insecure(args):
    """Whether args hold --insecure (true)."""
    return any(a in ("--insecure", "--insecure=true", "--insecure=1") for a in args)


def security_problems(role, pod, container):
    """The security flags of one container: all TLS flags or none, each file
    on a Secret mounted read-only, and at least one of TLS and the token
    where the role listens (on its pod's address: beyond loopback, where a
    role without either exits 1 unless given --insecure; a TFJob's Evaluator
    listens on nothing). Returns (flags given, problems)."""
    args = args_of(container)
    given = {f: flag_value(args, f) for f in SECURITY_FLAGS if flag_value(args, f)}
    problems = []
    if not given and role != "Evaluator" and not insecure(args):
        problems.append(f"{role}: neither mutual TLS (--tls_cert, --tls_key, --tls_ca) nor --auth_token_file: "
                        "psflow refuses to listen on a pod's address in plaintext without a token (it exits 1; "
                        "--insecure accepts that)")
    tls = [f for f in TLS_FLAGS if f in given]
    if tls and len(tls) != len(TLS_FLAGS):
        problems.append(f"{role}: mutual TLS needs all of --tls_cert, --tls_key and --tls_ca")
    for flag, path in given.items():
        volume, mount = volume_at(pod, container, path)
        if mount is None:
            problems.append(f"{role}: {flag}={path} is on no volume (mount the Secret)")
            continue
        if "secret" not in volume and "projected" not in volume:
            problems.append(f"{role}: {flag}={path} should come from a Secret")
        if not mount.get("readOnly"):
            problems.append(f"{role}: mount {mount.get('mountPath')} (certificates, keys, token) read-only")
    return frozenset(given), problems


def probe_problems(role, container):
    """Probes. The kubelet's gRPC probe presents no client certificate and no
    job token, so a secured role is probed over HTTP on its metrics port:
    readiness GET /readyz, liveness GET /healthz (a role waiting for its peers
    is alive but not ready). A gRPC liveness probe, where one can work, must
    ask the "liveness" health service for the same reason."""
    problems = []
    args = args_of(container)
    secured = any(a.startswith(("--tls_ca=", "--auth_token_file=")) for a in args)
    metrics_port = flag_value(args, "--metrics_port")
    for kind, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        probe = container.get(kind) or {}
        grpc = probe.get("grpc")
        if grpc is not None:
            if secured:
                problems.append(f"{role}: a gRPC {kind} cannot pass mutual TLS or the job token (the kubelet "
                                f"has neither): GET {path} on the --metrics_port instead")
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
    return problems


def scrape_problems(role, metadata, container):
    """prometheus.io/port must be the --metrics_port the container serves."""
    annotations = metadata.get("annotations") or {}
    if annotations.get("prometheus.io/scrape") != "true":
        return []
    port = str(annotations.get("prometheus.io/port", ""))
    if f"--metrics_port={port}" not in args_of(container):
        return [f"{role}: prometheus.io/port is '{port}' but the container has no --metrics_port={port}"]
    return []


def gpu_count(resources):
    """The GPUs a container asks for (nvidia.com/gpu: limits, else requests)."""
    for k in ("limits", "requests"):
        n = (resources.get(k) or {}).get("nvidia.com/gpu")
        if n is not None:
            return int(n) if str(n).isdigit() else 0
    return 0


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


def replicas_per_worker(args, problems):
    """The chief's --replicas_per_worker (1 if absent), appending a problem
    when it is not a count."""
    replicas = flag_value(args, "--replicas_per_worker") or "1"
    if not replicas.isdigit():
        problems.append(f"--replicas_per_worker={replicas} is not a count")
        return 1
    return int(replicas)


def gpus_agree_problems(worker_gpus, replicas, who="workers"):
    """Every worker pod drives all the GPUs it is given: the chief must run
    as many model replicas per worker."""
    return [f"{who} have {n} GPUs each but the chief runs --replicas_per_worker={replicas}"
            " (one model replica per GPU: give it the GPU count)"
            for n in sorted(worker_gpus) if max(n, 1) != replicas]


def model_dir_problems(role, pod, container, flags="the chief's job flags"):
    """The chief's --model_dir: given, and on a volume that outlives the pod
    (the checkpoints a restarted job resumes from are there)."""
    model_dir = flag_value(args_of(container), "--model_dir")
    if not model_dir:
        return [f"{role}: {flags} need --model_dir (checkpoints and the saved model)"]
    volume, _ = volume_at(pod, container, model_dir)
    if volume is None:
        return [f"{role}: --model_dir={model_dir} is on no volume: checkpoints would go with the pod"]
    kind = next((k for k in NOT_STORAGE + POD_STORAGE if k in volume), None)
    if kind is not None:
        return [f"{role}: --model_dir={model_dir} is on volume {volume.get('name')} ({kind}), which does not keep "
                "the checkpoints a restarted job resumes from: mount a persistentVolumeClaim there"]
    return []


def shared_claim_problems(role, replicas, pod, documents):
    """Pods of one template mount the same claims: one that is only
    ReadWriteOnce (and defined in the same file) ties them to one node."""
    if not isinstance(replicas, int) or replicas <= 1:
        return []
    claims = {d.get("metadata", {}).get("name"): d for d in documents
              if d.get("kind") == "PersistentVolumeClaim"}
    problems = []
    for v in storage_volumes(pod):
        name = (v.get("persistentVolumeClaim") or {}).get("claimName")
        modes = claims.get(name, {}).get("spec", {}).get("accessModes") or []
        if name in claims and "ReadWriteMany" not in modes:
            problems.append(f"{role}: its {replicas} pods share one template, so each mounts claim {name}, "
                            f"which is {'/'.join(modes) or 'without accessModes'}: one node only; make it "
                            "ReadWriteMany (worker 0 alone writes to it)")
    return problems


def sync_only_problems(chief_args):
    """A cluster without ps trains synchronously (the ring averages every
    worker's gradient of a step)."""
    mode = flag_value(chief_args, "--mode")
    if mode not in (None, "sync"):
        return [f"--mode={mode} needs parameter servers: a cluster without ps trains synchronously"]
    return []


def global_batch_problems(chief_args, workers, replicas):
    """--global_batch_size must split evenly over every model replica."""
    value = flag_value(chief_args, "--global_batch_size")
    if value is None or not isinstance(workers, int) or workers < 1:
        return []
    if not value.isdigit():
        return [f"--global_batch_size={value} is not a count"]
    total = workers * replicas
    if int(value) and int(value) % total:
        return [f"--global_batch_size={value} is not a multiple of the {total} model replicas "
                f"({workers} workers x {replicas})"]
    return []


def validate_file(schema, path, kind, checks):
    """The problems of every `kind` document in the file at `path`: its schema
    errors, then checks(job, documents)."""
    with open(path) as f:
        documents = [d for d in yaml.safe_load_all(f) if d]
    problems = []
    jobs = [d for d in documents if d.get("kind") == kind]
    if not jobs:
        problems.append(f"{path}: no {kind}")
    for job in jobs:
        name = job.get("metadata", {}).get("name", "?")
        validator = jsonschema.Draft7Validator(schema)
        for error in sorted(validator.iter_errors(job), key=lambda e: list(e.path)):
            where = ".".join(str(p) for p in error.path) or "(top)"
            problems.append(f"{path}: {kind} {name}: {where}: {error.message}")
        problems += [f"{path}: {kind} {name}: {p}" for p in checks(job, documents)]
    return problems


def main(argv, prog, kind, usage, schema_of, validate):
    """The command: CRD MANIFEST... -> 0 when every manifest passes, 1 with
    each problem on a line, 2 when the CRD cannot be read."""
    if len(argv) < 3:
        print(usage, file=sys.stderr)
        return 2
    try:
        schema = schema_of(argv[1])
    except OSError as e:
        print(f"{prog}: cannot read the {kind} CRD {argv[1]}: {e.strerror}", file=sys.stderr)
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
