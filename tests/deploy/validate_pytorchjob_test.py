#!/usr/bin/env python3
"""Tests deploy/validate_pytorchjob.py on psflow's PyTorchJob manifests and on
broken copies of them: each breakage is named in one line. Needs the Kubeflow
PyTorchJob CRD (shared/schemas beside the repository, or
PSFLOW_PYTORCHJOB_CRD); exits 77 (skipped) without it."""
import contextlib
import io
import os
import tempfile
import unittest

import yaml

import kubeflow_testing  # puts deploy/ on the import path
from kubeflow_testing import ROOT
import validate_pytorchjob  # noqa: E402

CRD = kubeflow_testing.crd("PSFLOW_PYTORCHJOB_CRD", "kubeflow.org_pytorchjobs.yaml")
MANIFESTS = kubeflow_testing.manifests("pytorchjob")


def replica(j, role):
    return j["spec"]["pytorchReplicaSpecs"][role]


def pod(j, role):
    return replica(j, role)["template"]["spec"]


def container(j, role):
    return next(c for c in pod(j, role)["containers"] if c["name"] == "pytorch")


class ValidatePytorchjobTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.schema = validate_pytorchjob.pytorchjob_schema(CRD)

    def write(self, mutate, mutate_docs=None):
        """A mutated copy of the first manifest's documents, in a file."""
        with open(MANIFESTS[0]) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        mutate(next(d for d in docs if d["kind"] == "PyTorchJob"))
        if mutate_docs is not None:
            mutate_docs(docs)
        out = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        with out:
            yaml.safe_dump_all(docs, out)
        self.addCleanup(os.unlink, out.name)
        return out.name

    def problems_of(self, mutate, mutate_docs=None):
        """The problems of a mutated copy; every one is a single line."""
        problems = validate_pytorchjob.validate(self.schema, self.write(mutate, mutate_docs))
        for p in problems:
            self.assertNotIn("\n", p)
        return problems

    def assertProblem(self, mutate, text):
        problems = self.problems_of(mutate)
        self.assertTrue(any(text in p for p in problems), f"{text!r} not in {problems}")

    def test_manifests_pass(self):
        self.assertTrue(MANIFESTS)
        for path in MANIFESTS:
            self.assertEqual(validate_pytorchjob.validate(self.schema, path), [], path)

    def test_command_line(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(validate_pytorchjob.main(["validate_pytorchjob.py", CRD] + MANIFESTS), 0)
        self.assertEqual(out.getvalue().splitlines(), [f"ok: {p}" for p in MANIFESTS])
        def broken(j):
            replica(j, "Master")["replicas"] = 2
            replica(j, "Worker")["restartPolicy"] = "Never"
        path = self.write(broken)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(validate_pytorchjob.main(["validate_pytorchjob.py", CRD, path]), 1)
        lines = out.getvalue().splitlines()
        self.assertEqual(len(lines), 2, lines)
        self.assertTrue(all(line.startswith(f"{path}: PyTorchJob psflow-mnist-pytorch: ") for line in lines))
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(validate_pytorchjob.main(["validate_pytorchjob.py", "/nonexistent.yaml", path]), 2)
        self.assertIn("cannot read the PyTorchJob CRD /nonexistent.yaml", err.getvalue())

    def test_not_a_pytorchjob(self):
        tfjob = os.path.join(ROOT, "deploy", "tfjob", "tfjob.yaml")
        self.assertEqual(validate_pytorchjob.validate(self.schema, tfjob), [f"{tfjob}: no PyTorchJob"])

    def test_schema(self):
        self.assertProblem(lambda j: j["spec"].update({"pytorchReplicaSpec": {}}), "pytorchReplicaSpec")
        self.assertProblem(lambda j: container(j, "Worker").update({"imag": "x"}), "imag")
        self.assertProblem(lambda j: replica(j, "Worker").update({"replicas": "two"}), "replicas")

    def test_replicas(self):
        def no_master(j):
            del j["spec"]["pytorchReplicaSpecs"]["Master"]
        self.assertProblem(no_master, "needs a Master replica: the operator sets MASTER_ADDR")
        self.assertProblem(lambda j: replica(j, "Master").update({"replicas": 2}), "exactly one Master replica")
        def ps(j):
            j["spec"]["pytorchReplicaSpecs"]["PS"] = replica(j, "Worker")
        self.assertProblem(ps, "PS: psflow runs Master and Worker replicas only")
        # More workers: only the Worker's count changes.
        self.assertEqual(self.problems_of(lambda j: replica(j, "Worker").update({"replicas": 3})), [])
        self.assertProblem(lambda j: j["spec"].update({"elasticPolicy": {"minReplicas": 1, "maxReplicas": 3}}),
                           "elasticPolicy: psflow's all-reduce group has a fixed set of workers")
        self.assertProblem(lambda j: j["spec"].update({"nprocPerNode": "2"}),
                           "nprocPerNode is '2': psflow runs one process per pod")
        self.assertEqual(self.problems_of(lambda j: j["spec"].update({"nprocPerNode": "auto"})), [])

    def test_restart_policy(self):
        self.assertProblem(lambda j: replica(j, "Worker").update({"restartPolicy": "Never"}),
                           "Worker: restartPolicy is Never; it should be ExitCode (or OnFailure)")
        self.assertProblem(lambda j: replica(j, "Master").pop("restartPolicy"),
                           "Master: restartPolicy is Never (the default); it should be ExitCode")
        def on_failure(j):
            for role in ("Master", "Worker"):
                replica(j, role)["restartPolicy"] = "OnFailure"
        self.assertEqual(self.problems_of(on_failure), [])

    def test_container_and_port(self):
        def rename(j):
            container(j, "Worker")["name"] = "psflow"
        self.assertProblem(rename, "Worker: no container named 'pytorch'")
        def no_port(j):
            container(j, "Master")["ports"] = [p for p in container(j, "Master")["ports"]
                                               if p["name"] != "pytorchjob-port"]
        self.assertProblem(no_port, "Master: the 'pytorch' container has no port named pytorchjob-port")
        def other_port(j):
            next(p for p in container(j, "Worker")["ports"] if p["name"] == "pytorchjob-port")["containerPort"] = 2222
        self.assertProblem(other_port, "every replica's pytorchjob-port must be the Master's")
        def metrics_on_it(j):
            c = container(j, "Worker")
            c["args"] = [a.replace("--metrics_port=9090", "--metrics_port=23456") for a in c["args"]]
        self.assertProblem(metrics_on_it, "Worker: --metrics_port=23456 is the pytorchjob-port too")

    def test_every_container_runs_psflow_worker(self):
        self.assertProblem(lambda j: container(j, "Master").update({"command": ["psflow-chief"]}),
                           "Master: container 'pytorch' runs psflow-chief, not psflow-worker")
        self.assertProblem(lambda j: container(j, "Worker").pop("command"),
                           "Worker: container 'pytorch' runs the image default, not psflow-worker")
        def sidecar(j):
            pod(j, "Master")["containers"].append({"name": "tensorboard", "image": "tensorboard",
                                                   "command": ["tensorboard"]})
        self.assertProblem(sidecar, "Master: container 'tensorboard' runs tensorboard, not psflow-worker")

    def test_job_flags_and_storage(self):
        def without(flag):
            def mutate(j):
                c = container(j, "Master")
                c["args"] = [a for a in c["args"] if not a.startswith(flag)]
            return mutate
        self.assertProblem(without("--model_dir"),
                           "Master: the job flags (rank 0 runs the chief's duties) need --model_dir")
        def unmounted(j):
            container(j, "Master")["volumeMounts"] = [m for m in container(j, "Master")["volumeMounts"]
                                                      if m["name"] != "data"]
        self.assertProblem(unmounted, "Master: --model_dir=/data/run is on no volume")
        def empty_dir(j):
            volume = next(v for v in pod(j, "Master")["volumes"] if v["name"] == "data")
            volume.pop("persistentVolumeClaim")
            volume["emptyDir"] = {}
        self.assertProblem(empty_dir, "Master: --model_dir=/data/run is on volume data (emptyDir)")
        def worker_storage(j):
            pod(j, "Worker")["volumes"].append({"name": "data", "persistentVolumeClaim": {"claimName": "x"}})
        self.assertProblem(worker_storage, "Worker: only the Master needs storage")
        def cluster_flag(j):
            container(j, "Worker")["args"].append("--worker_hosts=a:1,b:1")
        self.assertProblem(cluster_flag, "Worker: --worker_hosts would override the cluster the operator describes")
        self.assertProblem(lambda j: container(j, "Master")["args"].append("--mode=ssp"),
                           "--mode=ssp needs parameter servers: a cluster without ps trains synchronously")
        def global_batch(n):
            return lambda j: container(j, "Master")["args"].append(f"--global_batch_size={n}")
        self.assertEqual(self.problems_of(global_batch(128)), [])
        self.assertProblem(global_batch(127), "--global_batch_size=127 is not a multiple of the 2 model replicas "
                                              "(2 workers x 1)")

    def test_probes_and_scrape_annotations(self):
        def readiness(path):
            def mutate(j):
                container(j, "Worker")["readinessProbe"] = {"httpGet": {"path": path, "port": 9090}}
            return mutate
        self.assertEqual(self.problems_of(readiness("/readyz")), [])
        self.assertProblem(readiness("/healthz"), "Worker: the httpGet readinessProbe must GET /readyz")
        def grpc_liveness(j):
            container(j, "Master")["livenessProbe"] = {"grpc": {"port": 23456, "service": "liveness"}}
        self.assertProblem(grpc_liveness, "Master: a gRPC livenessProbe cannot pass mutual TLS")
        def wrong_path(j):
            container(j, "Master")["livenessProbe"]["httpGet"]["path"] = "/readyz"
        self.assertProblem(wrong_path, "Master: the httpGet livenessProbe must GET /healthz")
        def wrong_port(j):
            replica(j, "Worker")["template"]["metadata"]["annotations"]["prometheus.io/port"] = "9999"
        self.assertProblem(wrong_port, "Worker: prometheus.io/port is '9999' but the container has no "
                                       "--metrics_port=9999")

    def test_security_flags(self):
        def plaintext(j):
            c = container(j, "Worker")
            c["args"] = [a for a in c["args"] if not a.startswith(("--tls_", "--auth_token_file"))]
        self.assertProblem(plaintext, "every replica needs the same security flags")
        self.assertProblem(plaintext, "Worker: neither mutual TLS (--tls_cert, --tls_key, --tls_ca) nor "
                                      "--auth_token_file")
        def plaintext_insecure(j):
            for role in ("Master", "Worker"):
                c = container(j, role)
                c["args"] = [a for a in c["args"] if not a.startswith(("--tls_", "--auth_token_file"))]
                c["args"].append("--insecure")
        self.assertEqual(self.problems_of(plaintext_insecure), [])
        def writable(j):
            for m in container(j, "Master")["volumeMounts"]:
                m.pop("readOnly", None)
        self.assertProblem(writable, "Master: mount /etc/psflow/tls (certificates, keys, token) read-only")
        def no_key(j):
            c = container(j, "Master")
            c["args"] = [a for a in c["args"] if not a.startswith("--tls_key")]
        self.assertProblem(no_key, "Master: mutual TLS needs all of --tls_cert, --tls_key and --tls_ca")

    def test_gpus(self):
        def gpus(n, device, replicas):
            def mutate(j):
                for role in ("Master", "Worker"):
                    c = container(j, role)
                    c["resources"]["limits"] = {"nvidia.com/gpu": n}
                    c["args"] = c["args"] + [f"--device={device}"]
                if replicas:
                    container(j, "Master")["args"].append(f"--replicas_per_worker={replicas}")
            return mutate
        self.assertEqual(self.problems_of(gpus(2, "cuda:all", 2)), [])
        self.assertEqual(self.problems_of(gpus(1, "cuda:0", None)), [])
        self.assertProblem(gpus(2, "cuda:all", None), "pods have 2 GPUs each but the chief runs "
                                                      "--replicas_per_worker=1")
        self.assertProblem(gpus(2, "cuda:0", 2), "Master: 2 GPUs are requested but --device=cuda:0 drives 1")
        def no_device(j):
            container(j, "Worker")["resources"]["limits"] = {"nvidia.com/gpu": 1}
        self.assertProblem(no_device, "Worker: a GPU is requested but the container has no --device=cuda:N")


if __name__ == "__main__":
    kubeflow_testing.main("PyTorchJob", CRD, "PSFLOW_PYTORCHJOB_CRD")
