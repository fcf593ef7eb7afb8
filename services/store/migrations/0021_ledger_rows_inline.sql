-- A ledger row of up to a page is stored as it is: no compression, no TOAST (issue 19).
--
-- A transition row holds its record (the canonical bytes that were hashed) and the state
-- after it. With a 1 KB patch the row is about 3 KB, over Postgres's default TOAST
-- threshold (about 2 KB): every insert tried to compress the record, then the state
-- (canonical JSON carrying opaque values such as base64 receipts compresses little),
-- and then moved the record out of line, one more row and one more index entry in the
-- TOAST table, which the key-index trigger and every reader of the record then fetched
-- back. Measured end to end (c=32, fresh database, three alternating pairs): 37 to 72 µs
-- less Postgres CPU per commit and 5 to 13 % more commits a second.
--
-- Rows up to toast_tuple_target bytes (its maximum, 8160: a page less its header) now
-- stay inline and uncompressed; larger ones are compressed and moved out of line as
-- before, until they fit that target. Rows written before this migration keep the form
-- they were written in (a reloption changes no row). The cost: a 2 to 8 KB row whose
-- JSON would have compressed now takes its full size on disk.

ALTER TABLE ztate.transitions SET (toast_tuple_target = 8160);
