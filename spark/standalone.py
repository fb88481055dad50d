"""A Spark standalone master and workers, started from pyspark's
``spark-class`` (the pip wheel has no ``start-master.sh``). ``spark-class``
execs java, so a process's PID is the JVM's and ends it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from roadlog.runtime.processes import alive, free_port, wait_dead


def spark_class() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-class")


def master_argv(host: str, port: int, webui_port: int) -> list[str]:
    return [spark_class(), "org.apache.spark.deploy.master.Master", "--host", host,
            "--port", str(port), "--webui-port", str(webui_port)]  # fmt: skip


def worker_argv(host: str, master_url: str, cores: int, memory: str, webui_port: int) -> list[str]:
    return [spark_class(), "org.apache.spark.deploy.worker.Worker", "--host", host,
            "--webui-port", str(webui_port), "--cores", str(cores), "--memory", memory,
            master_url]  # fmt: skip


@contextmanager
def local_standalone(logs: Path, cores: int = 2, memory: str = "2g") -> Iterator[str]:
    """A master and one worker on 127.0.0.1 for as long as the block runs;
    yields the master URL once the worker has registered."""
    port = free_port()
    url = f"spark://127.0.0.1:{port}"
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(logs)}
    procs = []
    for name, argv in (
        ("master", master_argv("127.0.0.1", port, free_port())),
        ("worker", worker_argv("127.0.0.1", url, cores, memory, free_port())),
    ):
        with open(logs / f"spark-{name}.log", "ab") as f:
            procs.append(
                subprocess.Popen(
                    argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
    try:
        deadline = time.monotonic() + 90
        while "Successfully registered" not in (logs / "spark-worker.log").read_text():
            if time.monotonic() > deadline or not all(alive(p.pid) for p in procs):
                raise TimeoutError(f"the Spark worker did not register; logs in {logs}")
            time.sleep(0.2)
        yield url
    finally:
        for p in procs:
            if alive(p.pid):
                os.kill(p.pid, signal.SIGTERM)
                if not wait_dead(p.pid, 15):
                    os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
