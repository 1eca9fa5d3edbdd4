#!/usr/bin/env python3
"""Tests deploy/validate_tfjob.py on psflow's TFJob manifests and on broken
copies of them. Needs the Kubeflow TFJob CRD (shared/schemas beside the
repository, or PSFLOW_TFJOB_CRD); exits 77 (skipped) without it."""
import copy
import os
import tempfile
import unittest

import yaml

import kubeflow_testing  # puts deploy/ on the import path
import validate_tfjob  # noqa: E402

CRD = kubeflow_testing.crd("PSFLOW_TFJOB_CRD", "kubeflow.org_tfjobs.yaml")
MANIFESTS = kubeflow_testing.manifests("tfjob")


def has_replicas(path, *roles):
    with open(path) as f:
        job = next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "TFJob")
    return all(r in job["spec"]["tfReplicaSpecs"] for r in roles)


# The broken copies start from the first manifest with every role, or from the
# first of workers only (the all-reduce shape).
FULL = next(p for p in MANIFESTS if has_replicas(p, "Chief", "PS", "Worker", "Evaluator"))
ALL_REDUCE = next(p for p in MANIFESTS if not has_replicas(p, "PS") and not has_replicas(p, "Chief"))


class ValidateTfjobTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.schema = validate_tfjob.tfjob_schema(CRD)

    def problems_of(self, mutate, manifest=FULL, mutate_docs=None):
        """Validates a mutated copy of a manifest's documents (mutate_docs, if
        given, changes the other documents); every problem is one line."""
        with open(manifest) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        job = next(d for d in docs if d["kind"] == "TFJob")
        mutate(job)
        if mutate_docs is not None:
            mutate_docs(docs)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as out:
            yaml.safe_dump_all(docs, out)
        try:
            problems = validate_tfjob.validate(self.schema, out.name)
        finally:
            os.unlink(out.name)
        for p in problems:
            self.assertNotIn("\n", p)
        return problems

    def test_manifests_pass(self):
        self.assertTrue(MANIFESTS)
        for path in MANIFESTS:
            self.assertEqual(validate_tfjob.validate(self.schema, path), [], path)

    def test_unknown_field_refused(self):
        problems = self.problems_of(lambda j: j["spec"].update({"tfReplicaSpec": {}}))
        self.assertTrue(any("tfReplicaSpec" in p for p in problems), problems)
        problems = self.problems_of(
            lambda j: j["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0].update({"imag": "x"}))
        self.assertTrue(any("imag" in p for p in problems), problems)

    def test_wrong_type_refused(self):
        problems = self.problems_of(lambda j: j["spec"]["tfReplicaSpecs"]["Worker"].update({"replicas": "two"}))
        self.assertTrue(any("replicas" in p for p in problems), problems)

    def test_psflow_needs(self):
        def rename(j):
            j["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "psflow"
        self.assertTrue(any("tensorflow" in p for p in self.problems_of(rename)))
        def never(j):
            j["spec"]["tfReplicaSpecs"]["PS"]["restartPolicy"] = "Never"
        self.assertTrue(any("ExitCode" in p for p in self.problems_of(never)))
        def two_chiefs(j):
            j["spec"]["tfReplicaSpecs"]["Chief"]["replicas"] = 2
        self.assertTrue(any("one Chief" in p for p in self.problems_of(two_chiefs)))
        def worker_volume(j):
            pod = j["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]
            pod["volumes"] = copy.deepcopy(j["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]["volumes"])
        self.assertTrue(any("only the chief" in p for p in self.problems_of(worker_volume)))
        def chiefless_with_readiness(j):
            # The Helm/Estimator shape: no Chief; worker 0 runs its duties
            # and takes its storage and flags.
            specs = j["spec"]["tfReplicaSpecs"]
            chief = specs.pop("Chief")
            worker = specs["Worker"]["template"]["spec"]
            worker["volumes"] = worker.get("volumes", []) + [
                v for v in chief["template"]["spec"].get("volumes", []) if "persistentVolumeClaim" in v]
            chief_container = chief["template"]["spec"]["containers"][0]
            worker["containers"][0]["volumeMounts"] += [
                m for m in chief_container["volumeMounts"] if m["name"] == "data"]
            worker["containers"][0]["args"] += [
                a for a in chief_container["args"] if not a.startswith(("--tls_", "--auth_", "--metrics_"))]
        def chiefless(j):
            # Worker 0 reaches its own chief duties through its Service name,
            # which is published once it is ready (registered): no readiness probe.
            chiefless_with_readiness(j)
            j["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].pop("readinessProbe")
        def read_write_many(docs):
            for d in docs:
                if d["kind"] == "PersistentVolumeClaim":
                    d["spec"]["accessModes"] = ["ReadWriteMany"]
        self.assertEqual(self.problems_of(chiefless, mutate_docs=read_write_many), [])
        # Every Worker pod mounts the claim (one template): ReadWriteOnce ties them to one node.
        problems = self.problems_of(chiefless)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("Worker: its 2 pods share one template, so each mounts claim", problems[0])
        self.assertIn("make it ReadWriteMany", problems[0])
        problems = self.problems_of(chiefless_with_readiness, mutate_docs=read_write_many)
        self.assertTrue(any(p.endswith("Worker: no readinessProbe without a Chief: the operator's headless Services "
                                       "publish a pod's name only once it is ready, and worker 0 registers with its "
                                       "own chief duties through that name before it can be ready")
                            for p in problems), problems)
        def chiefless_without_flags(j):
            chiefless(j)
            c = j["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
            c["args"] = [a for a in c["args"] if not a.startswith("--model_dir")]
        self.assertTrue(any("Worker (worker 0 is the chief): the chief's job flags need --model_dir" in p
                            for p in self.problems_of(chiefless_without_flags, mutate_docs=read_write_many)))
        def wrong_binary(j):
            j["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0]["command"] = ["psflow-worker"]
        self.assertTrue(any(p.endswith("PS: the container runs psflow-worker, but the operator makes it a ps "
                                       "(TF_CONFIG's task): run psflow-ps") for p in self.problems_of(wrong_binary)))
        def model_dir_on_empty_dir(j):
            for v in j["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]["volumes"]:
                if v["name"] == "data":
                    v.pop("persistentVolumeClaim")
                    v["emptyDir"] = {}
        self.assertTrue(any("Chief: --model_dir=/data/run is on volume data (emptyDir), which does not keep" in p
                            for p in self.problems_of(model_dir_on_empty_dir)))
        def ps_gpu(j):
            c = j["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0]
            c.setdefault("resources", {})["limits"] = {"nvidia.com/gpu": 1}
        self.assertTrue(any("only workers" in p for p in self.problems_of(ps_gpu)))
        def gpu_without_device(j):
            c = j["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
            c.setdefault("resources", {})["limits"] = {"nvidia.com/gpu": 1}
            c["args"] = []
        self.assertTrue(any("--device=cuda" in p for p in self.problems_of(gpu_without_device)))

    def test_gpus_per_worker_agree_with_the_chief(self):
        def container(j, role):
            return j["spec"]["tfReplicaSpecs"][role]["template"]["spec"]["containers"][0]

        def two_gpus(device, replicas):
            def mutate(j):
                w = container(j, "Worker")
                w.setdefault("resources", {})["limits"] = {"nvidia.com/gpu": 2}
                w["args"] = [a for a in w["args"] if not a.startswith("--device")] + [f"--device={device}"]
                chief = container(j, "Chief")
                chief["args"] = [a for a in chief["args"] if not a.startswith("--replicas_per_worker")]
                if replicas:
                    chief["args"].append(f"--replicas_per_worker={replicas}")
            return mutate

        self.assertEqual(self.problems_of(two_gpus("cuda:all", 2)), [])
        self.assertEqual(self.problems_of(two_gpus("cuda:0,cuda:1", 2)), [])
        problems = self.problems_of(two_gpus("cuda:0", 2))
        self.assertTrue(any("--device=cuda:0 drives 1" in p for p in problems), problems)
        problems = self.problems_of(two_gpus("cuda:all", None))
        self.assertTrue(any("--replicas_per_worker=1" in p for p in problems), problems)
        problems = self.problems_of(two_gpus("cuda:all", "two"))
        self.assertTrue(any("is not a count" in p for p in problems), problems)

    def test_security_flags(self):
        def pod(j, role):
            return j["spec"]["tfReplicaSpecs"][role]["template"]["spec"]
        # The manifests mount a Secret on every replica: that is not storage.
        self.assertTrue(all("tls" in [v["name"] for v in pod(self.first_job(), r)["volumes"]]
                            for r in ("PS", "Worker", "Evaluator")))
        def worker_in_plaintext(j):
            c = pod(j, "Worker")["containers"][0]
            c["args"] = [a for a in c["args"] if not a.startswith(("--tls_", "--auth_token_file"))]
        self.assertTrue(any("same security flags" in p for p in self.problems_of(worker_in_plaintext)))
        # Every replica in plaintext without a token: each that listens would exit 1.
        def all_in_plaintext(j, extra=()):
            for role in j["spec"]["tfReplicaSpecs"]:
                c = pod(j, role)["containers"][0]
                c["args"] = [a for a in c["args"] if not a.startswith(("--tls_", "--auth_token_file"))]
                c["args"] += list(extra)
        problems = self.problems_of(all_in_plaintext)
        self.assertTrue(any(": PS: neither mutual TLS" in p for p in problems), problems)
        self.assertTrue(any(": Worker: neither mutual TLS" in p for p in problems), problems)
        self.assertFalse(any(": Evaluator: neither" in p for p in problems), problems)
        problems = self.problems_of(lambda j: all_in_plaintext(j, ["--insecure"]))
        self.assertFalse(any("neither mutual TLS" in p for p in problems), problems)
        def no_key(j):
            c = pod(j, "PS")["containers"][0]
            c["args"] = [a for a in c["args"] if not a.startswith("--tls_key")]
        self.assertTrue(any("needs all of --tls_cert" in p for p in self.problems_of(no_key)))
        def writable(j):
            for m in pod(j, "Worker")["containers"][0]["volumeMounts"]:
                m.pop("readOnly", None)
        self.assertTrue(any("read-only" in p for p in self.problems_of(writable)))
        def unmounted(j):
            pod(j, "Evaluator")["containers"][0]["volumeMounts"] = []
        self.assertTrue(any("is on no volume" in p for p in self.problems_of(unmounted)))
        def from_empty_dir(j):
            for v in pod(j, "PS")["volumes"]:
                v.pop("secret", None)
                v["emptyDir"] = {}
        problems = self.problems_of(from_empty_dir)
        self.assertTrue(any("should come from a Secret" in p for p in problems), problems)
        self.assertTrue(any("only the chief needs storage" in p for p in problems), problems)

    def first_job(self):
        with open(FULL) as f:
            return next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "TFJob")
    def test_probes_and_scrape_annotations(self):
        def pod(j, role):
            return j["spec"]["tfReplicaSpecs"][role]["template"]
        def container(j, role):
            return pod(j, role)["spec"]["containers"][0]
        def grpc_liveness_with_tls(j):
            container(j, "Worker")["livenessProbe"] = {"grpc": {"port": 2222, "service": "liveness"}}
        self.assertTrue(any("Worker: a gRPC livenessProbe cannot pass mutual TLS" in p
                            for p in self.problems_of(grpc_liveness_with_tls)))
        def liveness_of_readiness(j):
            container(j, "Chief")["livenessProbe"]["httpGet"]["path"] = "/readyz"
        self.assertTrue(any("Chief: the httpGet livenessProbe must GET /healthz" in p
                            for p in self.problems_of(liveness_of_readiness)))
        def probe_on_grpc_port(j):
            container(j, "Evaluator")["readinessProbe"]["httpGet"]["port"] = 2222
        self.assertTrue(any("Evaluator: the httpGet readinessProbe asks port 2222" in p
                            for p in self.problems_of(probe_on_grpc_port)))
        def evaluator_grpc(j):
            container(j, "Evaluator")["readinessProbe"] = {"grpc": {"port": 2222}}
        self.assertTrue(any("Evaluator: no gRPC readinessProbe" in p for p in self.problems_of(evaluator_grpc)))
        def ps_readiness(j):
            container(j, "PS")["readinessProbe"] = {"httpGet": {"path": "/readyz", "port": 9090}}
        self.assertTrue(any("PS: no readinessProbe" in p for p in self.problems_of(ps_readiness)))
        def wrong_port(j):
            pod(j, "Chief")["metadata"]["annotations"]["prometheus.io/port"] = "9999"
        self.assertTrue(any("--metrics_port=9999" in p for p in self.problems_of(wrong_port)))
        def no_flag(j):
            c = container(j, "PS")
            c["args"] = [a for a in c["args"] if not a.startswith("--metrics_port")]
        self.assertTrue(any(p.endswith("PS: prometheus.io/port is '9090' but the container has no "
                                       "--metrics_port=9090") for p in self.problems_of(no_flag)))
        def evaluator_without_flag(j):
            c = container(j, "Evaluator")
            c["args"] = [a for a in c["args"] if not a.startswith("--metrics_port")]
        self.assertTrue(any(p.endswith("Evaluator: prometheus.io/port is '9090' but the container has "
                                       "no --metrics_port=9090")
                            for p in self.problems_of(evaluator_without_flag)))

    def test_all_reduce(self):
        """Workers only: no ps, worker 0 runs the chief's duties; the workers
        all-reduce their gradients."""
        def worker(j):
            return j["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        self.assertEqual(self.problems_of(lambda j: None, ALL_REDUCE), [])
        def readiness(j):
            worker(j)["readinessProbe"] = {"httpGet": {"path": "/readyz", "port": 9090}}
        self.assertTrue(any("Worker: no readinessProbe without ps" in p
                            for p in self.problems_of(readiness, ALL_REDUCE)))
        # With a chief and ps, a worker's readiness probe is fine (nobody calls a worker).
        self.assertFalse(any("readinessProbe" in p for p in self.problems_of(lambda j: None)))
        # A Chief and workers without ps: the chief loads worker 0's replica through its name.
        def with_chief(j):
            with open(FULL) as f:
                full = next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "TFJob")
            chief = full["spec"]["tfReplicaSpecs"]["Chief"]
            c = chief["template"]["spec"]["containers"][0]
            c["args"] = [a for a in c["args"] if not a.startswith("--replicas_per_worker")]
            j["spec"]["tfReplicaSpecs"]["Chief"] = chief
            worker(j)["args"] = [a for a in worker(j)["args"] if a.startswith(("--tls_", "--auth_", "--metrics_"))]
            j["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"] = [
                v for v in j["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"] if "secret" in v]
            worker(j)["volumeMounts"] = [m for m in worker(j)["volumeMounts"] if m["name"] == "tls"]
        self.assertEqual(self.problems_of(with_chief, ALL_REDUCE), [])
        def with_chief_and_readiness(j):
            with_chief(j)
            readiness(j)
        self.assertTrue(any("Worker: no readinessProbe without ps" in p
                            for p in self.problems_of(with_chief_and_readiness, ALL_REDUCE)))
        def asynchronous(j):
            worker(j)["args"].append("--mode=async")
        self.assertTrue(any(p.endswith("--mode=async needs parameter servers: a cluster without ps trains "
                                       "synchronously") for p in self.problems_of(asynchronous, ALL_REDUCE)))
        def chief_asynchronous(j):
            j["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]["containers"][0]["args"].append("--mode=async")
        self.assertEqual(self.problems_of(chief_asynchronous), [])  # with ps: fine
        def global_batch(n):
            return lambda j: worker(j)["args"].append(f"--global_batch_size={n}")
        self.assertEqual(self.problems_of(global_batch(128), ALL_REDUCE), [])
        self.assertTrue(any("--global_batch_size=129 is not a multiple of the 2 model replicas" in p
                            for p in self.problems_of(global_batch(129), ALL_REDUCE)))
        def no_model_dir(j):
            worker(j)["args"] = [a for a in worker(j)["args"] if not a.startswith("--model_dir")]
        self.assertTrue(any("need --model_dir" in p for p in self.problems_of(no_model_dir, ALL_REDUCE)))
        def read_write_once(docs):
            for d in docs:
                if d["kind"] == "PersistentVolumeClaim":
                    d["spec"]["accessModes"] = ["ReadWriteOnce"]
        self.assertTrue(any("is ReadWriteOnce: one node only; make it ReadWriteMany" in p
                            for p in self.problems_of(lambda j: None, ALL_REDUCE, read_write_once)))
        def one_worker(j):
            j["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] = 1
        self.assertTrue(any("the operator gives a TFJob of one replica no TF_CONFIG" in p
                            for p in self.problems_of(one_worker, ALL_REDUCE)))


if __name__ == "__main__":
    kubeflow_testing.main("TFJob", CRD, "PSFLOW_TFJOB_CRD")
