-- Run options as columns: a run's name (its work directory and `${{ run.id }}`) and whether it
-- skips the step cache. Earlier versions kept them in `params` as `__run_name` and `__no_cache`;
-- they move here, so params hold only the pipeline's parameters.
ALTER TABLE runs ADD COLUMN name TEXT;
ALTER TABLE runs ADD COLUMN no_cache INTEGER NOT NULL DEFAULT 0 CHECK (no_cache IN (0, 1));

UPDATE runs
SET name = json_extract(params, '$.__run_name'),
    no_cache = CASE WHEN json_type(params, '$.__no_cache') = 'true' THEN 1 ELSE 0 END,
    params = json_remove(params, '$.__run_name', '$.__no_cache')
WHERE json_type(params, '$.__run_name') IS NOT NULL OR json_type(params, '$.__no_cache') IS NOT NULL;
