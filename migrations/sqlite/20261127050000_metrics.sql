-- Metrics: when the task became claimable for an attempt (its pickup latency is `started_at -
-- ready_at`, milliseconds), and an index for reading the attempts that ended in a window of time.
ALTER TABLE attempts ADD COLUMN ready_at INTEGER;
CREATE INDEX attempts_ended ON attempts (ended_at, task_id, token) WHERE ended_at IS NOT NULL;
