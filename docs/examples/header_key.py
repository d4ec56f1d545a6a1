"""Name conversations by an ``X-Conversation`` header; defer to the default without one."""

import strata_serve


@strata_serve.hookimpl
def conversation_key(request):
    value = request.headers.get("X-Conversation")
    if value and value.isalnum() and len(value) <= 64:
        return value
    return None  # let the next plugin (in the end the built-in default) decide
