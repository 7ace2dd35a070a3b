"""The monitor's Prometheus endpoint: every signal of `actors.monitor.series.SIGNALS`, newest points.

A custom collector over the `SeriesStore` (nothing is copied into prometheus_client's own
metric objects): each scrape reads the newest point of every series. The HTTP server is
prometheus_client's (a daemon thread); it answers OpenMetrics text when the scraper asks for
it (``Accept: application/openmetrics-text``, as Prometheus does), the classic text otherwise.
It listens on 127.0.0.1 unless told otherwise (``NEXUS_METRICS_HOST``: a pod's own address,
where a NetworkPolicy admits only Prometheus; deploy/k8s/nexus.yaml).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from actors.monitor.series import SIGNALS, SeriesStore

HOST = "127.0.0.1"
NAMESPACE = "nexus"


class SeriesCollector:
    def __init__(self, store: SeriesStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        by_signal: dict[str, list[tuple[dict[str, str], float]]] = {name: [] for name in SIGNALS}
        for signal, labels, value, _at, _version in self.store.latest():
            by_signal[signal.name].append((labels, value))
        for name, signal in SIGNALS.items():
            full = f"{NAMESPACE}_{name}"
            doc = f"[{signal.family}] {signal.help}"
            fam: Any = (CounterMetricFamily(full, doc, labels=signal.labels) if signal.kind == "counter"
                        else GaugeMetricFamily(full, doc, labels=signal.labels))
            for labels, value in by_signal[name]:
                fam.add_metric([labels[k] for k in signal.labels], value)
            yield fam


def serve(store: SeriesStore, port: int, host: str = HOST) -> tuple[Any, str]:
    """Start the endpoint on ``host``:``port`` (0: a free port); return (server, its URL: the
    loopback address when it listens on every address).

    Raises OSError when the port is taken or the address is not this host's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SeriesCollector(store))  # type: ignore[arg-type]
    server, _thread = start_http_server(port, addr=host, registry=registry)
    shown = {"0.0.0.0": HOST, "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)
    return server, f"http://{shown}:{server.server_port}/metrics"
