"""The topic catalog as Strimzi `KafkaTopic` resources, for one deployment profile.

`sluice topics render --format strimzi --profile production` writes what
`deploy/k8s/base/topics.yaml` holds. A profile changes only how durably topics are
stored, never their names, partitions or retention: `dev` keeps the topics file as it
is (one replica, for the embedded single-node broker); `production` stores every
partition on 3 brokers and acknowledges a write once 2 have it (`acks=all` producers,
which sluice's are), so one broker can fail without losing or refusing a record.
"""

from __future__ import annotations

import re

import msgspec
import yaml

from topics import Catalog

STRIMZI_API = "kafka.strimzi.io/v1"
PROFILES = {
    "dev": {},
    "production": {"replication_factor": 3, "config": {"min.insync.replicas": "2"}},
}


def with_profile(catalog: Catalog, profile: str) -> Catalog:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}: use {' or '.join(PROFILES)}")
    p = PROFILES[profile]
    return Catalog([msgspec.structs.replace(
        t, replication_factor=p.get("replication_factor", t.replication_factor),
        config={**t.config, **p.get("config", {})}) for t in catalog.topic])


def resource_name(topic: str) -> str:
    """A Kubernetes object name (DNS-1123 subdomain) for a topic; the real name goes in spec.topicName."""
    name = re.sub(r"[^a-z0-9.-]+", "-", topic.lower()).strip(".-")
    return name[:253]


def strimzi(catalog: Catalog, cluster: str = "sluice") -> str:
    docs = [{
        "apiVersion": STRIMZI_API,
        "kind": "KafkaTopic",
        "metadata": {"name": resource_name(t.name), "labels": {"strimzi.io/cluster": cluster,
                                                             "app.kubernetes.io/part-of": "sluice"}},
        "spec": {"topicName": t.name, "partitions": t.partitions, "replicas": t.replication_factor,
                 "config": dict(sorted(t.config.items()))},
    } for t in catalog.topic]
    header = "# Rendered from topics/ by `sluice topics render`; edit the topics file, not this.\n"
    return header + yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True)
