"""History: the PySpark job that archives records to Parquet and compacts the log.

`run_compaction(dsn, schema, ...)` runs (or resumes) one run; `bus compact`
and `spark-submit storage/compaction/job.py` call it. See `job.py` for what
counts as history and how a run survives crashes, `spark.py` for Java 17 and
the JDBC driver.
"""

from storage.compaction.job import (
    CRASH_POINTS,
    CompactionBusyError,
    CompactionCrash,
    CompactionReport,
    PartitionOutcome,
    Progress,
    run_compaction,
)
from storage.compaction.spark import SparkSetupError, jdbc_target, spark_session

__all__ = [
    "CRASH_POINTS",
    "CompactionBusyError",
    "CompactionCrash",
    "CompactionReport",
    "PartitionOutcome",
    "Progress",
    "SparkSetupError",
    "jdbc_target",
    "run_compaction",
    "spark_session",
]
