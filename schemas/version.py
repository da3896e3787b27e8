"""The schema version this code reads and writes."""

SCHEMA_VERSION = 1
