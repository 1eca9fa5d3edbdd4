#!/usr/bin/env python3
"""Checks the plain-Kubernetes kustomize base (deploy/kubernetes): the
StatefulSets, headless Services and CLUSTER_CONFIG agree with each other and
with what psflow reads (POD_NAME <prefix>-<role>-<index>, addresses
<pod>.<service>:port), only the chief has storage, every role stays up after
the job (--exit_when_done=false), every role runs with mutual TLS and the job
token from the Secret, mounted read-only with its own role's key only, HTTP
readiness and liveness probes and Prometheus annotations agree with the flags;
and, where kubectl is installed, that `kubectl kustomize` renders it, and
that the GPU overlay (deploy/kubernetes-gpu) turns its one gpus-per-worker
value into the workers' GPUs and the chief's --replicas_per_worker, leaving
everything else of the base as it is."""
import json
import os
import shutil
import subprocess
import unittest

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(ROOT, "deploy", "kubernetes")
GPU_OVERLAY = os.path.join(ROOT, "deploy", "kubernetes-gpu")


def load_base():
    with open(os.path.join(BASE, "kustomization.yaml")) as f:
        kustomization = yaml.safe_load(f)
    objects = []
    for name in kustomization["resources"]:
        with open(os.path.join(BASE, name)) as f:
            objects += [d for d in yaml.safe_load_all(f) if d]
    (generator,) = kustomization["configMapGenerator"]
    (config_file,) = generator["files"]
    with open(os.path.join(BASE, config_file)) as f:
        cluster = json.load(f)
    return kustomization, objects, generator["name"], config_file, cluster


class KustomizeBaseTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.kustomization, objects, cls.config_map, cls.config_key, cls.cluster = load_base()
        cls.services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
        cls.sets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "StatefulSet"}

    def test_one_statefulset_and_headless_service_per_role(self):
        self.assertEqual(sorted(self.cluster), ["chief", "evaluator", "ps", "worker"])
        for role, addresses in self.cluster.items():
            name = f"psflow-{role}"
            sts = self.sets[name]
            self.assertEqual(sts["spec"]["replicas"], len(addresses), role)
            service = self.services[sts["spec"]["serviceName"]]
            self.assertEqual(service["spec"]["clusterIP"], "None", role)
            self.assertTrue(service["spec"].get("publishNotReadyAddresses"), role)
            labels = sts["spec"]["template"]["metadata"]["labels"]
            for key, value in service["spec"]["selector"].items():
                self.assertEqual(labels.get(key), value, role)
            self.assertEqual(sts["spec"]["selector"]["matchLabels"].items() <= labels.items(), True)
            port = service["spec"]["ports"][0]["port"]
            # Pod i of StatefulSet s behind headless Service v is <s>-<i>.<v>.
            want = [f"{name}-{i}.{service['metadata']['name']}:{port}" for i in range(len(addresses))]
            self.assertEqual(addresses, want, role)

    def test_pods_read_their_role_and_the_cluster_from_the_environment(self):
        for role in self.cluster:
            (container,) = self.sets[f"psflow-{role}"]["spec"]["template"]["spec"]["containers"]
            self.assertEqual(container["command"], [f"psflow-{role}"])
            self.assertIn("--exit_when_done=false", container["args"])
            self.assertFalse(any(a.startswith(("--job_name", "--task_id")) for a in container["args"]))
            env = {e["name"]: e["valueFrom"] for e in container["env"]}
            self.assertEqual(env["POD_NAME"], {"fieldRef": {"fieldPath": "metadata.name"}})
            self.assertEqual(env["CLUSTER_CONFIG"]["configMapKeyRef"],
                             {"name": self.config_map, "key": self.config_key})
            self.assertEqual(container["ports"][0]["containerPort"], 2222)

    def test_probes_and_metrics(self):
        for role in self.cluster:
            template = self.sets[f"psflow-{role}"]["spec"]["template"]
            (container,) = template["spec"]["containers"]
            annotations = template["metadata"]["annotations"]
            # Probes over HTTP on the metrics port (a kubelet's gRPC probe cannot
            # pass mutual TLS): readiness /readyz, liveness /healthz, which holds
            # while the role waits for its peers.
            metrics_port = int(annotations["prometheus.io/port"])
            self.assertEqual(container["readinessProbe"]["httpGet"], {"path": "/readyz", "port": metrics_port},
                             role)
            self.assertEqual(container["livenessProbe"]["httpGet"], {"path": "/healthz", "port": metrics_port},
                             role)
            self.assertNotIn("grpc", container["readinessProbe"], role)
            self.assertEqual(annotations["prometheus.io/scrape"], "true", role)
            self.assertEqual(annotations["prometheus.io/path"], "/metrics", role)
            port = annotations["prometheus.io/port"]
            self.assertIn(f"--metrics_port={port}", container["args"], role)
            self.assertIn(int(port), [p["containerPort"] for p in container["ports"]], role)
        # Readiness must not hide a pod from its peers.
        for service in self.services.values():
            self.assertTrue(service["spec"].get("publishNotReadyAddresses"))

    def test_storage_on_the_chief_only(self):
        for role in self.cluster:
            spec = self.sets[f"psflow-{role}"]["spec"]
            claims = spec.get("volumeClaimTemplates", [])
            if role == "chief":
                self.assertEqual(claims[0]["spec"]["accessModes"], ["ReadWriteOnce"])
                (container,) = spec["template"]["spec"]["containers"]
                self.assertIn("--model_dir=/data/run", container["args"])
                self.assertEqual(container["volumeMounts"][0]["mountPath"], "/data")
            else:
                self.assertEqual(claims, [], role)
                volumes = spec["template"]["spec"].get("volumes", [])
                self.assertEqual([v for v in volumes if "secret" not in v], [], role)

    def test_every_role_has_its_own_certificate_and_the_token(self):
        secrets = set()
        for role in self.cluster:
            pod = self.sets[f"psflow-{role}"]["spec"]["template"]["spec"]
            (container,) = pod["containers"]
            (volume,) = [v for v in pod["volumes"] if "secret" in v]
            secrets.add(volume["secret"]["secretName"])
            files = {item["key"]: item["path"] for item in volume["secret"]["items"]}
            # Its own role's key and no other: a worker's pod cannot act as the chief.
            self.assertEqual(files, {k: k for k in ("ca.crt", "token", f"{role}.crt", f"{role}.key")})
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
            self.assertTrue(mount.get("readOnly"), role)
            where = mount["mountPath"]
            for flag, name in (("--tls_cert", f"{role}.crt"), ("--tls_key", f"{role}.key"),
                               ("--tls_ca", "ca.crt"), ("--auth_token_file", "token")):
                self.assertIn(f"{flag}={where}/{name}", container["args"], role)
            # The image's user (uid 10001) reads the files through the pod's group.
            self.assertEqual(pod["securityContext"]["fsGroup"], 10001, role)
            self.assertEqual(volume["secret"]["defaultMode"], 0o440, role)
        self.assertEqual(len(secrets), 1)

    @unittest.skipUnless(shutil.which("kubectl"), "kubectl is not installed")
    def test_kubectl_kustomize_renders(self):
        out = subprocess.run(["kubectl", "kustomize", BASE], check=True, capture_output=True, text=True).stdout
        rendered = [d for d in yaml.safe_load_all(out) if d]
        kinds = sorted(d["kind"] for d in rendered)
        self.assertEqual(kinds, ["ConfigMap"] + ["Service"] * 4 + ["StatefulSet"] * 4)
        (config_map,) = [d for d in rendered if d["kind"] == "ConfigMap"]
        self.assertEqual(json.loads(config_map["data"][self.config_key]), self.cluster)
        for d in rendered:
            if d["kind"] == "StatefulSet":
                (container,) = d["spec"]["template"]["spec"]["containers"]
                ref = [e for e in container["env"] if e["name"] == "CLUSTER_CONFIG"][0]
                # kustomize renames the generated ConfigMap and every reference to it.
                self.assertEqual(ref["valueFrom"]["configMapKeyRef"]["name"], config_map["metadata"]["name"])

    def test_gpu_overlay_targets_the_argument_it_appends(self):
        # The overlay's replacement names the chief's argument by position:
        # the one its patch appends after the base's.
        with open(os.path.join(GPU_OVERLAY, "kustomization.yaml")) as f:
            overlay = yaml.safe_load(f)
        (replacement,) = overlay["replacements"]
        chief_target = [t for t in replacement["targets"] if t["select"]["name"] == "psflow-chief"][0]
        index = int(chief_target["fieldPaths"][0].rsplit(".", 1)[1])
        with open(os.path.join(BASE, "chief.yaml")) as f:
            chief = yaml.safe_load(f)
        (container,) = chief["spec"]["template"]["spec"]["containers"]
        self.assertEqual(index, len(container["args"]))

    @unittest.skipUnless(shutil.which("kubectl"), "kubectl is not installed")
    def test_gpu_overlay_takes_one_gpus_per_worker_value(self):
        def render(path):
            out = subprocess.run(["kubectl", "kustomize", path], check=True, capture_output=True, text=True).stdout
            return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}

        base, gpu = render(BASE), render(GPU_OVERLAY)
        with open(os.path.join(GPU_OVERLAY, "kustomization.yaml")) as f:
            (literal,) = yaml.safe_load(f)["configMapGenerator"][0]["literals"]
        gpus = literal.split("=")[1]
        # The value itself is no object of the cluster.
        self.assertEqual(set(gpu), set(base))

        def container(objects, name):
            (c,) = objects[("StatefulSet", name)]["spec"]["template"]["spec"]["containers"]
            return c

        worker = container(gpu, "psflow-worker")
        self.assertEqual(worker["resources"]["limits"], {"nvidia.com/gpu": gpus})
        self.assertEqual(worker["image"], "psflow-cuda:latest")
        self.assertEqual(worker["args"], container(base, "psflow-worker")["args"] + ["--device=cuda:all"])
        chief = container(gpu, "psflow-chief")
        self.assertEqual(chief["args"], container(base, "psflow-chief")["args"] + [f"--replicas_per_worker={gpus}"])
        for name in ("psflow-chief", "psflow-ps", "psflow-evaluator"):
            self.assertNotIn("limits", container(gpu, name).get("resources", {}), name)


if __name__ == "__main__":
    unittest.main()
