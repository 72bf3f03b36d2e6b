"""What the broker says of named topics, asked in one metadata request that creates none.

A plain metadata request (aiokafka's own, a producer's first send) asks with auto-creation on, so
on a broker that creates topics it makes them with the broker's defaults; listing every topic
instead costs one large response on a cluster with many, and hides a topic these credentials may
not describe behind "missing". The worker's start checks its own topics this way, and intake
checks requesters' `reply_to` topics.
"""

from __future__ import annotations

from aiokafka.protocol.metadata import MetadataRequest

# Metadata error codes that say a topic cannot be used, whatever is retried
PROBLEMS = {3: "does not exist", 17: "is not a valid topic name", 29: "is not authorized for the workers' credentials"}
INTERNAL = "is one of the broker's internal topics"


def request(topics) -> MetadataRequest:
    return MetadataRequest(list(topics), allow_auto_topic_creation=False)


def problems(response) -> dict[str, str]:
    """Topic -> what is wrong with it, from the answer to `request`; topics that are fine are left out.
    Other errors (a leader being elected, say) are passing and left out too."""
    out = {}
    for error_code, topic, *rest in response.topics:
        if error_code in PROBLEMS:
            out[topic] = PROBLEMS[error_code]
        elif len(rest) == 2 and rest[0] is True:  # v1+: (is_internal, partitions)
            out[topic] = INTERNAL
    return out
