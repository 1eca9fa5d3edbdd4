#!/usr/bin/env python3
"""Validates psflow's PyTorchJob manifests offline.

A PyTorchJob runs psflow without parameter servers: every pod is a
psflow-worker, the Master is rank 0 (worker 0, which runs the chief's
duties), and psflow derives every rank's address from the MASTER_ADDR,
MASTER_PORT, WORLD_SIZE and RANK the operator writes (rank r >= 1 at
<job>-worker-<r-1>:MASTER_PORT).

Each PyTorchJob document is checked against the openAPIV3Schema of the
Kubeflow PyTorchJob CustomResourceDefinition, with unknown fields refused (as
a structural schema would prune them), and against what psflow needs of it:
Master and Worker replicas only, exactly one Master; every container running
psflow-worker; a container named "pytorch" in every replica with a port named
pytorchjob-port (the operator reads MASTER_PORT there), the same port in every
replica (every rank listens on MASTER_PORT); restartPolicy ExitCode or
OnFailure (psflow's exit codes: 138 and 140 are retried, and every worker
exits with one of them when one dies); the job flags on the Master, --model_dir
at least, on a volume that outlives the pod, and storage on the Master only;
no cluster flags (--job_name, --worker_hosts, ...) that would override the
operator's environment; no elasticPolicy and one process per pod
(nprocPerNode unset, auto or 1): the ring's members are fixed; synchronous
training (no --mode=async or ssp) and a --global_batch_size that splits over
the ranks; the security flags the same on every replica, naming files of a
Secret mounted read-only; HTTP probes on the --metrics_port (GET /healthz,
/readyz), none of gRPC where the security flags keep the kubelet out; GPUs
driven with --device=cuda:N and as many as the Master's --replicas_per_worker;
Prometheus scrape annotations that name the --metrics_port.

usage: validate_pytorchjob.py CRD.yaml MANIFEST.yaml...
Exit code 0 when every manifest passes, 1 otherwise (each problem on a line).
"""
import sys

from validate_manifest import (CLUSTER_FLAGS, args_of, crd_schema, device_problems, flag_value,
                               global_batch_problems, gpu_count, gpus_agree_problems, main as run_main,
                               model_dir_problems, probe_problems, replicas_per_worker, scrape_problems,
                               security_problems, storage_volumes, sync_only_problems, validate_file)

CONTAINER = "pytorch"          # the operator reads the port of this container only
PORT_NAME = "pytorchjob-port"  # ... named so: MASTER_PORT
RESTART_POLICIES = ("ExitCode", "OnFailure")


def pytorchjob_schema(crd_path):
    return crd_schema(crd_path)


def pytorch_container(pod):
    for c in pod.get("containers", []) or []:
        if c.get("name") == CONTAINER:
            return c
    return None


def port_of(container):
    """The containerPort named pytorchjob-port, or None."""
    for p in (container or {}).get("ports", []) or []:
        if p.get("name") == PORT_NAME:
            return p.get("containerPort")
    return None


def psflow_problems(job, documents=()):
    """What psflow itself needs of a PyTorchJob, beyond the schema."""
    problems = []
    spec = job.get("spec", {})
    specs = spec.get("pytorchReplicaSpecs", {}) or {}
    for role in specs:
        if role not in ("Master", "Worker"):
            problems.append(f"{role}: psflow runs Master and Worker replicas only (all of them psflow-worker)")
    if "Master" not in specs:
        problems.append("needs a Master replica: the operator sets MASTER_ADDR, WORLD_SIZE and RANK only "
                        "when there is one, and psflow addresses rank r >= 1 as <job>-worker-<r-1>")
    elif specs["Master"].get("replicas", 1) != 1:
        problems.append("needs exactly one Master replica (rank 0; psflow addresses rank r >= 1 as "
                        "<job>-worker-<r-1>)")
    if spec.get("elasticPolicy") is not None:
        problems.append("elasticPolicy: psflow's all-reduce group has a fixed set of workers (drop it)")
    nproc = spec.get("nprocPerNode")
    if nproc is not None and str(nproc) not in ("auto", "1"):
        problems.append(f"nprocPerNode is '{nproc}': psflow runs one process per pod (a worker drives all of "
                        "its pod's GPUs itself)")
    ports = {}
    security = {}
    gpus_per_pod = set()
    for role, rspec in specs.items():
        if rspec.get("restartPolicy") not in RESTART_POLICIES:
            problems.append(f"{role}: restartPolicy is {rspec.get('restartPolicy') or 'Never (the default)'}; "
                            "it should be ExitCode (or OnFailure): psflow exits 138 or 140 for failures worth a "
                            "retry, and every worker does when one fails")
        template = rspec.get("template", {})
        pod = template.get("spec", {})
        main_container = pytorch_container(pod)
        if main_container is None:
            problems.append(f"{role}: no container named '{CONTAINER}' (the operator reads MASTER_PORT from "
                            f"its port named {PORT_NAME})")
        else:
            ports[role] = port_of(main_container)
            if ports[role] is None:
                problems.append(f"{role}: the '{CONTAINER}' container has no port named {PORT_NAME} (the "
                                "operator reads MASTER_PORT there; every rank listens on it)")
            security[role], found = security_problems(role, pod, main_container)
            problems += found
        if role != "Master" and storage_volumes(pod):
            problems.append(f"{role}: only the Master needs storage (rank 0 writes the checkpoints and the "
                            "saved model)")
        for c in pod.get("containers", []) or []:
            name = c.get("name")
            command = [str(a) for a in c.get("command", []) or []]
            binary = command[0].rsplit("/", 1)[-1] if command else None
            if binary != "psflow-worker":
                problems.append(f"{role}: container '{name}' runs {binary or 'the image default'}, not "
                                "psflow-worker (every rank of a PyTorchJob is a psflow worker)")
            args = args_of(c)
            for flag in CLUSTER_FLAGS:
                if flag_value(args, flag) is not None:
                    problems.append(f"{role}: {flag} would override the cluster the operator describes "
                                    "(MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK): drop it")
            metrics_port = flag_value(args, "--metrics_port")
            if metrics_port is not None and metrics_port == str(port_of(c)):
                problems.append(f"{role}: --metrics_port={metrics_port} is the {PORT_NAME} too")
            res = c.get("resources", {}) or {}
            gpus = gpu_count(res)
            asks = any("nvidia.com/gpu" in (res.get(k) or {}) for k in ("limits", "requests"))
            if asks and not any(a.startswith("--device=cuda") for a in args):
                problems.append(f"{role}: a GPU is requested but the container has no --device=cuda:N")
            if c is main_container:
                gpus_per_pod.add(gpus)
                problems += device_problems(role, gpus, args)
            problems += probe_problems(role, c)
            problems += scrape_problems(role, template.get("metadata", {}), c)
    known = {role: p for role, p in ports.items() if p is not None}
    if len(set(known.values())) > 1:
        problems.append(f"every replica's {PORT_NAME} must be the Master's (every rank listens on MASTER_PORT): "
                        + ", ".join(f"{role} {p}" for role, p in sorted(known.items())))
    master = specs.get("Master", {}).get("template", {}).get("spec", {})
    master_container = pytorch_container(master)
    args = args_of(master_container) if master_container is not None else []
    if master_container is not None:
        problems += model_dir_problems("Master", master, master_container,
                                       flags="the job flags (rank 0 runs the chief's duties)")
    replicas = replicas_per_worker(args, problems)
    problems += gpus_agree_problems(gpus_per_pod, replicas, who="pods")
    counts = [s.get("replicas", 1) for s in specs.values()]
    workers = sum(counts) if all(isinstance(n, int) for n in counts) else None
    problems += global_batch_problems(args, workers, replicas)
    problems += sync_only_problems(args)
    if len(set(security.values())) > 1:
        problems.append("every replica needs the same security flags (" + "; ".join(
            f"{role}: {' '.join(sorted(flags)) or 'none'}" for role, flags in sorted(security.items())) + ")")
    return problems


def validate(schema, path):
    """Returns the problems of every PyTorchJob in the file at `path`."""
    return validate_file(schema, path, "PyTorchJob", psflow_problems)


def main(argv):
    return run_main(argv, "validate_pytorchjob", "PyTorchJob", __doc__.strip().splitlines()[-2],
                    pytorchjob_schema, validate)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
