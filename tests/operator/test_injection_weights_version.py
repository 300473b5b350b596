"""The injection webhook labels a pod with its weights version (`kvtier.io/weights-version`,
from the annotation of the same name the rollout sets on the template): the EPP's
version screener sees pod labels, not annotations. Pure: the patch the webhook returns."""
from __future__ import annotations

import hashlib
import re

import pytest
import yaml

from kvtier import policy
from kvtier_operator import injection, names
from operator_cases import EXAMPLES_DIR

# A Kubernetes label value: at most 63 characters, alphanumeric at both ends.
LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


@pytest.fixture
def spec() -> policy.KVCachePolicySpec:
    return policy.parse_policy(yaml.safe_load((EXAMPLES_DIR / "minimal.yaml").read_text())).spec


def pod(annotations: dict | None = None, labels: dict | None = None) -> dict:
    return {"metadata": {"name": "p", "labels": dict(labels or {}), "annotations": dict(annotations or {})},
            "spec": {"containers": [{"name": "engine", "image": "e"}]}}


def labels_of(patch: dict) -> dict:
    return patch["metadata"]["labels"]


def test_the_label_is_the_annotations_version(spec):
    for version in ("v2", "sha256-3f1a9c", "llama-3.1_8b.r2", "0"):
        patch = injection.inject(pod({names.WEIGHTS_VERSION_ANNOTATION: version}), "minimal", spec,
                                 injection.SidecarImage(native=True))
        assert labels_of(patch)[names.WEIGHTS_VERSION_LABEL] == version
        assert labels_of(patch)[names.INJECTED_LABEL] == "minimal"


@pytest.mark.parametrize("version", [
    "sha256:" + "ab" * 32,               # a digest with a colon, past 63 characters
    "s3://bucket/llama/3.1",             # slashes
    "-leading-dash", "trailing.", "x" * 64, "版本-2",
])
def test_a_version_that_is_no_label_value_gets_a_stable_digest(spec, version):
    patch = injection.inject(pod({names.WEIGHTS_VERSION_ANNOTATION: version}), "minimal", spec,
                             injection.SidecarImage(native=False))
    label = labels_of(patch)[names.WEIGHTS_VERSION_LABEL]
    assert label == "h-" + hashlib.sha256(version.encode()).hexdigest()[:16]
    assert LABEL_VALUE.fullmatch(label) and len(label) <= names.MAX_LABEL_VALUE
    assert names.weights_version_label_value(version) == label  # the same on every webhook replica


def test_distinct_versions_keep_distinct_labels():
    versions = ["v1", "v2", "sha256:" + "ab" * 32, "sha256:" + "ab" * 31 + "ac", "x" * 64, "x" * 65]
    assert len({names.weights_version_label_value(v) for v in versions}) == len(versions)


def test_no_annotation_no_label_and_a_brought_label_is_removed(spec):
    plain = injection.inject(pod(), "minimal", spec, injection.SidecarImage(native=True))
    assert names.WEIGHTS_VERSION_LABEL not in labels_of(plain)
    empty = injection.inject(pod({names.WEIGHTS_VERSION_ANNOTATION: ""}), "minimal", spec,
                             injection.SidecarImage(native=True))
    assert names.WEIGHTS_VERSION_LABEL not in labels_of(empty)
    forged = injection.inject(pod(labels={names.WEIGHTS_VERSION_LABEL: "v9"}), "minimal", spec,
                              injection.SidecarImage(native=True))
    assert labels_of(forged)[names.WEIGHTS_VERSION_LABEL] is None  # merge patch: removed
    # A label the pod brought that disagrees with its annotation: the annotation wins.
    both = injection.inject(pod({names.WEIGHTS_VERSION_ANNOTATION: "v2"}, {names.WEIGHTS_VERSION_LABEL: "v1"}),
                            "minimal", spec, injection.SidecarImage(native=True))
    assert labels_of(both)[names.WEIGHTS_VERSION_LABEL] == "v2"


def test_label_and_annotation_share_the_name():
    assert names.WEIGHTS_VERSION_LABEL == names.WEIGHTS_VERSION_ANNOTATION == "kvtier.io/weights-version"
