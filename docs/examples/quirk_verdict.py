"""A backend quirk plugin: an engine error becomes a verdict, so nobody else matches strings."""

import strata_serve
from strata_serve import Verdict


@strata_serve.hookimpl
def engine_verdict(op, error, engine, held_tokens):
    if error is None:  # asked before the call
        if op == "save" and held_tokens == 0:
            return Verdict.SKIP  # nothing to save
        return None
    if op == "save" and "running-state payload" in error.message:
        return Verdict.PROVISIONAL  # the held state was a cancelled request's: safe to restore over
    return None
