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
        def ps_gpu(j):
            c = j["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0]
            c.setdefault("resources", {})["limits"] = {"nvidia.com/gpu": 1}
        self.assertTrue(any("only workers" in p for p in self.problems_of(ps_gpu)))
        def gpu_without_device(j):
            c = j["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
            c.setdefault("resources", {})["limits"] = {"nvidia.com/gpu": 1}
            c["args"] = []
        self.assertTrue(any("--device=cuda" in p for p in self.problems_of(gpu_without_device)))


if __name__ == "__main__":
    if not os.path.exists(CRD):
        print(f"SKIPPED: no TFJob CRD at {CRD} (set PSFLOW_TFJOB_CRD)")
        sys.exit(77)
    unittest.main()
