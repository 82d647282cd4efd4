"""The dashboard's statements (tables of migration 0004, read with the core tables). Portable: every
backend runs them as written. None of them runs on the acquire or release path.

``{now}`` is the database's clock in milliseconds, as in ``base.PORTABLE_SQL``. ``a - (a % n)`` floors
``a`` to a multiple of ``n`` on all three backends (MariaDB's ``/`` would give a decimal).
"""

from __future__ import annotations

OBSERVE_SQL: dict[str, str] = {
    # ---- samples (one elected instance, every step)
    # Every live semaphore as it is now, with its live fair-queue length and the clock.
    # -> name, capacity, used, last_token, queued, now_ms, fair
    "STAT_SEMS": """
        SELECT s.name, s.capacity, s.used, s.last_token,
               (SELECT COUNT(*) FROM permits_waiter w WHERE w.semaphore_id = s.id AND w.expires_at_ms > {now}),
               {now}, s.fair
        FROM permits_semaphore s WHERE s.deleted = 0""",
    # The newest sample's time: leases that ended after it belong to the next one. -> bucket_ms or NULL
    "STAT_LAST": "SELECT MAX(bucket_ms) FROM permits_stat",
    # How long the leases that ended in (since_ms, until_ms] were held, by semaphore, through
    # ix_permits_lease_ended. params: since_ms, until_ms, limit -> name, held_ms
    "STAT_ENDED": """
        SELECT s.name, l.ended_at_ms - l.acquired_at_ms
        FROM permits_lease l
        JOIN permits_permit p ON p.lease_id = l.id
        JOIN permits_semaphore s ON s.id = p.semaphore_id
        WHERE l.ended_at_ms > :since_ms AND l.ended_at_ms <= :until_ms AND l.state = 0
        ORDER BY l.ended_at_ms LIMIT :limit""",
    # params (a list): name, bucket_ms, capacity, used, waiting, last_token, ended, hold_p50_ms, hold_p99_ms
    "STAT_INSERT": """
        INSERT INTO permits_stat
            (name, bucket_ms, capacity, used, waiting, last_token, ended, hold_p50_ms, hold_p99_ms)
        VALUES (:name, :bucket_ms, :capacity, :used, :waiting, :last_token, :ended, :hold_p50_ms, :hold_p99_ms)""",
    # params: keep_ms
    "STAT_PRUNE": "DELETE FROM permits_stat WHERE bucket_ms < {now} - :keep_ms",
    # ---- what each instance saw (every instance, every step)
    # params (a list): instance, name, bucket_ms, granted, refused, timeouts, waiting, wait_hist
    "ISTAT_INSERT": """
        INSERT INTO permits_instance_stat
            (instance, name, bucket_ms, granted, refused, timeouts, waiting, wait_hist)
        VALUES (:instance, :name, :bucket_ms, :granted, :refused, :timeouts, :waiting, :wait_hist)""",
    # params: keep_ms
    "ISTAT_PRUNE": "DELETE FROM permits_instance_stat WHERE bucket_ms < {now} - :keep_ms",
    # ---- reads for the page
    # Utilisation per semaphore and minute. params: window_ms -> name, minute_ms, utilisation (0..1+)
    "STAT_MINUTES": """
        SELECT name, bucket_ms - (bucket_ms % 60000),
               AVG(CASE WHEN capacity > 0 THEN used * 1.0 / capacity END)
        FROM permits_stat WHERE bucket_ms >= {now} - :window_ms
        GROUP BY name, bucket_ms - (bucket_ms % 60000)""",
    # params: name, window_ms -> bucket_ms, capacity, used, waiting, last_token, ended, hold_p50_ms, hold_p99_ms
    "STAT_SERIES": """
        SELECT bucket_ms, capacity, used, waiting, last_token, ended, hold_p50_ms, hold_p99_ms
        FROM permits_stat WHERE name = :name AND bucket_ms >= {now} - :window_ms
        ORDER BY bucket_ms""",
    # params: window_ms -> instance, name, bucket_ms, granted, refused, timeouts, waiting, wait_hist, now_ms
    "ISTAT_RECENT": """
        SELECT instance, name, bucket_ms, granted, refused, timeouts, waiting, wait_hist, {now}
        FROM permits_instance_stat WHERE bucket_ms >= {now} - :window_ms""",
    # params: name, window_ms -> the same, for one semaphore
    "ISTAT_SERIES": """
        SELECT instance, name, bucket_ms, granted, refused, timeouts, waiting, wait_hist, {now}
        FROM permits_instance_stat WHERE name = :name AND bucket_ms >= {now} - :window_ms""",
    # Ended leases of one semaphore, newest token first (uq_permits_permit_token read backwards, stopping at
    # the limit: the semaphore's id is a value the plan knows, not a join that could read its whole history).
    # params: name, limit -> owner, lease_key, count, token, acquired_at_ms, ended_at_ms, end_reason, end_note
    "ENDINGS": """
        SELECT l.owner, l.lease_key, p.count, p.token, l.acquired_at_ms, l.ended_at_ms, l.end_reason, l.end_note
        FROM permits_permit p
        JOIN permits_lease l ON l.id = p.lease_id
        WHERE p.semaphore_id = (SELECT id FROM permits_semaphore WHERE name = :name) AND l.state = 0
        ORDER BY p.token DESC LIMIT :limit""",
    # ---- the admin log
    # params: actor, action, name, lease_owner, lease_key, reason, detail
    "ADMIN_LOG_INSERT": """
        INSERT INTO permits_admin_log (at_ms, actor, action, name, lease_owner, lease_key, reason, detail)
        VALUES ({now}, :actor, :action, :name, :lease_owner, :lease_key, :reason, :detail)""",
    # params: limit -> id, at_ms, actor, action, name, lease_owner, lease_key, reason, detail (newest first)
    "ADMIN_LOG_LIST": """
        SELECT id, at_ms, actor, action, name, lease_owner, lease_key, reason, detail
        FROM permits_admin_log ORDER BY id DESC LIMIT :limit""",
    # params: name, limit -> the same, for one semaphore
    "ADMIN_LOG_FOR": """
        SELECT id, at_ms, actor, action, name, lease_owner, lease_key, reason, detail
        FROM permits_admin_log WHERE name = :name ORDER BY id DESC LIMIT :limit""",
    # params: keep_ms
    "ADMIN_LOG_PRUNE": "DELETE FROM permits_admin_log WHERE at_ms < {now} - :keep_ms",
    # ---- the event feed: polled by each instance that has subscribers
    # Where a feed starts. -> last lease id, last capacity change id, last admin log id, now_ms
    "EVENTS_HEAD": """
        SELECT (SELECT COALESCE(MAX(id), 0) FROM permits_lease),
               (SELECT COALESCE(MAX(id), 0) FROM permits_capacity_change),
               (SELECT COALESCE(MAX(id), 0) FROM permits_admin_log),
               {now}""",
    # Grants after a lease id. A lease id is taken before its transaction commits, so a grant is listed
    # only once it is settle_ms old: a lower id still in flight is not passed over. The bound is repeated on
    # the permits: a planner that walked them in lease order read every one before the first new lease.
    # params: after, settle_ms, limit -> id, owner, lease_key, acquired_at_ms, name, count, token
    "EVENTS_GRANTS": """
        SELECT l.id, l.owner, l.lease_key, l.acquired_at_ms, s.name, p.count, p.token
        FROM permits_lease l
        JOIN permits_permit p ON p.lease_id = l.id
        JOIN permits_semaphore s ON s.id = p.semaphore_id
        WHERE l.id > :after AND p.lease_id > :after AND l.acquired_at_ms <= {now} - :settle_ms
        ORDER BY l.id LIMIT :limit""",
    # Endings at or after a time (the poller re-reads an overlap and drops what it has sent). The leases are
    # picked first, by ix_permits_lease_ended with the limit, then joined: a subquery with a LIMIT is one no
    # planner merges into the join, which otherwise could read every permit first.
    # params: since_ms, limit -> id, owner, lease_key, ended_at_ms, end_reason, end_note, name, count, token
    "EVENTS_ENDS": """
        SELECT l.id, l.owner, l.lease_key, l.ended_at_ms, l.end_reason, l.end_note, s.name, p.count, p.token
        FROM (SELECT id, owner, lease_key, ended_at_ms, end_reason, end_note FROM permits_lease
              WHERE ended_at_ms >= :since_ms AND state = 0
              ORDER BY ended_at_ms, id LIMIT :limit) l
        JOIN permits_permit p ON p.lease_id = l.id
        JOIN permits_semaphore s ON s.id = p.semaphore_id
        ORDER BY l.ended_at_ms, l.id LIMIT :limit""",
    # params: after, limit -> id, name, old_capacity, new_capacity, changed_by, reason, changed_at_ms
    "EVENTS_CHANGES": """
        SELECT id, name, old_capacity, new_capacity, changed_by, reason, changed_at_ms
        FROM permits_capacity_change WHERE id > :after ORDER BY id LIMIT :limit""",
    # params: after, limit -> id, at_ms, actor, action, name, lease_owner, lease_key, reason, detail
    "EVENTS_ADMIN": """
        SELECT id, at_ms, actor, action, name, lease_owner, lease_key, reason, detail
        FROM permits_admin_log WHERE id > :after ORDER BY id LIMIT :limit""",
}
