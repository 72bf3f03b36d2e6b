"""Shared real parts: the embedded broker and Redis Cluster, the real model, one vLLM engine."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

import topics
from topics.admin import apply
from worker import devstack
from worker.model import prepare
from worker.settings import load

pytestmark = pytest.mark.integration
MODEL_DIR = Path(".sluice/models/smollm2-135m-instruct")


@pytest.fixture(scope="session")
def stack():
    devstack.up()  # idempotent: CI starts it first; a developer may not have
    return devstack


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare(MODEL_DIR)


@pytest.fixture(scope="session")
def settings(stack, model_dir):
    return load(environ={"SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_METRICS_PORT": "0",
                         "SLUICE_MODEL": str(model_dir), "SLUICE_DRAIN_GRACE_S": "20",
                         # answers stored by earlier runs must not answer this run's ids
                         "SLUICE_REDIS_KEY_PREFIX": f"test-{uuid.uuid4().hex[:8]}"})


@pytest.fixture(scope="session")
async def engine(settings):
    from worker.engine import VllmEngine

    eng = await asyncio.to_thread(VllmEngine, settings)
    yield eng
    eng.shutdown()


@pytest.fixture
async def catalog(settings):
    """A fresh set of the catalog's topics, so tests never read each other's records."""
    cat = topics.load().renamed(f"t{uuid.uuid4().hex[:8]}.")
    await apply(settings.kafka.options(), cat)
    return cat


@pytest.fixture
def group_id():
    return f"g-{uuid.uuid4().hex[:8]}"
