"""A real Prometheus server on loopback for the tests: scrapes given targets every 250 ms.

The Debian `prometheus` package provides the binary (scripts/install_prometheus.sh installs it
when missing, as `make test` does).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from tests.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_INTERVAL = 0.25


def prometheus_binary() -> str:
    """The server's path, installing the package first when it is missing."""
    found = shutil.which("prometheus")
    if found is None:
        r = subprocess.run(["sh", str(ROOT / "scripts" / "install_prometheus.sh")], capture_output=True, text=True)
        found = shutil.which("prometheus")
        if found is None:
            raise RuntimeError(f"no prometheus binary and scripts/install_prometheus.sh failed: {r.stderr.strip()}")
    return found


class Prometheus:
    """`prometheus` scraping `targets` (HOST:PORT) with honor_labels, as docs/observe.md configures it."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        self.port = free_ports(1)
        config = {
            "global": {"scrape_interval": f"{int(SCRAPE_INTERVAL * 1000)}ms", "scrape_timeout": f"{int(SCRAPE_INTERVAL * 1000)}ms"},
            "scrape_configs": [{"job_name": "hetrain", "honor_labels": True,
                                "static_configs": [{"targets": targets}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready after {timeout} s; see {self.log.name}")

    def _api(self, path: str, **params: str | float) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:   # a bad query: say why
            raise AssertionError(f"{params.get('query')}: {e.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]["result"]

    def query(self, expr: str) -> list[dict]:
        """Instant query at now: [{'metric': {...labels}, 'value': [t, 'v']}, ...]."""
        return self._api("query", query=expr)

    def query_range(self, expr: str, start: float, end: float, step: float = 0.5) -> list[dict]:
        return self._api("query_range", query=expr, start=start, end=end, step=step)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
