"""TensorBoard event files per tenant, written by the monitor.

``<data_dir>/tensorboard/<tenant>/events.out.tfevents.*``: open the whole directory with
``tensorboard --logdir <data_dir>/tensorboard`` and each tenant is one run. Tags:

* ``learning/loss`` (step: the policy version the job trained), ``learning/success_rate`` and
  ``learning/mean_return`` (step: the workload's version when it reported them);
* ``learning/<name>`` for each other training metric of a job (its head's: ``nll``, PPO's
  ``policy_loss``, ``value_loss``, ``entropy``, ``approx_kl``, ``clip_frac``, ``kl_ref``; step: the
  version the job trained);
* ``eval/<metric>`` for each metric of a workload's ``done`` event (step: its version);
* ``control/queue_depth`` and ``control/jobs_in_flight`` (step: seconds since the monitor
  started), the tenant's load beside its curves.

Writers are torch's ``SummaryWriter`` (tensorboard's own event format and writer thread);
at most ``max_open`` are open at once, the least recently used closed first (a later point
for its tenant opens a new file in the same run directory). Tenant names past the monitor's
tenant cap share the ``other`` run, as they share a label in the series.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from protocol.subjects import check_token

FLUSH_S = 2  # events on disk within about this long (the writer thread flushes)


class TenantBoards:
    def __init__(self, root: Path, max_open: int = 32) -> None:
        self.root = Path(root)
        self.max_open = max_open
        self._writers: OrderedDict[str, Any] = OrderedDict()
        self._t0 = time.monotonic()

    @staticmethod
    def preload() -> None:
        """Import the writer (torch + tensorboard: seconds on a loaded host) before the role
        beats: imported lazily on the first point, it blocked the monitor's loop past the
        health manager's 3 s heartbeat bound, and the monitor was restarted at start-up."""
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401

    def _writer(self, tenant: str) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        w = self._writers.get(tenant)
        if w is None:
            check_token("tenant", tenant)  # a directory name: never a path
            w = self._writers[tenant] = SummaryWriter(log_dir=str(self.root / tenant), flush_secs=FLUSH_S)
            while len(self._writers) > self.max_open:
                self._writers.popitem(last=False)[1].close()
        else:
            self._writers.move_to_end(tenant)
        return w

    def scalar(self, tenant: str, tag: str, value: float, step: int | None = None,
               at: float | None = None) -> None:
        """One point; ``step`` None: seconds since the monitor started."""
        if step is None:
            step = int(time.monotonic() - self._t0)
        self._writer(tenant).add_scalar(tag, float(value), global_step=int(step), walltime=at)

    def drop(self, tenant: str) -> bool:
        """A deleted tenant's run: its writer closed and its directory removed."""
        import shutil

        check_token("tenant", tenant)
        w = self._writers.pop(tenant, None)
        if w is not None:
            w.close()
        path = self.root / tenant
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            return True
        return False

    def flush(self) -> None:
        for w in self._writers.values():
            w.flush()

    def close(self) -> None:
        while self._writers:
            self._writers.popitem(last=False)[1].close()
