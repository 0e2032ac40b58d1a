"""Serving beside training in one process: one scheduler, one device, two jobs."""

from __future__ import annotations

import copy
import time
from http.server import ThreadingHTTPServer
from typing import Any

from atomtrain.sched.scheduler import DeviceScheduler
from atomtrain.sched.serve import InferenceService, start_server
from atomtrain.train.session import Session
from atomtrain.train.trainer import TrainState

STAGE_EVERY_S = 1.0


def serve_beside_training(
    session: Session, host: str, port: int, preemptive: bool = True
) -> tuple[ThreadingHTTPServer, InferenceService]:
    """Start the service on its own model copy and hook the scheduler into the trainer: the
    engine pauses at sub-model boundaries (the plain runner at step boundaries), and a fresh
    parameter snapshot is published after an optimizer step at most once a second."""
    trainer = session.trainer
    runner: Any = trainer.runner
    engine = getattr(runner, "engine", None)
    scheduler = DeviceScheduler(preemptive, memory=engine.memory if engine else None)
    params = runner.host_parameters()
    model = copy.deepcopy(session.model).eval()
    device = next(iter(params.values())).device
    if engine is not None:
        engine.boundary_hook = scheduler.train_boundary
        device = engine.device
    model.to(device)
    service = InferenceService(model, session.shards.tokenizer, scheduler)
    service.stage(params)
    trainer.step_context = scheduler.train_step
    previous = trainer.after_step
    last = [time.perf_counter()]

    def after_step(state: TrainState, record: dict[str, Any]) -> None:
        if previous is not None:
            previous(state, record)
        if time.perf_counter() - last[0] >= STAGE_EVERY_S:
            service.stage(runner.host_parameters())  # waits for the optimizer: consistent
            last[0] = time.perf_counter()

    trainer.after_step = after_step
    server = start_server(service, host, port)
    return server, service
