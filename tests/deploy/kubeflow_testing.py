"""What the tests of psflow's Kubeflow manifests (deploy/tfjob,
deploy/pytorchjob) share: the repository's root, deploy/ on the import path
(for the validators), the CRD each is checked against and a main that skips
(exit 77) without it."""
import os
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "deploy"))


def crd(env_var, file_name):
    """The CRD at $env_var, else shared/schemas/<file_name> beside the repository."""
    return os.environ.get(env_var, os.path.join(ROOT, "..", "shared", "schemas", file_name))


def manifests(folder):
    """The manifests deploy/<folder>/*.yaml, in name order."""
    directory = os.path.join(ROOT, "deploy", folder)
    return [os.path.join(directory, f) for f in sorted(os.listdir(directory)) if f.endswith(".yaml")]


def main(kind, crd_path, env_var):
    """Runs the calling script's tests, or skips them (77) without the CRD of `kind`."""
    if not os.path.exists(crd_path):
        print(f"SKIPPED: no {kind} CRD at {crd_path} (set {env_var})")
        sys.exit(77)
    unittest.main()
