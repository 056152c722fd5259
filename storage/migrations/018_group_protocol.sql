-- The group protocol's version. Expand only: two nullable columns that release 0.1.0
-- neither writes nor reads, so it keeps joining and leading groups beside this release.
-- members.protocol: the highest group protocol the member's library speaks (NULL: a
-- member of release 0.1.0, which speaks protocol 1). groups.protocol: the protocol of
-- the current generation, written by the leader with the assignment: the lowest any
-- live member speaks, so a mixed group runs on what every member understands.
ALTER TABLE members ADD COLUMN protocol smallint NULL CHECK (protocol >= 1);
ALTER TABLE groups ADD COLUMN protocol smallint NULL CHECK (protocol >= 1);
