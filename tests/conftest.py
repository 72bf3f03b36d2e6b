import os

# The embedded broker has no InitProducerId; tests run against it.
os.environ.setdefault("SLUICE_KAFKA_IDEMPOTENCE", "false")
