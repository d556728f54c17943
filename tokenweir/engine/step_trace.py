"""A record of every step the serving engine takes: its composition and how long it really took.

`tokenweir serve --step-trace FILE` writes one JSON line per step. A step's time is the engine
loop's period: from its `schedule()` to the next step's, when the loop went straight on (a
step after an idle wait has no period and is not written). That period includes everything the
serving path costs per step besides the model: handing outputs to the event loop, the event
loop and the clients competing for the cores. It is the time a simulated step of `serve` must
take, and `tokenweir profile --serving` fits the cost model to such a trace.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import IO, Optional

from tokenweir.core.cost_model import StepComposition


class StepTrace:
    """The first line is a header, `{"engine": EngineCore.describe()}`: what ran the steps."""

    def __init__(self, path: str | Path) -> None:
        # Line-buffered: a server stopped by a signal may never reach close() (uvicorn re-raises
        # SIGTERM once it has shut down), and every step written so far must be on disk.
        self._file: IO[str] = open(path, "w", buffering=1)
        self._pending: Optional[tuple[StepComposition, float]] = None

    def write_header(self, engine: dict) -> None:
        self._file.write(json.dumps({"engine": engine}) + "\n")

    def step_started(self, comp: StepComposition) -> None:
        """A step has been scheduled; closes the previous one, if the loop went straight on."""
        now = time.perf_counter()
        if self._pending is not None:
            previous, started = self._pending
            self._file.write(json.dumps({**dataclasses.asdict(previous), "seconds": now - started}) + "\n")
        self._pending = (comp, now) if comp.num_tokens else None

    def went_idle(self) -> None:
        """The loop is about to wait for work: the pending step's period would include the wait."""
        self._pending = None

    def close(self) -> None:
        self._file.close()


def read_step_trace(path: str | Path) -> tuple[dict, list[tuple[StepComposition, float]]]:
    """(the engine's description from the header, the steps)."""
    fields = {f.name for f in dataclasses.fields(StepComposition)}
    engine: Optional[dict] = None
    samples = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                if number == 1:
                    engine = dict(row["engine"])
                    continue
                samples.append((StepComposition(**{k: int(row[k]) for k in fields}), float(row["seconds"])))
            except (ValueError, KeyError, TypeError) as e:
                what = "the engine header" if number == 1 else "a step record"
                raise ValueError(f"step trace {path}, line {number}: not {what} ({e})") from None
    if engine is None:
        raise ValueError(f"step trace {path} is empty")
    return engine, samples
