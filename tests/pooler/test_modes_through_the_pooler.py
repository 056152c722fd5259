"""Every mode's own tests, run again with their Buses through PgBouncer in transaction mode.

The functions are the ones of the modules named below; collected here, they get this
directory's `connect` and `es_bus` fixtures (tests/pooler/conftest.py), which open every Bus
with `pooler="transaction"` against the pooler. Left out: tests about generic plans (a session
setting, which a transaction pooler cannot keep), the wake-up of `job_result` by NOTIFY (through a
transaction pooler results are polled for), and the Producer's retries through terminated server
backends (the pooler hides the backends' process ids).
"""

from __future__ import annotations

from tests.claims.test_claims import (  # noqa: F401
    test_a_held_partition_is_not_claimed_by_another_worker,
    test_ack_outside_the_claimed_range_is_refused,
    test_claim_picks_partition_with_earliest_pending_message,
    test_claim_returns_pending_messages_and_ack_advances_the_cursor,
    test_concurrent_claims_never_share_a_partition,
    test_expired_lease_lets_another_worker_take_it_and_fences_the_old_one,
    test_extend_keeps_the_lease_from_others,
    test_publish_wakes_a_caught_up_partition,
    test_release_gives_the_same_messages_back,
)
from tests.eventstore.test_eventstore_guarded_append import *  # noqa: F403
from tests.groups.test_effectively_once import *  # noqa: F403
from tests.groups.test_fencing import *  # noqa: F403
from tests.publishing.test_idempotent_publish import *  # noqa: F403
from tests.queues.test_queue_features import *  # noqa: F403
from tests.queues.test_queues import *  # noqa: F403
from tests.retention.test_retention import *  # noqa: F403

del test_job_result_returns_the_acked_value_woken_by_notify  # noqa: F821
del test_a_producer_retrying_through_terminated_backends_writes_each_message_once  # noqa: F821
