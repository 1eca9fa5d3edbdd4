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
annotations that name the --metrics_port the container serves; each replica
running its role's binary, and the chief's (worker 0's) --model_dir on a
volume that outlives the pod.

A TFJob without a Chief makes worker 0 the chief; one without PS replicas is
a cluster without ps: the workers all-reduce their gradients and each serves
a replica of the weights, worker 0's being the one the chief loads. Either
way no readiness probe on the workers (the operator's headless Services
publish a pod's name only once it is ready, and worker 0 must be reached
through its name, by itself too, before it can be ready), and a claim that
all Worker pods mount (one template) must be ReadWriteMany; without ps,
synchronous training only (no --mode=async or ssp).

usage: validate_tfjob.py CRD.yaml MANIFEST.yaml...
Exit code 0 when every manifest passes, 1 otherwise (each problem on a line).
"""
import sys

from validate_manifest import (args_of, crd_schema, device_problems, global_batch_problems, gpu_count,
                               gpus_agree_problems, main as run_main, model_dir_problems, probe_problems,
                               replicas_per_worker, scrape_problems, security_problems, shared_claim_problems,
                               storage_volumes, sync_only_problems, validate_file)


def tfjob_schema(crd_path):
    return crd_schema(crd_path)


# The binary each replica type runs (a binary started for another role exits 1).
BINARIES = {"Chief": "psflow-chief", "Master": "psflow-chief", "PS": "psflow-ps",
            "Worker": "psflow-worker", "Evaluator": "psflow-evaluator"}


def psflow_problems(job, documents=()):
    """What psflow itself needs of a TFJob, beyond the schema (`documents`:
    the file's documents, for the claims the replicas mount)."""
    problems = []
    specs = job.get("spec", {}).get("tfReplicaSpecs", {})
    # Without a Chief, worker 0 runs the chief's duties (and writes the
    # checkpoints and the saved model).
    chief = "Chief" if "Chief" in specs else "Worker"
    # Without PS, the workers all-reduce their gradients, each holding a
    # replica of the weights that the others (and the chief) call.
    all_reduce = "PS" not in specs
    if chief == "Chief" and specs["Chief"].get("replicas") != 1:
        problems.append("needs exactly one Chief replica (or none: worker 0 is then the chief)")
    if "Worker" not in specs:
        problems.append("has no Worker replicas")
    if sum(spec.get("replicas", 1) for spec in specs.values() if isinstance(spec.get("replicas", 1), int)) == 1:
        problems.append("has one replica in all: the operator gives a TFJob of one replica no TF_CONFIG")
    security = {}
    worker_gpus = set()
    for role, spec in specs.items():
        if spec.get("restartPolicy") != "ExitCode":
            problems.append(f"{role}: restartPolicy should be ExitCode (psflow's exit codes say what to retry)")
        pod = spec.get("template", {}).get("spec", {})
        names = [c.get("name") for c in pod.get("containers", [])]
        if "tensorflow" not in names:
            problems.append(f"{role}: no container named 'tensorflow' (the operator writes TF_CONFIG only there)")
        if role != chief and storage_volumes(pod):
            problems.append(f"{role}: only the chief needs storage" +
                            (" (worker 0 here)" if chief == "Worker" else ""))
        if role == chief:
            problems += shared_claim_problems(role, spec.get("replicas", 1), pod, documents)
        for c in pod.get("containers", []):
            res = c.get("resources", {})
            gpus = any("nvidia.com/gpu" in (res.get(k) or {}) for k in ("limits", "requests"))
            if gpus and role not in ("Worker", "Evaluator"):
                problems.append(f"{role}: only workers and evaluators compute on GPUs (nvidia.com/gpu)")
            args = args_of(c)
            if gpus and not any(a.startswith("--device=cuda") for a in args):
                problems.append(f"{role}: a GPU is requested but the container has no --device=cuda:N")
            if role == "Worker" and c.get("name") == "tensorflow":
                worker_gpus.add(gpu_count(res))
                problems += device_problems(role, gpu_count(res), args)
            if c.get("name") == "tensorflow":
                security[role], found = security_problems(role, pod, c)
                problems += found
                command = [str(a) for a in c.get("command", []) or []]
                binary = command[0].rsplit("/", 1)[-1] if command else None
                if role in BINARIES and binary is not None and binary != BINARIES[role]:
                    problems.append(f"{role}: the container runs {binary}, but the operator makes it a "
                                    f"{role.lower()} (TF_CONFIG's task): run {BINARIES[role]}")
            problems += probe_problems(role, c)
            problems += tfjob_probe_problems(role, c, all_reduce, chief == "Worker")
            problems += scrape_problems(role, spec.get("template", {}).get("metadata", {}), c)
    chief_pod, chief_container = tensorflow_container(specs, chief)
    args = args_of(chief_container) if chief_container is not None else []
    if chief_container is not None:
        problems += model_dir_problems(chief if chief == "Chief" else "Worker (worker 0 is the chief)",
                                       chief_pod, chief_container)
    # Every worker pod drives all the GPUs it is given: the chief (worker 0
    # without one) must run as many replicas per worker.
    replicas = replicas_per_worker(args, problems)
    problems += gpus_agree_problems(worker_gpus, replicas)
    problems += global_batch_problems(args, specs.get("Worker", {}).get("replicas"), replicas)
    if all_reduce:
        problems += sync_only_problems(args)
    if len(set(security.values())) > 1:
        problems.append("every replica needs the same security flags (" + "; ".join(
            f"{role}: {' '.join(sorted(flags)) or 'none'}" for role, flags in sorted(security.items())) + ")")
    return problems


def tfjob_probe_problems(role, container, all_reduce, chiefless):
    """Probes the operator's Services rule out. Its headless Services publish
    a pod's DNS name only once the pod is ready, so nobody may have to reach a
    pod before it can be ready: the ps (the chief reaches them before they
    hold a job) and, without a Chief or without PS, the workers: worker 0 is
    ready once registered with the chief, and must be reached through its
    Service name before that, by its own chief duties (without a Chief) or
    by the chief loading its replica (without PS). The evaluator is left out
    of TF_CONFIG's cluster and listens on no gRPC port."""
    problems = []
    if role == "Evaluator":
        for kind in ("readinessProbe", "livenessProbe"):
            if (container.get(kind) or {}).get("grpc") is not None:
                problems.append(f"Evaluator: no gRPC {kind}: the operator leaves the evaluator out of "
                                "TF_CONFIG's cluster, so psflow-evaluator serves no gRPC port")
    if container.get("readinessProbe") is None:
        return problems
    if role == "PS":
        problems.append("PS: no readinessProbe: the operator's headless Services publish a pod's name only "
                        "once it is ready, and a ps is ready only after the chief reached it")
    if role == "Worker" and all_reduce:
        problems.append("Worker: no readinessProbe without ps: the operator's headless Services publish a pod's "
                        "name only once it is ready, and the chief loads worker 0's replica through that name "
                        "before worker 0 can be ready (registered)")
    elif role == "Worker" and chiefless:
        problems.append("Worker: no readinessProbe without a Chief: the operator's headless Services publish a "
                        "pod's name only once it is ready, and worker 0 registers with its own chief duties "
                        "through that name before it can be ready")
    return problems


def tensorflow_container(specs, role):
    """(pod spec, the container named tensorflow) of a replica type, or
    (pod spec, None)."""
    pod = specs.get(role, {}).get("template", {}).get("spec", {})
    for c in pod.get("containers", []):
        if c.get("name") == "tensorflow":
            return pod, c
    return pod, None


def validate(schema, path):
    """Returns the problems of every TFJob in the file at `path`."""
    return validate_file(schema, path, "TFJob", psflow_problems)


def main(argv):
    return run_main(argv, "validate_tfjob", "TFJob", __doc__.strip().splitlines()[-2], tfjob_schema, validate)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
