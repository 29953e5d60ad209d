-- Two retry budgets: a lost lease (the worker died, hung or lost the database, so its lease
-- expired and was reaped) draws on `max_lost`; a task's own failure (an error it reported, or
-- its timeout) on `max_attempts`. Earlier versions counted both against `max_attempts`.
ALTER TABLE tasks ADD COLUMN max_lost INTEGER NOT NULL DEFAULT 10 CHECK (max_lost >= 1);
-- Lost leases since the last `retry_run` (which resets it with `attempt_base`); the attempts
-- counted against `max_attempts` are `attempt - attempt_base - lost`.
ALTER TABLE tasks ADD COLUMN lost INTEGER NOT NULL DEFAULT 0 CHECK (lost >= 0);
-- Which budget an ended attempt drew on: `error` (failed or timed out) or `lost` (its lease
-- expired); NULL while it runs and for attempts that succeeded or were cancelled.
ALTER TABLE attempts ADD COLUMN kind TEXT CHECK (kind IN ('error', 'lost'));

UPDATE attempts
SET kind = CASE WHEN outcome = 'expired' THEN 'lost' ELSE 'error' END
WHERE outcome IN ('expired', 'failed', 'timed_out');

UPDATE tasks
SET lost = (SELECT count(*) FROM attempts a
            WHERE a.task_id = tasks.id AND a.outcome = 'expired' AND a.attempt > tasks.attempt_base)
WHERE EXISTS (SELECT 1 FROM attempts a
              WHERE a.task_id = tasks.id AND a.outcome = 'expired' AND a.attempt > tasks.attempt_base);
