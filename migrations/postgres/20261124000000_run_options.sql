-- Run options as columns: a run's name (its work directory and `${{ run.id }}`) and whether it
-- skips the step cache. Earlier versions kept them in `params` as `__run_name` and `__no_cache`;
-- they move here, so params hold only the pipeline's parameters.
ALTER TABLE runs ADD COLUMN name TEXT;
ALTER TABLE runs ADD COLUMN no_cache BOOLEAN NOT NULL DEFAULT false;

UPDATE runs
SET name = params ->> '__run_name',
    no_cache = COALESCE(params -> '__no_cache' = 'true'::jsonb, false),
    params = params - '__run_name' - '__no_cache'
WHERE params ? '__run_name' OR params ? '__no_cache';
