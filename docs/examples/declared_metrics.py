"""Count what a plugin does, each number declared once where it is kept: a stats plugin exports it."""

from dataclasses import dataclass

import strata_serve


@dataclass
class Numbers:
    answers: int = strata_serve.counter("Answers sent")
    answer_ms: float = strata_serve.counter("Time spent answering", name="answer_seconds",
                                            unit="seconds", scale=1e-3)


NUMBERS = "declared_metrics"


@strata_serve.hookimpl
def on_startup(service):
    service.state[NUMBERS] = Numbers()


@strata_serve.hookimpl
def post_request(outcome, service):
    numbers = service.state[NUMBERS]
    numbers.answers += 1
    if outcome.timings is not None:
        numbers.answer_ms += (outcome.timings.prefill_ms or 0) + (outcome.timings.generate_ms or 0)


@strata_serve.hookimpl
def collect_metrics(service):
    return service.state.get(NUMBERS)  # the fields say name, help and unit
