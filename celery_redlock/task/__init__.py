"""One locked task: the ``LockedTask`` base class (locked_task), one run of it (run), the
name of its lock (naming), what happens when the lock is taken (contention), lost
(interrupt) or met again at publish (dedup, claiming), its next attempt (next_attempt),
its flow rules per call (flow) and the lock options a call may pass (per_call).
"""
