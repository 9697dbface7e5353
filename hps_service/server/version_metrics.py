"""The versions of every model in the metrics, read from the engine at scrape time: one series per version and state
(1 for the state it is in, 0 for the others, as kube-state-metrics does), and its rows per table.

    hps_model_version_state{model="ctr",version="3",state="ready"} 1
    hps_model_version_rows{model="ctr",version="3",table="item"} 1000000
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hps_service.engine.api import Engine
from hps_service.engine.version_states import STATES
from hps_service.errors import HPSError

log = logging.getLogger(__name__)


class VersionCollector(Collector):
    """``hps_model_version_state`` and ``hps_model_version_rows`` of every loaded model's versions."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # series depend on the versions known at scrape time

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily("hps_model_version_state", "1 for the state each model version is in (loading, "
                                  "ready, failed, serving, draining), 0 for the others",
                                  labels=["model", "version", "state"])
        rows = GaugeMetricFamily("hps_model_version_rows", "Rows each table of a model version holds here",
                                 labels=["model", "version", "table"])
        for model in self.engine.models():
            try:
                views = self.engine.version_states(model.name)
            except HPSError:  # unloaded during the scrape
                log.debug("versions of %s unavailable for /metrics", model.name, exc_info=True)
                continue
            for view in views:
                for name in STATES:
                    state.add_metric([model.name, str(view.version), name], 1.0 if name == view.state else 0.0)
                for table in view.tables:
                    if table.rows is not None:
                        rows.add_metric([model.name, str(view.version), table.name], float(table.rows))
        yield from (state, rows)
