#!/usr/bin/env python3
"""Tests deploy/validate_tfjob.py on psflow's TFJob manifests and on broken
copies of them. Needs the Kubeflow TFJob CRD (shared/schemas beside the
repository, or PSFLOW_TFJOB_CRD); exits 77 (skipped) without it."""
import copy
import os
import sys
import tempfile
import unittest

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "deploy"))
import validate_tfjob  # noqa: E402

CRD = os.environ.get("PSFLOW_TFJOB_CRD",
                     os.path.join(ROOT, "..", "shared", "schemas", "kubeflow.org_tfjobs.yaml"))
MANIFESTS = [os.path.join(ROOT, "deploy", "tfjob", f)
             for f in sorted(os.listdir(os.path.join(ROOT, "deploy", "tfjob"))) if f.endswith(".yaml")]


class ValidateTfjobTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.schema = validate_tfjob.tfjob_schema(CRD)

    def problems_of(self, mutate):
        """Validates a mutated copy of the first manifest's documents."""
        with open(MANIFESTS[0]) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        job = next(d for d in docs if d["kind"] == "TFJob")
        mutate(job)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as out:
            yaml.safe_dump_all(docs, out)
        try:
            return validate_tfjob.validate(self.schema, out.name)
        finally:
            os.unlink(out.name)

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
        def chiefless(j):
            # The Helm/Estimator shape: no Chief; worker 0 runs its duties
            # and takes its storage and flags.
            specs = j["spec"]["tfReplicaSpecs"]
            chief = specs.pop("Chief")
            worker = specs["Worker"]["template"]["spec"]
            worker["volumes"] = worker.get("volumes", []) + [
                v for v in chief["template"]["spec"].get("volumes", []) if "persistentVolumeClaim" in v]
        self.assertFalse(any("Chief" in p or "storage" in p for p in self.problems_of(chiefless)),
                         self.problems_of(chiefless))
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
        with open(MANIFESTS[0]) as f:
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


if __name__ == "__main__":
    if not os.path.exists(CRD):
        print(f"SKIPPED: no TFJob CRD at {CRD} (set PSFLOW_TFJOB_CRD)")
        sys.exit(77)
    unittest.main()
