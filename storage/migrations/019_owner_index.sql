-- Each member's cursors, found by owner. A heartbeat renews the leases of the members
-- it beats for (`owner = member`), and a leave or a session sweep releases them; without
-- an index each looked through every cursor of the group, once per member, so a beat's
-- cost grew with the group's size times the members it beats for, and a large group's
-- heartbeats alone kept the server busy. Expand only: the previous release runs the same
-- statements, which simply get faster.
CREATE INDEX offsets_owner ON offsets (group_name, owner) WHERE owner IS NOT NULL;
