"""Schemathesis CLI hooks (``SCHEMATHESIS_HOOKS=loadtests.openapi_hooks``): valid generation
bodies steered to the engine (``loadtests.fuzz_openapi.steer``)."""

import schemathesis

from loadtests.fuzz_openapi import steer


@schemathesis.hook
def map_body(ctx, body):
    return steer(ctx.operation.path, body)
