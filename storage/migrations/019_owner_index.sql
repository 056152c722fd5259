-- Each member's cursors, found by owner. A heartbeat renews the leases of the members
-- it beats for (`owner = member`), and a leave or a session sweep releases them; without
-- an index each looked through every cursor of the group, once per member: at 300 members
-- over 3,000 partitions a heartbeat of one process (10 members) read 30,000 rows, ~20 ms,
-- and the group's heartbeats alone kept a core of the server busy. Expand only: the
-- previous release runs the same statements, which simply get faster.
CREATE INDEX offsets_owner ON offsets (group_name, owner) WHERE owner IS NOT NULL;
