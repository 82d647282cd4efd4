"""A check of our own for schemathesis (loaded as its hooks module by tests/service/schemathesis.toml).

``POST /v1/leases`` may refuse a request the OpenAPI document calls valid for two reasons only, neither of
which JSON Schema can state: a list of wants that names a semaphore twice (with different counts), and a
count over the semaphore's capacity. schemathesis's own ``positive_data_acceptance`` is told to let that
operation's 422 pass; this check then holds every such 422 to those two reasons, so that the operation's
other limits (names, keys, owners, ttl, wait, ``max_wants``) stay checked.
"""

from __future__ import annotations

from typing import Any

import schemathesis


@schemathesis.check
def acquire_refused_only_for_what_the_schema_cannot_say(ctx: Any, response: Any, case: Any) -> None:
    if (case.operation.method.upper(), case.operation.path) != ("POST", "/v1/leases") or response.status_code != 422:
        return
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return
    error = response.json()["error"]
    if error["code"] == "count_exceeds_capacity":
        return
    if error["code"] == "invalid_argument" and "names the same semaphore twice" in error["message"]:
        return
    raise AssertionError(f"a request the document calls valid was refused: {error['code']}: {error['message']}")
