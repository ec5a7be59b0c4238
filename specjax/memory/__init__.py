"""The search loop's memory store: one verified JSON record per validated mechanism set."""

from specjax.memory.store import (SCHEMA_VERSION, MemoryRecord, MemoryRecordError, MemoryStore,
                                  RecordNotFound, seed_configs, utc_now)

__all__ = ["SCHEMA_VERSION", "MemoryRecord", "MemoryRecordError", "MemoryStore", "RecordNotFound",
           "seed_configs", "utc_now"]
