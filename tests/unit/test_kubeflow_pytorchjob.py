"""jobs/kubeflow-pytorchjob.yaml against the Kubeflow training operator's PyTorchJob CRD
(kubeflow.org/v1): its openAPIV3Schema, as the API server checks a manifest, and the
operator's own admission checks (its webhook) that a schema cannot say.

The schema checked against is tests/unit/pytorchjob_v1_schema.json: the CRD's
openAPIV3Schema cut down to what the manifest reaches (openapi_subset.trim; the file
names the CRD it came from). After changing the manifest, regenerate it from the CRD
(kubeflow/training-operator, manifests/base/crds/kubeflow.org_pytorchjobs.yaml):

    python -m tests.unit.test_kubeflow_pytorchjob kubeflow.org_pytorchjobs.yaml

Set HVDLITE_PYTORCHJOB_CRD to that file to check against the whole schema as well.
"""
from __future__ import annotations

import copy
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.unit.openapi_subset import errors, trim

yaml = pytest.importorskip("yaml") if __name__ != "__main__" else __import__("yaml")
ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "jobs" / "kubeflow-pytorchjob.yaml"
SUBSET = Path(__file__).with_name("pytorchjob_v1_schema.json")
SOURCE = ("kubeflow/training-operator release-1.9 (078ec30ff26649a07d2e28893c332d4cef70e233), "
          "manifests/base/crds/kubeflow.org_pytorchjobs.yaml, spec.versions[v1]")
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def _manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _schema() -> dict:
    return json.loads(SUBSET.read_text())["openAPIV3Schema"]


def _crd_schema(crd: dict) -> dict:
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def test_the_manifest_passes_the_pytorchjob_schema() -> None:
    assert errors(_schema(), _manifest()) == []


def test_the_manifest_passes_the_whole_crd_schema_where_given() -> None:
    crd = os.environ.get("HVDLITE_PYTORCHJOB_CRD")
    if not crd:
        pytest.skip("HVDLITE_PYTORCHJOB_CRD is not set (the full CRD is not kept here)")
    assert errors(_crd_schema(yaml.safe_load(Path(crd).read_text())), _manifest()) == []


@pytest.mark.parametrize("break_it, complaint", [
    (lambda m: m["spec"].update(nprocPerNode=2), "spec.nprocPerNode: 2 is not of type string"),
    (lambda m: m["spec"].update(nProcPerNode="2"), "spec.nProcPerNode: unknown field"),
    (lambda m: m["spec"].pop("pytorchReplicaSpecs"),
     "spec: missing required field 'pytorchReplicaSpecs'"),
    (lambda m: m["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas="1"),
     "spec.pytorchReplicaSpecs.Worker.replicas: '1' is not of type integer"),
    (lambda m: _container(m, "Master").update(command="torchrun train.py"),
     "command: 'torchrun train.py' is not of type array"),
    (lambda m: _container(m, "Master")["resources"]["limits"].update(cpu="two"),
     "resources.limits.cpu: 'two' does not match"),
    (lambda m: _container(m, "Worker").pop("name"), "containers[0]: missing required field 'name'"),
])
def test_the_schema_check_catches_a_broken_manifest(break_it: Any, complaint: str) -> None:
    """The check is not vacuous: each of these breaks the manifest the way a typo would."""
    broken = copy.deepcopy(_manifest())
    break_it(broken)
    assert any(complaint in line for line in errors(_schema(), broken)), errors(_schema(), broken)


def _container(manifest: dict, role: str) -> dict:
    return manifest["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]


def test_the_manifest_passes_the_operators_admission_checks() -> None:
    """What the operator's webhook (pkg/webhooks/pytorch) refuses, checked here."""
    manifest = _manifest()
    assert (manifest["apiVersion"], manifest["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert DNS_1035.match(manifest["metadata"]["name"])
    roles = manifest["spec"]["pytorchReplicaSpecs"]
    assert set(roles) <= {"Master", "Worker"} and roles["Master"]["replicas"] == 1
    for role in roles.values():
        containers = role["template"]["spec"]["containers"]
        assert all(c.get("image") for c in containers)
        assert any(c["name"] == "pytorch" for c in containers)   # gets the PET_* variables


def test_every_pod_runs_torchrun_so_hvdlite_opens_the_torch_transport() -> None:
    """hvdlite picks the torch transport by TORCHELASTIC_RUN_ID, which torchrun sets:
    a pod running ``python train.py`` itself would look for MPI instead."""
    nproc = int(_manifest()["spec"]["nprocPerNode"])
    for role in _manifest()["spec"]["pytorchReplicaSpecs"].values():
        pytorch = next(c for c in role["template"]["spec"]["containers"] if c["name"] == "pytorch")
        assert pytorch["command"][:3] == ["python", "-m", "torch.distributed.run"]
        assert int(pytorch["resources"]["limits"]["cpu"]) == nproc      # a core per rank


def test_the_kept_schema_is_the_trim_of_its_source_for_this_manifest() -> None:
    kept = json.loads(SUBSET.read_text())
    assert kept["source"] == SOURCE
    crd = os.environ.get("HVDLITE_PYTORCHJOB_CRD")
    if crd:     # with the CRD at hand: regenerated, the file would not change
        full = _crd_schema(yaml.safe_load(Path(crd).read_text()))
        assert kept["openAPIV3Schema"] == trim(full, [_manifest()])


if __name__ == "__main__":
    schema = _crd_schema(yaml.safe_load(Path(sys.argv[1]).read_text()))
    SUBSET.write_text(json.dumps({"source": SOURCE, "openAPIV3Schema": trim(schema, [_manifest()])},
                                 indent=1, sort_keys=True) + "\n")
    print(f"wrote {SUBSET} ({SUBSET.stat().st_size} bytes)")
