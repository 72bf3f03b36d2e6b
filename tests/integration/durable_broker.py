"""A Tansu broker that keeps its logs across a restart, for the tests that restart a broker.

The dev stack's broker keeps everything in memory: killed and started again, it comes back with no
topics, which is a broker that lost its disks rather than one restarted. This one keeps its topics,
records and committed offsets in S3 storage, served on loopback by moto's S3 server (a stand-in
for an object store), so `kill()` then `start()` is a broker killed with SIGKILL and started again
from what it had written, as a Kafka broker restarted on its own disks is.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid

from tests.integration.kafka_proxy import HOST, listening
from worker import devstack

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "sluice-test", "AWS_SECRET_ACCESS_KEY": "sluice-test",
               "AWS_DEFAULT_REGION": "eu-west-2"}


class DurableBroker:
    def __init__(self, broker_port: int, s3_port: int):
        self.broker_port, self.s3_port = broker_port, s3_port
        self.bucket = f"tansu-{uuid.uuid4().hex[:8]}"
        self.bootstrap = f"{HOST}:{broker_port}"
        self._s3: subprocess.Popen | None = None
        self._broker: subprocess.Popen | None = None

    async def start_storage(self) -> None:
        import boto3

        self._s3 = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.s3_port)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        await listening(self.s3_port, self._s3, "moto's S3 server")
        s3 = boto3.client("s3", endpoint_url=f"http://{HOST}:{self.s3_port}", region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
                          aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
        await asyncio.to_thread(s3.create_bucket, Bucket=self.bucket,
                                CreateBucketConfiguration={"LocationConstraint": CREDENTIALS["AWS_DEFAULT_REGION"]})

    async def start(self) -> None:
        url = f"tcp://{HOST}:{self.broker_port}"
        env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT": f"http://{HOST}:{self.s3_port}", "AWS_ALLOW_HTTP": "true"}
        self._broker = subprocess.Popen([devstack.tansu_binary(), "broker", "--listener-url", url,
                                         "--advertised-listener-url", url, "--storage-engine", f"s3://{self.bucket}/"],
                                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
        await listening(self.broker_port, self._broker, "the durable broker")

    def kill(self) -> None:
        """SIGKILL: nothing flushed, no clean shutdown."""
        if self._broker is not None and self._broker.poll() is None:
            os.kill(self._broker.pid, signal.SIGKILL)
            self._broker.wait(10)

    def stop(self) -> None:
        self.kill()
        if self._s3 is not None and self._s3.poll() is None:
            self._s3.terminate()
            try:
                self._s3.wait(10)
            except subprocess.TimeoutExpired:
                self._s3.kill()
