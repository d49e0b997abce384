"""``hvd.traffic()`` and the HVDLITE_REPORT life cycle: start a recorder at
``init``, gather every rank's record at ``shutdown`` and write the report on
rank 0 (``report_summary`` decides, ``report_plot`` draws).

The bindings call ``recorder()`` at their optimizer's step boundaries and
around its ``synchronize()``; it is None when no report is asked for, so the
cost then is one attribute read per step.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import socket
import sys
from typing import Any, Optional

from hvdlite.api import runtime
from hvdlite.errors import HvdliteError
from hvdlite.recording.recorder import StepRecorder

_log = logging.getLogger("hvdlite")


def traffic() -> dict[str, Any]:
    """Bytes this rank sent and received through each backend since ``init``.

    ``{"sent": int, "received": int, "estimated": bool, "backends": {name: {"exact":
    bool, "kinds": {collective: {"calls", "sent", "received"}}}}}``. ``exact`` is
    True for hvdlite's own algorithms (``ring``, ``ps``, ``adasum``: the bytes this
    rank put on and took off the wire) and False for ``mpi``, whose algorithm MPI
    picks: its counts are what a bandwidth-optimal algorithm would move (see
    hvdlite.backends.mpi); so are GPU tensors' counts (``nccl``, ``staged``).
    """
    chain = runtime.engine("hvdlite.traffic()").executor.chain
    backends = chain.traffic()
    sent, received, estimated = chain.traffic_totals()
    return {"sent": sent, "received": received, "estimated": estimated > 0,
            "backends": backends}


def recorder() -> Optional[StepRecorder]:
    """The running recorder, or None when HVDLITE_REPORT is not set."""
    return runtime.RUNTIME.recorder


def start(engine: Any) -> tuple[StepRecorder, "GpuSampler"]:
    """A recorder reading ``engine``'s peer-wait clock and byte counters, and the
    GPU sampler it calls every few steps."""
    chain, clock = engine.executor.chain, engine.peer_wait

    def totals() -> tuple[float, int, int, int]:
        return (clock.total, *chain.traffic_totals())

    gpu = GpuSampler.open()
    reductions = engine.executor.reductions
    return StepRecorder(totals, gpu.sample if gpu.handle is not None else None,
                        reduced=lambda: reductions.totals), gpu


class GpuSampler:
    """Peak device memory of this process and mean utilisation of its GPU, through
    NVML (``pynvml``), sampled every few steps; ``note`` says why not when absent."""

    def __init__(self, handle: Any = None, note: str = "") -> None:
        self.handle, self.note = handle, note
        self.mem_peak: Optional[int] = None
        self._util: list[int] = []

    @classmethod
    def open(cls) -> "GpuSampler":
        if "pynvml" not in sys.modules and _missing("pynvml"):
            return cls(note="not measured: pynvml is not installed")
        try:
            import pynvml
            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() == 0:
                return cls(note="not measured: NVML sees no GPU")
            return cls(pynvml.nvmlDeviceGetHandleByIndex(_nvml_index(runtime.local_device())))
        except Exception as exc:   # no driver, no device: the report says so
            return cls(note=f"not measured: NVML failed ({exc})")

    def sample(self) -> None:
        import pynvml
        try:
            processes = pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
            mine = [p.usedGpuMemory for p in processes if p.pid == os.getpid()
                    and p.usedGpuMemory is not None]
            if mine:
                self.mem_peak = max(self.mem_peak or 0, int(mine[0]))
            self._util.append(int(pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))
        except Exception as exc:   # a flaky driver must not stop training
            self.note, self.handle = f"sampling stopped: {exc}", None

    def util(self) -> Optional[float]:
        return sum(self._util) / len(self._util) / 100.0 if self._util else None


def _missing(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is None


def _nvml_index(visible: int) -> int:
    """NVML counts every GPU; CUDA_VISIBLE_DEVICES=2,3 makes CUDA's device 0 NVML's 2."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if visible < len(listed) and listed[visible].strip().isdigit():
        return int(listed[visible])
    return visible


def local_record(recorder: StepRecorder, gpu: GpuSampler) -> dict[str, Any]:
    """This rank's contribution to the report (see report_summary for the fields)."""
    if gpu.handle is not None:
        gpu.sample()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    rss = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024
    sent, received, _ = runtime.engine().executor.chain.traffic_totals()
    return {"rank": runtime.rank(), "host": socket.gethostname(), **recorder.window(),
            "other_calls": recorder.other_calls, "total_bytes_sent": sent,
            "total_bytes_received": received, "rss_peak_bytes": int(rss),
            "gpu_mem_peak_bytes": gpu.mem_peak, "gpu_util": gpu.util(), "gpu_note": gpu.note,
            **{key: record() for key, record in runtime.REPORT_RECORDS.items()},
            "settings": _settings_record()}


def _settings_record() -> dict[str, Any]:
    """How the settings were chosen: the topology-aware defaults applied at init, and
    HVDLITE_AUTOTUNE's trials and choice (every rank holds rank 0's decisions)."""
    current = runtime.RUNTIME.tuner
    return {"defaults": list(runtime.engine().defaults_chosen),
            "autotune": None if current is None else current.summary()}


def finish(recorder: StepRecorder, gpu: GpuSampler, directory: str) -> None:
    """Gather every rank's record on every rank (a collective: every rank's
    shutdown reaches it) and write the report on rank 0. Failures are logged,
    never raised: a report must not turn a finished training run into an error."""
    from hvdlite.api.objects import allgather_object
    try:
        records = allgather_object(local_record(recorder, gpu), name="hvdlite.report")
    except HvdliteError as exc:
        _log.warning("HVDLITE_REPORT: no report, the ranks could not be gathered: %s", exc)
        return
    if runtime.rank() == 0:
        try:
            write(records, directory)
        except Exception as exc:   # a full disk or a broken matplotlib: say so, go on
            _log.warning("HVDLITE_REPORT: writing the report to %s failed: %r", directory, exc)


def write(records: list[dict[str, Any]], directory: str) -> dict[str, Any]:
    """report.json, report.txt (also printed) and report.png in ``directory``."""
    from hvdlite.diagnostics import report_summary
    summary = report_summary.summarize(records)
    os.makedirs(directory, exist_ok=True)
    text = report_summary.render_text(summary)
    with open(os.path.join(directory, "report.json"), "w") as out:
        json.dump(summary, out, indent=2)
    with open(os.path.join(directory, "report.txt"), "w") as out:
        out.write(text)
    print(text, end="", flush=True)
    try:
        from hvdlite.diagnostics import report_plot
    except ImportError as exc:      # the 'report' extra is not installed
        _log.warning("HVDLITE_REPORT: no report.png (%s); pip install 'hvdlite[report]'", exc)
    else:
        report_plot.draw(summary, os.path.join(directory, "report.png"))
    return summary


def _on_start(engine: Any, config: Any) -> None:
    runtime.RUNTIME.recorder = runtime.RUNTIME.gpu_sampler = None
    if config.report:
        runtime.RUNTIME.recorder, runtime.RUNTIME.gpu_sampler = start(engine)


def _before_shutdown() -> None:
    """Every rank sends its record to rank 0, which writes the report: a collective,
    like the shutdown itself, so only while the engine still works."""
    current = runtime.RUNTIME
    recorder, current.recorder = current.recorder, None
    # A recorder without a report: HVDLITE_AUTOTUNE's, for the step boundaries only.
    if (recorder is not None and current.config.report and current.engine is not None
            and current.engine.dead is None):
        finish(recorder, current.gpu_sampler, current.config.report)


runtime.START_HOOKS.append(_on_start)
runtime.STOP_HOOKS.append(_before_shutdown)
