-- Disk as a resource: what each worker measured of the file system its work directory is on,
-- reported at registration and with every heartbeat. `disk_free` is the space available to it
-- (statvfs `f_bavail`), `disk_total` the file system's size, `scratch_free` the scratch it offers
-- to claims then: the free bytes less its reserve and its leases' scratch, at most its
-- configured `--scratch` less its leases'. NULL: never reported (a worker of an older version).
ALTER TABLE workers ADD COLUMN disk_free BIGINT;
ALTER TABLE workers ADD COLUMN disk_total BIGINT;
ALTER TABLE workers ADD COLUMN scratch_free BIGINT;
